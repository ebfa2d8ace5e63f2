"""The fp baseline of `quantize --eval` through the ppl cache (`evals/ppl_cache.py`).

The cache key holds a digest of the weights as evaluated. A streamed model never holds them
all: `weights_digest` reads them in the whole model's order (the tensors outside the layers
are loaded; each layer is read, hashed and freed), so a streamed run and a `--no-stream` run
of the same model share entries, and `eval ppl --baseline` of the rounded model does too.
One extra read of the weights buys skipping the fp half of the evaluation: its windows then
go through the quantized layers only.

A hit is kept in the run's progress directory, so `--resume` needs neither the cache nor
the fp hidden states it did not compute.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def weights_digest(lm: nn.Module, weights: Any, layers_path: str) -> str:
    """`ppl_cache.weights_digest(lm)` of the model as a whole load would give it. weights: the
    `StreamedWeights` of a skeleton (its tensors outside the layers loaded), or None."""
    from infer_tool.evals import ppl_cache

    if weights is None:
        return ppl_cache.weights_digest(lm)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        loaded: str | None = None
        names = [n for n, _ in lm.named_parameters()] + [n for n, _ in lm.named_buffers()]
        try:
            for name in names:
                parts = name.split(".")
                depth = len(layers_path.split("."))
                prefix = ".".join(parts[: depth + 1]) if name.startswith(f"{layers_path}.") else None
                if prefix != loaded and prefix is not None:
                    if loaded is not None:
                        weights.release(weights.names(loaded, layers_path))
                    weights.load(weights.names(prefix, layers_path), torch.device("cpu"))
                    loaded = prefix
                yield name, _tensor(lm, name)
        finally:
            if loaded is not None:
                weights.release(weights.names(loaded, layers_path))

    return ppl_cache.tensors_digest(tensors())


def _tensor(model: nn.Module, name: str) -> torch.Tensor:
    module_name, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(module_name) if module_name else model, attr)


def lookup(
    lm: nn.Module, weights: Any, layers_path: str, ids: torch.Tensor, seq_len: int, *, device: torch.device, corpus: str
) -> tuple[dict[str, Any] | None, Any, Any]:
    """(the cache identity or None when the cache is off, the cached `PplResult` or None, the
    `CacheUse`)."""
    from infer_tool.evals import ppl_cache

    skipped = ppl_cache.skipped_reason()
    if skipped:
        return None, None, ppl_cache.CacheUse(False, None, skipped=skipped)
    ident = ppl_cache.identity(
        lm,
        ids,
        seq_len,
        stride=None,
        backend=f"torch-{device.type} (unquantized)",
        corpus=corpus,
        weights=weights_digest(lm, weights, layers_path),
        device=device,
    )
    path = ppl_cache.entry_path(ident)
    found = ppl_cache.lookup(ident, path)
    if found is None:
        return ident, None, ppl_cache.CacheUse(False, None)
    return ident, found[0], ppl_cache.CacheUse(True, str(path), found[1])


def to_state(result: Any, use: Any) -> dict[str, Any]:
    """A cache hit as the run directory keeps it."""
    return {"result": result.to_dict(), "path": use.path, "computed_at": use.computed_at}


def from_state(state: dict[str, Any]) -> tuple[Any, Any]:
    """(`PplResult`, `CacheUse`) of a hit kept by `to_state`."""
    from dataclasses import fields

    from infer_tool.evals.ppl import PplResult
    from infer_tool.evals.ppl_cache import CacheUse

    names = {f.name for f in fields(PplResult)}
    result = PplResult(**{k: v for k, v in state["result"].items() if k in names})
    return result, CacheUse(True, state["path"], state["computed_at"])
