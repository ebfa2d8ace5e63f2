"""MODEL as a hub id that is no preset (sizing/hub.py): config.json from the local hub cache,
else one GET from the hub, here a server on the loopback address standing in for it
(HF_ENDPOINT); gated, missing and offline answers are one-line refusals. The oracle: a hub
copy of a preset's config gives the preset's numbers."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infer_tool.cli.app import app
from infer_tool.common.errors import BadInput
from infer_tool.jobs.kv_budget import replay_log
from infer_tool.sizing.presets import find_model_preset
from infer_tool.sizing.resolve import resolve_model

LOGS = Path(__file__).resolve().parent / "fixtures" / "kv_logs"
QWEN3_8B = find_model_preset("qwen3-8b").config
runner = CliRunner()


class _Hub(BaseHTTPRequestHandler):
    """GET /{org}/{name}/resolve/{rev}/config.json from `files`; `seen` keeps each request's headers."""

    files: dict[str, tuple[int, bytes]] = {}
    seen: list[dict[str, str]] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.seen.append(dict(self.headers))
        code, body = self.files.get(self.path, (404, b"Entry not found"))
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Hub.files = {
        "/acme/qwen3-copy/resolve/main/config.json": (200, json.dumps(QWEN3_8B).encode()),
        "/acme/gated/resolve/main/config.json": (401, b"gated"),
        "/acme/huge/resolve/main/config.json": (200, b" " * (64 * 2**20 + 1)),
        "/acme/deep/resolve/main/config.json": (200, b"[" * 10_000 + b"]" * 10_000),
    }
    _Hub.seen = []
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield _Hub
    server.shutdown()
    server.server_close()


def test_a_hub_copy_of_a_preset_sizes_as_the_preset(hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    ours, preset = resolve_model("acme/qwen3-copy").shape, resolve_model("qwen3-8b").shape
    assert (ours.layers, ours.params) == (preset.layers, preset.params)
    assert hub.seen[-1]["Authorization"] == "Bearer hf_secret"


def test_the_local_hub_cache_is_read_before_the_hub(hub, tmp_path):
    repo = tmp_path / "hf" / "hub" / "models--acme--cached-only"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text(json.dumps(QWEN3_8B))
    assert resolve_model("acme/cached-only").shape.layers == resolve_model("qwen3-8b").shape.layers
    assert hub.seen == []  # nothing was asked of the hub


@pytest.mark.parametrize(
    ("repo", "needle"),
    [
        ("acme/gated", "is gated or private: set HF_TOKEN"),
        ("acme/missing", "has no config.json on the hub"),
        ("acme/huge", "larger than 67,108,864 bytes"),
        ("acme/deep", "nests deeper than 64 levels"),
    ],
)
def test_refusals_are_one_line(hub, repo, needle):
    with pytest.raises(BadInput, match=needle) as e:
        resolve_model(repo)
    assert "\n" not in str(e.value)


def test_offline_and_unreachable(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(BadInput, match="HF_HUB_OFFLINE is set"):
        resolve_model("acme/qwen3-copy")
    assert hub.seen == []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    with pytest.raises(BadInput, match="cannot be reached.*or a preset: did you mean"):
        resolve_model("acme/qwen3-copy")


def test_cli_and_from_log_take_a_hub_id(hub):
    r = runner.invoke(app, ["kv-budget", "acme/qwen3-copy", "--context", "8k", "--json"])
    assert r.exit_code == 0, r.output
    preset = runner.invoke(app, ["kv-budget", "qwen3-8b", "--context", "8k", "--json"])
    ours, theirs = json.loads(r.stdout), json.loads(preset.stdout)
    for key in ("kv_bytes_per_token", "max_concurrency", "memory", "rows"):
        assert ours[key] == theirs[key], key
    text = (LOGS / "qwen3-8b-a100-40gb-0.19.1.log").read_text()
    hub_log = replay_log(text.replace("Qwen/Qwen3-8B", "acme/qwen3-copy"))
    preset_log = replay_log(text)
    assert any("hub id the log names" in n for n in hub_log.notes)
    assert hub_log.concurrency_at_logged == preset_log.concurrency_at_logged
    assert [t.predicted for t in hub_log.terms] == [t.predicted for t in preset_log.terms]
