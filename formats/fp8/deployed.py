"""FP8 as deployed, for `quantize --eval`: the in-memory model run the way it is served.

`fp8_runtime(model, quantized, kv_scales)` swaps each quantized `nn.Linear` for the
kernels' `Fp8Linear` in W8A8 mode (activations rounded to e4m3 per token, or with the
static `input_scale`) and, with KV scales, rounds keys / values through e4m3 as an FP8
KV cache stores them; on exit the original modules and hooks are restored, so the
model can still be written as a checkpoint afterwards.

What this module does not know: how the weights were quantized or how they are stored.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn

EVALUATED = (
    "the FP8 model as deployed: quantized linears run as the kernels' Fp8Linear (W8A8: e4m3 weights, "
    "activations rounded to e4m3 per token or with the static input_scale), KV cache rounded through "
    "e4m3 with the calibrated k_scale/v_scale when --kv-cache fp8"
)


def as_deployed(
    module: nn.Module,
    quantized: Mapping[str, Any],
    scheme: Any,
    kv_scales: Mapping[str, tuple[float, float]],
    activations: str,
    device_type: str,
) -> contextlib.AbstractContextManager:
    """`fp8_runtime` with the calibrated KV scales (if any)."""
    return fp8_runtime(module, quantized, kv_scales or None)


def evaluated(scheme: Any, activations: str) -> str:
    return EVALUATED


def eval_activations(scheme: Any, activations: str, quantized: Mapping[str, Any], device_type: str) -> str:
    return f"fp8 (e4m3) {scheme.activations}"


def eval_activation_modes(scheme: Any) -> tuple[str, ...]:
    return ("auto",)


@contextlib.contextmanager
def fp8_runtime(
    model: nn.Module,
    quantized: Mapping[str, Any],
    kv_scales: Mapping[str, tuple[float, float]] | None = None,
    mode: str = "w8a8",
) -> Iterator[nn.Module]:
    """`quantized`: {linear name: Fp8Weight}; `kv_scales`: {attention name: (k_scale, v_scale)}."""
    from infer_tool.calib.kv_scales import add_fp8_kv_simulation
    from infer_tool.kernels.quant_linear import Fp8Linear

    originals: dict[str, nn.Module] = {}
    handles: list[Any] = []
    try:
        for name, w in quantized.items():
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            old = getattr(parent, child)
            device = old.weight.device
            bias = None if getattr(old, "bias", None) is None else old.bias.detach()
            inp = None if (w.input_scale is None or mode != "w8a8") else w.input_scale.to(device)
            new = Fp8Linear(w.weight.to(device), w.weight_scale.float().to(device), inp, bias, w.block_size, mode)
            originals[name] = old
            setattr(parent, child, new)
        if kv_scales:
            handles = add_fp8_kv_simulation(model, dict(kv_scales))
        yield model
    finally:
        for h in handles:
            h.remove()
        for name, old in originals.items():
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, old)
