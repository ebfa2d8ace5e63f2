"""Measure what each attention layer writes into its KV cache, for FP8 KV-cache scales.

vLLM's FP8 KV cache stores keys after the rotary embedding and values as projected, each
scaled by one per-layer `k_scale` / `v_scale` = amax / 448. So the statistic is the largest
|key| and |value| that the attention module hands to its cache's `update()`, measured
the way llm-compressor / compressed-tensors do: a forward pre-hook on every attention
module swaps the cache argument for a recorder that observes `update(key_states,
value_states, ...)` and passes the call on to the real cache (or returns the states
unchanged when the model runs without one).

Attention modules are found as compressed-tensors does: a module with a key/value
projection child (`k_proj`, `v_proj`, fused `qkv_proj`, GPT-2's `c_attn`) whose
`forward` takes a cache argument. Run this on the model whose KV cache you will quantize
(after its weights were quantized, so the scales see the deployed activations).

This module measures amax only; turning amax into scales and tensor names is packers'
(`packers/fp8.py`, `packers/fp8_formats.py`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from infer_tool.common.errors import BadInput
from infer_tool.common.progress import Progress, no_progress

KV_PROJECTIONS = ("k_proj", "v_proj", "qkv_proj", "c_attn")
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value")  # transformers 5.x, 4.5x, older
BATCH_SIZE = 8  # calibration sequences per forward


@dataclass
class KvAmax:
    """max |key| (after RoPE) and max |value| one attention layer stored, over `tokens` tokens."""

    k_amax: float = 0.0
    v_amax: float = 0.0
    tokens: int = 0

    def observe(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """key_states, value_states `(B, H_kv, T, D)`."""
        self.k_amax = max(self.k_amax, float(key_states.detach().abs().amax()))
        self.v_amax = max(self.v_amax, float(value_states.detach().abs().amax()))
        self.tokens += int(key_states.shape[0] * key_states.shape[-2])


class _RecordingCache:
    """Stands in for the model's cache inside one attention module for one call."""

    def __init__(self, stats: KvAmax, real: Any) -> None:
        self._stats = stats
        self._real = real

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self._stats.observe(key_states, value_states)
        if self._real is None:
            return key_states, value_states
        return self._real.update(key_states, value_states, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        real = self.__dict__.get("_real")
        if real is None:
            raise AttributeError(name)
        return getattr(real, name)


def _cache_argument(module: nn.Module) -> tuple[str, int] | None:
    """(name, positional index after self) of the cache parameter of `module.forward`."""
    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return None
    for name in CACHE_ARGUMENTS:
        if name in params:
            return name, params.index(name)
    return None


def attention_modules(model: nn.Module) -> dict[str, tuple[nn.Module, str, int]]:
    """{module name: (module, cache argument name, its position)} for every attention layer."""
    found = {}
    for name, module in model.named_modules():
        if not any(isinstance(getattr(module, p, None), nn.Module) for p in KV_PROJECTIONS):
            continue
        arg = _cache_argument(module)
        if arg is not None:
            found[name] = (module, *arg)
    return found


@contextlib.contextmanager
def recording_kv(root: nn.Module, prefix: str = "") -> Iterator[dict[str, KvAmax]]:
    """While open, every attention module under `root` records the keys / values it
    hands to its cache; yields {`prefix` + module name: KvAmax}."""
    attn = attention_modules(root)
    if not attn:
        raise BadInput(
            f"{type(root).__name__} has no attention module with a k/v projection and a cache "
            f"argument ({', '.join(CACHE_ARGUMENTS)}); FP8 KV-cache scales cannot be calibrated for it"
        )
    stats = {f"{prefix}{name}": KvAmax() for name in attn}

    def make_hook(s: KvAmax, arg: str, pos: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            # `pos` indexes forward's parameters without `self` (a bound method's signature)
            if len(args) > pos:
                args = (*args[:pos], _RecordingCache(s, args[pos]), *args[pos + 1 :])
            else:
                kwargs[arg] = _RecordingCache(s, kwargs.get(arg))
            return args, kwargs

        return hook

    handles = [
        module.register_forward_pre_hook(make_hook(stats[f"{prefix}{name}"], arg, pos), with_kwargs=True)
        for name, (module, arg, pos) in attn.items()
    ]
    try:
        yield stats
    finally:
        for h in handles:
            h.remove()
    missing = [n for n, s in stats.items() if s.tokens == 0]
    if missing:
        raise BadInput(
            f"attention modules {missing[:4]} never wrote to their KV cache during calibration; "
            "this architecture's attention does not call cache.update(), so FP8 KV scales cannot be measured"
        )


@torch.no_grad()
def measure_kv_amax(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    batch_size: int = BATCH_SIZE,
    progress: Progress | None = None,
) -> dict[str, KvAmax]:
    """Run `input_ids` `(B, T)` through `model` in chunks and return {attention module name:
    KvAmax} of the keys (post-RoPE) and values each layer stores in its cache."""
    progress = progress or no_progress
    device = next(model.parameters()).device
    total = input_ids.shape[0]
    with recording_kv(model) as stats:
        for start in range(0, total, batch_size):
            model(input_ids=input_ids[start : start + batch_size].to(device), use_cache=False)
            progress("kv-cache scales", min(start + batch_size, total), total)
    return stats
