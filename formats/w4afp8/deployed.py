"""W4AFP8 as deployed, for `quantize --eval`: each quantized linear is swapped for
`linear.W4Afp8Linear` (vLLM's rounded group scales, e4m3 per-token inputs); on exit the
original modules come back, so the model can still be written afterwards."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn

from infer_tool.formats.w4afp8.linear import W4Afp8Linear

EVALUATED = (
    "the W4AFP8 model as vLLM's W4A8-FP8 kernel runs it: each quantized linear's INT4 codes at the group scales "
    "rounded to e4m3 relative to their row's largest (as vLLM converts them at load), its input rounded to e4m3 "
    "per token"
)


@contextlib.contextmanager
def w4afp8_runtime(model: nn.Module, quantized: Mapping[str, Any]) -> Iterator[nn.Module]:
    """`quantized`: {linear name: QuantizedWeight}, names relative to `model`."""
    originals: dict[str, nn.Module] = {}
    try:
        for name, w in quantized.items():
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            old = getattr(parent, child)
            bias = None if getattr(old, "bias", None) is None else old.bias.detach()
            device = old.weight.device
            new = W4Afp8Linear.of(w.to(device), bias, old.weight.dtype)
            originals[name] = old
            setattr(parent, child, new)
        yield model
    finally:
        for name, old in originals.items():
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, old)


def as_deployed(
    module: nn.Module,
    quantized: Mapping[str, Any],
    scheme: Any,
    kv_scales: Mapping[str, tuple[float, float]],
    activations: str,
    device_type: str,
) -> contextlib.AbstractContextManager:
    return w4afp8_runtime(module, quantized)


def evaluated(scheme: Any, activations: str) -> str:
    return EVALUATED


def eval_activations(scheme: Any, activations: str, quantized: Mapping[str, Any], device_type: str) -> str:
    return "fp8 (e4m3) per token, W4AFP8"


def eval_activation_modes(scheme: Any) -> tuple[str, ...]:
    return ("auto",)
