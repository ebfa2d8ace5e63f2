"""A cache of perplexities that do not change between runs: the fp baseline of
`quantize --eval` and of `eval ppl --baseline`, in `cache_dir()/ppl/`.

An entry is keyed by everything the number depends on, hashed into one `identity`:
- `weights`: sha256 over every parameter and buffer of the model *as evaluated* (name,
  dtype, shape, bytes): after `quantize` rounds the weights to `--dtype`, in the compute
  dtype, quantized modules' packed buffers included;
- `tokens`: sha256 of the evaluated token ids (int64), which pins the corpus, the
  tokenizer and the token count at once; `corpus` is kept for people reading the file;
- the window protocol (`seq_len`, `stride`, `PROTOCOL`);
- the compute dtype, the device (type, and the GPU's name on CUDA), the matmul backend,
  the model class, its config (minus its own path and version stamp) and attention
  implementation, and the torch and transformers versions.
An entry is read only when its stored identity equals the run's, field by field.

Beside an entry, `quantize --eval --kld` keeps the fp model's final hidden states of the
evaluated windows (`<key>.hidden.safetensors`: one (1, T, D) float32 tensor per window, the
last decoder layer's output): with the model's head, which quantizing leaves as it is, they
give the fp logits of every window, so a later run's KL divergence needs no fp pass.
Hidden states larger than MAX_HIDDEN_BYTES are not kept.

Writes are atomic: a temporary file in the cache directory, renamed over the entry
(`os.replace`), so a reader sees a whole entry or none. Two runs that compute the same
entry at once both write whole files and the last rename wins; both hold the same numbers.
A cache that cannot be read or written is skipped (the perplexity is computed), never an
error. Under a distributed launch (WORLD_SIZE > 1) the cache is not used: every rank must
take the same path, and a hit on one rank alone would leave its peers in the all-reduce.

What this module does not know: how the model was loaded or quantized.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from infer_tool.evals.ppl import PROTOCOL, PplResult

SUBDIR = "ppl"
DISABLE_ENV = "INFER_TOOL_NO_PPL_CACHE"  # set to 1: always compute, never read or write
HIDDEN_SUFFIX = ".hidden.safetensors"
MAX_HIDDEN_BYTES = 2**30  # larger fp hidden states are recomputed, not kept


@dataclass
class CacheUse:
    """How a perplexity was obtained: from the cache (`hit`), or computed and stored."""

    hit: bool
    path: str | None  # the entry (None when the cache was not used)
    computed_at: str | None = None  # when the cached number was computed (UTC, ISO 8601)
    skipped: str | None = None  # why the cache was not used

    def note(self, what: str) -> str | None:
        """A line for the report, or None when the number was computed and nothing is worth saying."""
        if self.hit:
            return (
                f"{what} read from the ppl cache ({self.path}, computed {self.computed_at}); "
                "delete the file to recompute"
            )
        if self.skipped:
            return f"{what} not cached: {self.skipped}"
        return None


def weights_digest(model: Any) -> str:
    """sha256 over every parameter and buffer of `model` (name, dtype, shape, raw bytes)."""
    return tensors_digest([*model.named_parameters(), *model.named_buffers()])


def tensors_digest(tensors: Iterable[tuple[str, Any]]) -> str:
    """sha256 over (name, tensor) pairs in order: name, dtype, shape, raw bytes. The pairs may
    be produced one at a time (a streamed model's tensors, read layer by layer)."""
    import torch

    h = hashlib.sha256()
    for name, t in tensors:
        t = t.detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        if t.numel():
            h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def tokens_digest(ids: Any) -> str:
    """sha256 of the token ids as int64 (T,)."""
    import torch

    return hashlib.sha256(ids.detach().to("cpu", torch.int64).contiguous().numpy().data).hexdigest()


def identity(
    model: Any,
    ids: Any,
    seq_len: int,
    *,
    stride: int | None,
    backend: str,
    corpus: str,
    weights: str | None = None,
    device: Any = None,
) -> dict[str, Any]:
    """Everything the perplexity of `model` on `ids` depends on (see the module docstring).
    weights / device: the weights' digest and the device where the model's own parameters
    cannot tell (a streamed model's skeleton); default `weights_digest(model)` and its device."""
    import torch
    import transformers

    param = next(model.parameters())
    device = torch.device(device) if device is not None else param.device
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    config = {k: v for k, v in model.config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    return {
        "weights": weights or weights_digest(model),
        "tokens": tokens_digest(ids),
        "token_count": int(ids.numel()),
        "corpus": corpus,
        "seq_len": int(seq_len),
        "stride": stride,
        "protocol": PROTOCOL,
        "dtype": str(param.dtype).removeprefix("torch."),
        "device": device_name,
        "backend": backend,
        "model_class": type(model).__name__,
        "config": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest(),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def entry_path(ident: dict[str, Any], root: Path | None = None) -> Path:
    if root is None:
        from infer_tool.calib.models import cache_dir

        root = cache_dir()
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()
    return root / SUBDIR / f"{key}.json"


def lookup(ident: dict[str, Any], path: Path) -> tuple[PplResult, str] | None:
    """The cached result and when it was computed, or None (no entry, unreadable, or another identity)."""
    try:
        entry = json.loads(path.read_text())
        if entry.get("identity") != ident:
            return None
        names = {f.name for f in fields(PplResult)}
        return PplResult(**{k: v for k, v in entry["result"].items() if k in names}), str(entry["computed_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store(ident: dict[str, Any], result: PplResult, path: Path) -> None:
    """Write the entry atomically (temporary file in the same directory, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {
        "identity": ident,
        "result": result.to_dict(),
        "computed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    fd, tmp = tempfile.mkstemp(prefix=".ppl-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def skipped_reason() -> str | None:
    """Why the cache is not used in this process, or None."""
    if os.environ.get(DISABLE_ENV) == "1":
        return f"{DISABLE_ENV}=1"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return "distributed launch"
    return None


def stored(ident: dict[str, Any], result: PplResult) -> CacheUse:
    """Store `result` under `ident`; how that went, as a `CacheUse` (a miss)."""
    path = entry_path(ident)
    try:
        store(ident, result, path)
    except OSError as e:
        return CacheUse(False, None, skipped=f"cannot write {path.parent}: {e.strerror or e}")
    return CacheUse(False, str(path))


def cached_ppl(
    model: Any,
    ids: Any,
    seq_len: int,
    compute: Callable[[], PplResult],
    *,
    stride: int | None = None,
    backend: str,
    corpus: str,
) -> tuple[PplResult, CacheUse]:
    """`compute()`'s perplexity of `model` on token ids `ids` (T,) (the windows of `seq_len` /
    `stride`), read from the cache when an entry of the same identity exists, else computed
    and stored. `ids` are the tokens evaluated (after any max_tokens cut)."""
    skipped = skipped_reason()
    if skipped:
        return compute(), CacheUse(False, None, skipped=skipped)
    ident = identity(model, ids, seq_len, stride=stride, backend=backend, corpus=corpus)
    path = entry_path(ident)
    found = lookup(ident, path)
    if found is not None:
        return found[0], CacheUse(True, str(path), found[1])
    result = compute()
    return result, stored(ident, result)


def hidden_path(entry: Path) -> Path:
    """The file of the fp final hidden states kept beside `entry`."""
    return entry.with_name(entry.stem + HIDDEN_SUFFIX)


def store_hidden(entry: Path, hidden: list[Any]) -> str | None:
    """Keep the fp final hidden states of every window, (1, T, D) each, beside `entry`
    (atomically); returns why they were not kept, or None."""
    from safetensors.torch import save_file

    size = sum(h.numel() * h.element_size() for h in hidden)
    if size > MAX_HIDDEN_BYTES:
        return f"the fp hidden states take {size / 2**30:.2f} GiB, above the cache's {MAX_HIDDEN_BYTES / 2**30:g} GiB"
    path = hidden_path(entry)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".hidden-", suffix=".tmp", dir=path.parent)
        os.close(fd)
        try:
            save_file(
                {f"window.{w}": h.detach().cpu().contiguous() for w, h in enumerate(hidden)},
                tmp,
                metadata={"windows": str(len(hidden))},
            )
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        return f"cannot write {path.parent}: {e.strerror or e}"
    return None


def has_hidden(entry: Path, windows: int) -> bool:
    """True when fp final hidden states for `windows` windows are kept beside `entry` (the
    header is read, not the tensors)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(hidden_path(entry)), "pt") as f:
            return (f.metadata() or {}).get("windows") == str(windows) and len(list(f.keys())) == windows
    except (OSError, KeyError, ValueError, SafetensorError):
        return False


def load_hidden(entry: Path, windows: int) -> list[Any] | None:
    """The fp final hidden states kept beside `entry` (one per window), or None when there are
    none for `windows` windows, or the file cannot be read."""
    from safetensors import SafetensorError, safe_open

    path = hidden_path(entry)
    try:
        with safe_open(str(path), "pt") as f:
            if (f.metadata() or {}).get("windows") != str(windows):
                return None
            return [f.get_tensor(f"window.{w}") for w in range(windows)]
    except (OSError, KeyError, ValueError, SafetensorError):  # missing, truncated or foreign: recompute
        return None
