"""FP4 as deployed, for `quantize --eval`: the in-memory model run the way vLLM's emulation runs it.

`fp4_runtime(model, quantized)` swaps each quantized `nn.Linear` whose `Fp4Weight` quantizes
activations (W4A4) for the kernels' `Fp4Linear`, whose input is quantize-dequantized as vLLM's
emulation does; weights-only layers stay as they are (their weights are already the
checkpoint's dequantized values). On exit the original modules are restored, so the model can
still be written as a checkpoint afterwards.

What this module does not know: how the weights were quantized or how they are stored.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn

EVALUATED = (
    "the FP4 model as vLLM's emulation runs it: linear weights exactly the checkpoint's dequantized E2M1 "
    "values; with W4A4 activations (NVFP4 / MXFP4), each quantized linear (the kernels' Fp4Linear) "
    "quantize-dequantizes its input as vLLM 0.32's CPU emulation does (NVFP4: the static input_global_scale and "
    "dynamic E4M3 scales per 16, `ref_nvfp4_quant_dequant`; MXFP4: dynamic E8M0 scales per 32)"
)


def as_deployed(
    module: nn.Module,
    quantized: Mapping[str, Any],
    scheme: Any,
    kv_scales: Mapping[str, tuple[float, float]],
    activations: str,
    device_type: str,
) -> contextlib.AbstractContextManager:
    """W4A4: `fp4_runtime`; weights only: the module as it is."""
    return fp4_runtime(module, quantized) if scheme.w4a4 else contextlib.nullcontext(module)


def evaluated(scheme: Any, activations: str) -> str:
    return EVALUATED


def eval_activations(scheme: Any, activations: str, quantized: Mapping[str, Any], device_type: str) -> str:
    return f"{scheme.fp4} W4A4 (vLLM's emulation)" if scheme.w4a4 else "unquantized"


def eval_activation_modes(scheme: Any) -> tuple[str, ...]:
    return ("auto",)


@contextlib.contextmanager
def fp4_runtime(model: nn.Module, quantized: Mapping[str, Any]) -> Iterator[nn.Module]:
    """`quantized`: {linear name: Fp4Weight}, names relative to `model`."""
    from infer_tool.kernels.fp4_layout import pack_fp4
    from infer_tool.kernels.quant_linear import Fp4Linear

    originals: dict[str, nn.Module] = {}
    try:
        for name, w in quantized.items():
            if w.activations != "fp4":
                continue
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            old = getattr(parent, child)
            device = old.weight.device
            bias = None if getattr(old, "bias", None) is None else old.bias.detach()
            igs = None if w.input_global_scale is None else w.input_global_scale.to(device)
            gs = None if w.global_scale is None else w.global_scale.to(device)
            new = Fp4Linear(
                pack_fp4(w.codes.to(device)), w.w_scale.to(device), gs, bias, w4a4=True, input_global_scale=igs
            )
            originals[name] = old
            setattr(parent, child, new)
        yield model
    finally:
        for name, old in originals.items():
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, old)
