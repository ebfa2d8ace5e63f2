"""The fp baseline's perplexity cache (`evals/ppl_cache.py`): hits return the computed
numbers bit for bit, anything the number depends on changes the key, writes are atomic and
survive concurrent writers, a broken cache is skipped; `quantize --eval` and
`eval ppl --baseline` read it on their second run and say so."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest
import torch
from tiny import TEXT, make_llama, save_tiny_llama
from typer.testing import CliRunner

from infer_tool.cli.app import app
from infer_tool.evals import ppl_cache
from infer_tool.evals.ppl import evaluate_ppl
from infer_tool.evals.ppl_cache import cached_ppl, entry_path, identity, lookup, store

runner = CliRunner()


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("INFER_TOOL_CACHE", str(root))
    monkeypatch.delenv(ppl_cache.DISABLE_ENV, raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return root


@pytest.fixture(autouse=True, scope="module")
def one_thread():  # noqa: ANN201
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def counted(model: torch.nn.Module, ids: torch.Tensor, seq_len: int, calls: list[int], stride: int | None = None):  # noqa: ANN201
    def compute():  # noqa: ANN202
        calls.append(1)
        return evaluate_ppl(model, ids, seq_len, stride=stride)

    return compute


def ids_of(n: int = 200, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed))


def test_second_call_reads_the_cache_bit_for_bit(cache: Path) -> None:
    model, ids, calls = make_llama(64), ids_of(), []
    first, use1 = cached_ppl(model, ids, 32, counted(model, ids, 32, calls), backend="b", corpus="c")
    second, use2 = cached_ppl(model, ids, 32, counted(model, ids, 32, calls), backend="b", corpus="c")
    assert calls == [1] and not use1.hit and use2.hit
    assert second == first  # every field, floats exactly (JSON round-trips doubles)
    assert Path(use2.path).parent == cache / "ppl" and "read from the ppl cache" in use2.note("ppl before")
    assert not list((cache / "ppl").glob(".ppl-*"))  # no temporary file left


def test_the_key_covers_what_the_number_depends_on() -> None:
    """Weights (one element moved by one ulp), tokens, windows, dtype, backend: each a new entry."""
    model, ids = make_llama(64), ids_of()
    base = identity(model, ids, 32, stride=None, backend="b", corpus="c")
    variants = []
    with torch.no_grad():
        p = model.model.layers[0].mlp.down_proj.weight
        old = p[0, 0].clone()
        p[0, 0] = torch.nextafter(old, torch.tensor(1.0))
        variants.append(identity(model, ids, 32, stride=None, backend="b", corpus="c"))
        p[0, 0] = old
    assert identity(model, ids, 32, stride=None, backend="b", corpus="c") == base  # restored: same key
    variants += [
        identity(model, ids_of(seed=1), 32, stride=None, backend="b", corpus="c"),
        identity(model, ids[:-1], 32, stride=None, backend="b", corpus="c"),
        identity(model, ids, 64, stride=None, backend="b", corpus="c"),
        identity(model, ids, 32, stride=16, backend="b", corpus="c"),
        identity(model, ids, 32, stride=None, backend="other", corpus="c"),
        identity(model.to(torch.bfloat16), ids, 32, stride=None, backend="b", corpus="c"),
    ]
    keys = {entry_path(v, Path("/x")) for v in variants}
    assert len(keys) == len(variants) and entry_path(base, Path("/x")) not in keys


def test_a_corrupt_or_foreign_entry_is_recomputed(cache: Path) -> None:
    model, ids, calls = make_llama(64), ids_of(), []
    first, use = cached_ppl(model, ids, 32, counted(model, ids, 32, calls), backend="b", corpus="c")
    path = Path(use.path)
    path.write_text('{"identity": {"weights": "tru')  # a torn write, as a non-atomic writer could leave
    again, use = cached_ppl(model, ids, 32, counted(model, ids, 32, calls), backend="b", corpus="c")
    assert calls == [1, 1] and not use.hit and again.ppl == first.ppl
    entry = json.loads(path.read_text())
    entry["identity"]["tokens"] = "0" * 64  # same file name, another identity: never trusted
    path.write_text(json.dumps(entry))
    _, use = cached_ppl(model, ids, 32, counted(model, ids, 32, calls), backend="b", corpus="c")
    assert calls == [1, 1, 1] and not use.hit


def test_a_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, ids = make_llama(64), ids_of()
    ident = identity(model, ids, 32, stride=None, backend="b", corpus="c")
    result = evaluate_ppl(model, ids, 32)
    path = entry_path(ident, tmp_path)

    def broken(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ppl_cache.os, "fsync", broken)
    with pytest.raises(OSError):
        store(ident, result, path)
    assert not path.exists() and not list(path.parent.iterdir())


def test_unwritable_cache_is_skipped(cache: Path) -> None:
    cache.mkdir()
    (cache / "ppl").write_text("a file where the directory should be")
    model, ids, calls = make_llama(64), ids_of(), []
    result, use = cached_ppl(model, ids, 32, counted(model, ids, 32, calls), backend="b", corpus="c")
    assert calls == [1] and not use.hit and use.path is None and "not cached" in use.note("ppl")
    assert result.ppl == evaluate_ppl(model, ids, 32).ppl


def test_not_used_under_a_distributed_launch_or_when_disabled(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    model, ids, calls = make_llama(64), ids_of(), []
    result = evaluate_ppl(model, ids, 32)  # computed here: under WORLD_SIZE=2 evaluate_ppl would join a process group
    for env, value in (("WORLD_SIZE", "2"), (ppl_cache.DISABLE_ENV, "1")):
        monkeypatch.setenv(env, value)
        for _ in range(2):
            _, use = cached_ppl(model, ids, 32, lambda: calls.append(1) or result, backend="b", corpus="c")
            assert not use.hit and use.skipped
        monkeypatch.delenv(env)
    assert len(calls) == 4 and not (cache / "ppl").exists()


def _writer(args: tuple[str, dict, dict, int]) -> None:
    root, ident, result, n = args
    from infer_tool.evals.ppl import PplResult

    for _ in range(n):
        store(ident, PplResult(**result), entry_path(ident, Path(root)))


def test_concurrent_writers_leave_one_whole_entry(tmp_path: Path) -> None:
    """Four processes rewrite the same entry 50 times each while this one reads it: every
    read is a whole entry, and no temporary file is left."""
    model, ids = make_llama(64), ids_of()
    ident = identity(model, ids, 32, stride=None, backend="b", corpus="c")
    result = evaluate_ppl(model, ids, 32)
    path = entry_path(ident, tmp_path)
    store(ident, result, path)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        pending = pool.map_async(_writer, [(str(tmp_path), ident, result.to_dict(), 50)] * 4)
        reads = 0
        while not pending.ready():
            found = lookup(ident, path)
            assert found is not None and found[0] == result
            reads += 1
        pending.get()
    assert reads > 0 and [p.name for p in path.parent.iterdir()] == [path.name]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pplcache")
    save_tiny_llama(root / "model")
    (root / "text.txt").write_text(TEXT * 4)
    return {"model": root / "model", "text": root / "text.txt"}


def _quantize(tiny_dir: dict[str, Path], out: Path, *extra: str) -> dict:
    r = runner.invoke(
        app,
        [
            "quantize",
            str(tiny_dir["model"]),
            "--method",
            "rtn",
            "--group-size",
            "32",
            "--calib",
            str(tiny_dir["text"]),
            "--num-samples",
            "2",
            "--seq-len",
            "32",
            "--eval",
            str(tiny_dir["text"]),
            "--eval-tokens",
            "256",
            "--eval-seq-len",
            "64",
            "--out",
            str(out),
            "--json",
            "--no-progress",
            *extra,
        ],
    )
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def test_quantize_eval_reads_the_baseline_on_its_second_run(tiny_dir: dict[str, Path], tmp_path: Path) -> None:
    first = _quantize(tiny_dir, tmp_path / "a")
    second = _quantize(tiny_dir, tmp_path / "b")
    assert first["eval"]["ppl_before_cached"] is False and second["eval"]["ppl_before_cached"] is True
    assert second["eval"]["ppl_before"] == first["eval"]["ppl_before"]
    assert any("read from the ppl cache" in n for n in second["notes"])
    assert second["eval"]["ppl_after"] == first["eval"]["ppl_after"]  # the quantized windows do not need the fp ones
    # A whole load hashes the same weights as the streamed run read layer by layer: the same entry.
    whole = _quantize(tiny_dir, tmp_path / "w", "--no-stream")
    assert whole["eval"]["ppl_before_cached"] is True and whole["eval"]["ppl_after"] == first["eval"]["ppl_after"]
    # The weights as evaluated are rounded to --dtype: another baseline, computed, not read.
    bf16 = _quantize(tiny_dir, tmp_path / "c", "--dtype", "bfloat16")
    assert bf16["eval"]["ppl_before_cached"] is False and bf16["eval"]["ppl_before"] != first["eval"]["ppl_before"]


def test_eval_ppl_baseline_reads_the_cache(
    tiny_dir: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = tmp_path / "q"
    monkeypatch.setenv(ppl_cache.DISABLE_ENV, "1")
    _quantize(tiny_dir, ckpt)
    monkeypatch.delenv(ppl_cache.DISABLE_ENV)
    args = [
        "eval",
        "ppl",
        str(ckpt),
        "--baseline",
        str(tiny_dir["model"]),
        "--data",
        str(tiny_dir["text"]),
        "--seq-len",
        "64",
        "--max-tokens",
        "256",
        "--json",
        "--no-progress",
    ]
    reports = []
    for _ in range(2):
        r = runner.invoke(app, args)
        assert r.exit_code == 0, r.stderr
        reports.append(json.loads(r.stdout))
    first, second = reports
    assert first["baseline"]["cached"] is False and second["baseline"]["cached"] is True
    assert second["baseline"]["ppl"] == first["baseline"]["ppl"] and second["ppl_ratio"] == first["ppl_ratio"]
    assert any("read from the ppl cache" in n for n in second["notes"])
    assert os.environ["INFER_TOOL_CACHE"] in second["notes"][-1]
    # quantize's fp baseline on the same tokens and windows is the same entry
    third = _quantize(tiny_dir, tmp_path / "r")
    assert third["eval"]["ppl_before_cached"] is True and third["eval"]["ppl_before"] == second["baseline"]["ppl"]
