"""MXFP8 as deployed, for `quantize --eval`: the in-memory model's quantized linears hold the
checkpoint's dequantized weights; with MXFP8 activations (W8A8) each one's input is rounded to
MXFP8 as vLLM does (`numerics.qdq_activations`) by a forward pre-hook, removed on exit."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn

from infer_tool.formats.mxfp8.numerics import qdq_activations

EVALUATED = (
    "the MXFP8 model in memory, whose linear weights are exactly the checkpoint's dequantized E4M3 values; with "
    "MXFP8 activations (W8A8), each quantized linear's input rounded to E4M3 with a dynamic E8M0 scale per 32, "
    "as vLLM's MXFP8 input quantizer rounds it"
)


@contextlib.contextmanager
def mxfp8_runtime(model: nn.Module, quantized: Mapping[str, Any]) -> Iterator[nn.Module]:
    """`quantized`: {linear name: Mxfp8Weight}, names relative to `model`."""

    def pre(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (qdq_activations(args[0]), *args[1:])

    handles = []
    try:
        for name in quantized:
            handles.append(model.get_submodule(name).register_forward_pre_hook(pre))
        yield model
    finally:
        for h in handles:
            h.remove()


def as_deployed(
    module: nn.Module,
    quantized: Mapping[str, Any],
    scheme: Any,
    kv_scales: Mapping[str, tuple[float, float]],
    activations: str,
    device_type: str,
) -> contextlib.AbstractContextManager:
    return mxfp8_runtime(module, quantized) if scheme.w8a8 else contextlib.nullcontext(module)


def evaluated(scheme: Any, activations: str) -> str:
    return EVALUATED


def eval_activations(scheme: Any, activations: str, quantized: Mapping[str, Any], device_type: str) -> str:
    return "mxfp8 (e4m3, e8m0 per 32)" if scheme.w8a8 else "unquantized"


def eval_activation_modes(scheme: Any) -> tuple[str, ...]:
    return ("auto",)
