"""A Hugging Face hub model's config.json, for MODEL given as a hub id (`org/name`): from
the local hub cache first (the snapshot transformers or `huggingface-cli` downloaded:
`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`), then, unless
`HF_HUB_OFFLINE` is set, one HTTPS GET of `{HF_ENDPOINT}/{id}/resolve/{revision}/config.json`
(`HF_TOKEN` sent as a bearer token, for gated models), bounded in time and size. Only
config.json is read, and nothing is written. Standard library only.
"""

from __future__ import annotations

import os
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from infer_tool.common.errors import BadInput
from infer_tool.sizing.json_file import MAX_BYTES, loads

ENDPOINT = "https://huggingface.co"
TIMEOUT_S = 15.0
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}", re.ASCII)
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-/]{0,127}", re.ASCII)


def is_repo_id(spec: str) -> bool:
    """Whether `spec` has the form of a hub id (`org/name`, no `..`)."""
    return bool(_REPO_ID.fullmatch(spec)) and ".." not in spec


def hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def cached_config(repo_id: str, revision: str = "main") -> Path | None:
    """config.json of `repo_id` in the local hub cache (the snapshot `refs/<revision>` names,
    else the newest snapshot that has one), or None."""
    repo = hub_cache() / f"models--{repo_id.replace('/', '--')}"
    ref = repo / "refs" / revision
    try:
        if ref.is_file():
            pinned = repo / "snapshots" / ref.read_text().strip() / "config.json"
            if pinned.is_file():
                return pinned
        snapshots = [p / "config.json" for p in (repo / "snapshots").iterdir() if (p / "config.json").is_file()]
    except OSError:
        return None
    return max(snapshots, key=lambda p: p.stat().st_mtime) if snapshots else None


def fetch_config(repo_id: str, revision: str = "main") -> dict[str, Any]:
    """config.json of `repo_id` fetched from the hub (see the module docstring); BadInput
    naming the id and what to do when it cannot be had."""
    if not _REVISION.fullmatch(revision) or ".." in revision:
        raise BadInput(f"revision {revision!r} is not a branch, tag or commit name")
    if _offline():
        raise BadInput(
            f"MODEL {repo_id!r} is not in the local hub cache ({hub_cache()}) and HF_HUB_OFFLINE is set: "
            "give MODEL as a directory with its config.json"
        )
    endpoint = os.environ.get("HF_ENDPOINT", ENDPOINT).rstrip("/")
    url = f"{endpoint}/{repo_id}/resolve/{revision}/config.json"
    request = urllib.request.Request(url, headers={"User-Agent": "infer-tool"})
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:  # noqa: S310 - https or HF_ENDPOINT
            body = response.read(MAX_BYTES + 1)
    except urllib.error.HTTPError as e:
        why = {
            401: "is gated or private: set HF_TOKEN to a token that may read it",
            403: "is gated: accept its licence on the hub and set HF_TOKEN",
            404: "has no config.json on the hub (check the id and the revision)",
        }.get(e.code, f"could not be read from the hub (HTTP {e.code})")
        raise BadInput(f"MODEL {repo_id!r} {why}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise BadInput(
            f"MODEL {repo_id!r}: the hub ({endpoint}) cannot be reached ({reason}); give MODEL as a directory "
            "with its config.json, or set HF_HUB_OFFLINE=1 to use the local cache only"
        ) from None
    if len(body) > MAX_BYTES:
        raise BadInput(f"MODEL {repo_id!r}: its config.json is larger than {MAX_BYTES:,} bytes")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise BadInput(f"MODEL {repo_id!r}: its config.json is not UTF-8 text") from None
    config = loads(text, url, "config.json")
    if not isinstance(config, dict):
        raise BadInput(f"{url}: not a config.json (a JSON object)")
    return config
