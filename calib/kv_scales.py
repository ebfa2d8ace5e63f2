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

`simulating_fp8_kv` does the reverse for evaluation: it rounds the keys / values each
attention layer hands to its cache through e4m3 with given k_scale / v_scale.

This module measures amax only; turning amax into scales and tensor names is packers'
(`packers/fp8.py`, `packers/codecs/fp8_formats.py`).
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


class _CacheProxy:
    """Stands in for the model's cache (or for None) inside one attention module: sees
    the post-RoPE keys / values of `update`, passes them on, delegates everything else."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def transform(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return key_states, value_states

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        key_states, value_states = self.transform(key_states, value_states)
        if self._real is None:
            return key_states, value_states
        return self._real.update(key_states, value_states, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        real = self.__dict__.get("_real")
        if real is None:
            raise AttributeError(name)
        return getattr(real, name)


class _RecordingCache(_CacheProxy):
    """Records the keys' / values' amax of one attention call."""

    def __init__(self, stats: KvAmax, real: Any) -> None:
        super().__init__(real)
        self._stats = stats

    def transform(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._stats.observe(key_states, value_states)
        return key_states, value_states


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


class _Fp8KvCache(_CacheProxy):
    """Keys / values go through e4m3 with the layer's static scales
    (x -> e4m3(clamp(x / s)) * s), as vLLM's FP8 KV cache stores them."""

    def __init__(self, k_scale: float, v_scale: float, real: Any) -> None:
        super().__init__(real)
        self._scales = (k_scale, v_scale)

    @staticmethod
    def _qdq(x: torch.Tensor, s: float) -> torch.Tensor:
        return ((x.float() / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * s).to(x.dtype)

    def transform(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._qdq(key_states, self._scales[0]), self._qdq(value_states, self._scales[1])


def add_fp8_kv_simulation(root: nn.Module, scales: dict[str, tuple[float, float]]) -> list[Any]:
    """Make the attention modules named in `scales` ({name: (k_scale, v_scale)}, names
    relative to `root`, as `read_kv_scales` returns them) round their keys / values through
    e4m3 before attention — the numerics of an FP8 KV cache, for evaluating a checkpoint's
    k_scale / v_scale on any device. Returns the hook handles (`.remove()` undoes it)."""
    attn = attention_modules(root)
    unknown = sorted(set(scales) - set(attn))
    if unknown:
        raise BadInput(f"KV scales for {unknown[:4]}, which are not attention modules of {type(root).__name__}")

    def make_hook(k: float, v: float, arg: str, pos: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if len(args) > pos:
                args = (*args[:pos], _Fp8KvCache(k, v, args[pos]), *args[pos + 1 :])
            else:
                kwargs[arg] = _Fp8KvCache(k, v, kwargs.get(arg))
            return args, kwargs

        return hook

    handles = []
    for name, (k, v) in scales.items():
        module, arg, pos = attn[name]
        handles.append(module.register_forward_pre_hook(make_hook(float(k), float(v), arg, pos), with_kwargs=True))
    return handles


@contextlib.contextmanager
def simulating_fp8_kv(root: nn.Module, scales: dict[str, tuple[float, float]]) -> Iterator[None]:
    """`add_fp8_kv_simulation` while the context is open."""
    handles = add_fp8_kv_simulation(root, scales)
    try:
        yield
    finally:
        for h in handles:
            h.remove()
