"""Launch configurations picked by measurement on a GPU, stored in the repository.

The Triton autotuner (`@triton.autotune`) times its candidates on the first call, which
needs a GPU, costs seconds per shape at run time and cannot run in CI. Here the search is
split from its use:

- `config_space(family, path, ...)` lists the candidates of one kernel path (tiles,
  split-K, warps, stages);
- a sweep on a GPU (`benchmarks/gpu_check.py --steps tune`) times them per key and writes
  the winners to `kernels/tuned/<gpu>.json` (`write_table`);
- at run time `lookup` returns the stored winner for the current GPU and key, used as-is;
  when the file or the key is absent the launchers fall back to their `choose_config`
  heuristics. CPU calls (the torch reference, or the Triton interpreter) never look.

A key is `(family, M bucket, N, K, group size)`: family "w4a16", "fp8-w8a8", "fp8-w8a16",
"nvfp4"/"mxfp4"; M bucketed by `m_bucket` (exact up to 4, then powers of two, capped);
N and K exact (the layer shapes of a model are few); group size 0 where the format has
none. File format: `{"gpu": name, "configs": {key string: {field: value}}}`.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import torch

TUNED_DIR = Path(__file__).resolve().parent / "tuned"
M_BUCKET_CAP = 4096


def m_bucket(M: int) -> int:
    """1, 2, 4 for decode (M <= 4, each its own GEMV shape), then the next power of two,
    capped at 4096 (beyond it every tiled config is bandwidth- and compute-saturated)."""
    if M < 1:
        raise ValueError(f"M must be >= 1, got {M}")
    return min(1 << (M - 1).bit_length(), M_BUCKET_CAP)


def key(family: str, M: int, N: int, K: int, group_size: int = 0) -> str:
    """The table key of one launch: `family|m<bucket>|n<N>|k<K>|g<group>`."""
    return f"{family}|m{m_bucket(M)}|n{N}|k{K}|g{group_size}"


def gpu_slug(name: str) -> str:
    """A file name for a GPU name: `NVIDIA H100 80GB HBM3` -> `nvidia_h100_80gb_hbm3`."""
    slug = re.sub(r"[^a-z0-9]+", "_", name.lower(), flags=re.ASCII).strip("_")
    if not slug:
        raise ValueError(f"GPU name {name!r} gives no file name")
    return slug


def table_path(gpu_name: str, directory: Path | None = None) -> Path:
    return (directory or TUNED_DIR) / f"{gpu_slug(gpu_name)}.json"


@functools.cache
def load_table(gpu_name: str, directory: Path | None = None) -> dict[str, dict[str, Any]]:
    """The stored configs of `gpu_name` (empty when there is no file). A file for another
    GPU name, or one that is not a `{"configs": {...}}` object, is refused."""
    path = table_path(gpu_name, directory)
    if not path.exists():
        return {}
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict) or not isinstance(doc.get("configs"), dict):
        raise ValueError(f"{path}: expected an object with a 'configs' object")
    if doc.get("gpu") not in (None, gpu_name):
        raise ValueError(f"{path}: holds configs of {doc.get('gpu')!r}, not {gpu_name!r}")
    return doc["configs"]


def _gpu_name(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_name(device)


def lookup(device: torch.device, family: str, M: int, N: int, K: int, group_size: int = 0) -> dict[str, Any] | None:
    """The stored winner for this key on `device`'s GPU, or None (no GPU, no file, no key)."""
    name = _gpu_name(torch.device(device))
    if name is None:
        return None
    return load_table(name).get(key(family, M, N, K, group_size))


def write_table(gpu_name: str, configs: dict[str, dict[str, Any]], directory: Path | None = None) -> Path:
    """Merge `configs` into the GPU's file (atomically: a temporary file, then a rename)."""
    path = table_path(gpu_name, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = dict(load_table(gpu_name, directory)) if path.exists() else {}
    old.update(configs)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"gpu": gpu_name, "configs": dict(sorted(old.items()))}, indent=1) + "\n")
    tmp.replace(path)
    load_table.cache_clear()
    return path


def config_space(family: str, path: str, M: int, default: dict[str, Any]) -> list[dict[str, Any]]:
    """Candidate configs (dicts of the launcher's config fields) around `default`, the
    launcher's heuristic for this shape, which comes first. SPLIT_K candidates are
    multiples of the default's; every candidate keeps the fields the path fixes."""
    split = int(default.get("SPLIT_K", 1))
    variations: list[dict[str, Any]]
    if path == "gemv":
        variations = [
            {"BLOCK_N": bn, "num_warps": w, "SPLIT_K": max(1, int(split * f))}
            for bn in (64, 128, 256)
            for w in (2, 4, 8)
            for f in (0.5, 1, 2)
            if bn * w <= 1024
        ]
        variations += [{"num_stages": s} for s in (1, 3, 4)]
    elif path == "splitk":
        variations = [
            {"BLOCK_N": bn, "num_warps": w, "num_stages": s, "SPLIT_K": max(1, int(split * f))}
            for bn in (64, 128)
            for w in (4, 8)
            for s in (2, 3, 4)
            for f in (0.5, 1, 2)
        ]
    elif path == "tiled":
        variations = [
            {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s}
            for bm in (64, 128)
            for bn in (64, 128, 256)
            for w in (4, 8)
            for s in (3, 4)
            if not (bm == 128 and bn == 256 and w == 4)
        ]
        if family.startswith("fp8"):
            variations += [{"BLOCK_K": bk} for bk in (64, 128)]
    else:
        raise ValueError(f"unknown kernel path {path!r}; expected gemv, splitk or tiled")
    out = [dict(default)]
    for v in variations:
        cand = {**default, **v}
        if cand not in out:
            out.append(cand)
    return out
