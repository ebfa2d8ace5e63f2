"""INT as deployed, for `quantize --eval`: weight-only INT runs as it is (its linears hold the
checkpoint's dequantized weights); W8A8, and INT4 with `--eval-activations int8` (W4A8, as
vLLM's CPU build serves INT4 on AMX), with their activations rounded to int8 as vLLM's
kernels do.

The quantized linears already hold the checkpoint's dequantized weights (`calib/quantizers/
base.record`); `int8_runtime(model, quantized, kernels)` adds a forward pre-hook to each that
replaces its input x by the int8 values vLLM's kernel computes from it (`kernels/int8_act.
fake_quantize`): per token, or with the linear's static `input_scale` (W8A8 static, where the
kernel reads it: the AMX "sgl" path quantizes per token whatever the checkpoint says). The
hooks are removed on exit, so the model can still be written afterwards.

`int8_kernels` picks each linear's kernel: vLLM's choice on the device (W8A8), or the AMX
kernel for W4A8 (weight-only INT4 served with int8 activations). What this module does not
know: how the weights were quantized or how they are stored.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn

EVALUATED = "the quantized model in memory, whose linear weights are exactly the checkpoint's dequantized values"
# Added to EVALUATED with --eval-activations int8.
W4A8_EVALUATED = (
    ", with each quantized linear's input rounded to int8 per token as vLLM's CPU build does on AMX CPUs (W4A8)"
)
W8A8_EVALUATED = (
    "the W8A8 model as served: linear weights exactly the checkpoint's dequantized int8 values, each quantized "
    "linear's input rounded to int8 as vLLM's kernel on this device rounds it (per token, or with the static "
    "input_scale where that kernel reads it; vLLM's AMX path on CPUs quantizes per token)"
)


def _w8a8(scheme: Any) -> bool:
    return scheme.int8_activations != "none"


def as_deployed(
    module: nn.Module,
    quantized: Mapping[str, Any],
    scheme: Any,
    kv_scales: Mapping[str, tuple[float, float]],
    activations: str,
    device_type: str,
) -> contextlib.AbstractContextManager:
    """W8A8, and INT4 with `activations` "int8" (W4A8): `int8_runtime` with vLLM's kernels on
    `device_type`; weight-only INT: the module as it is."""
    if _w8a8(scheme) or activations == "int8":
        return int8_runtime(module, quantized, int8_kernels(quantized, device_type, w4a8=not _w8a8(scheme)))
    return contextlib.nullcontext(module)


def evaluated(scheme: Any, activations: str) -> str:
    if _w8a8(scheme):
        return W8A8_EVALUATED
    return EVALUATED + (W4A8_EVALUATED if activations == "int8" else "")


def eval_activations(scheme: Any, activations: str, quantized: Mapping[str, Any], device_type: str) -> str:
    """ "int8 per token, W4A8 (sgl, 30 linears)", "int8 static input_scale (onednn, 7 linears); ..."
    or "unquantized"."""
    w8a8 = _w8a8(scheme)
    if not w8a8 and activations != "int8":
        return "unquantized"
    kernels = int8_kernels(quantized, device_type, w4a8=not w8a8)
    static = w8a8 and scheme.int8_activations == "static"
    parts = []
    for k in sorted(set(kernels.values())):
        mode = "static input_scale" if static and k != "sgl" else "per token"
        parts.append(
            f"int8 {mode}{', W4A8' if not w8a8 else ''} ({k}, {sum(v == k for v in kernels.values())} linears)"
        )
    return "; ".join(parts)


def eval_activation_modes(scheme: Any) -> tuple[str, ...]:
    """INT4 and W8A8 take "int8" (W4A8 / the kernel's rounding); other bit widths "auto" only."""
    return ("auto", "int8") if _w8a8(scheme) or scheme.bits == 4 else ("auto",)


def int8_kernels(quantized: Mapping[str, Any], device_type: str, w4a8: bool) -> dict[str, str]:
    """{linear name: the `kernels/int8_act` kernel vLLM rounds its activations with}."""
    from infer_tool.kernels.int8_act import vllm_kernel

    if w4a8:
        return dict.fromkeys(quantized, "sgl")
    return {n: vllm_kernel(device_type, *w.shape) for n, w in quantized.items()}


@contextlib.contextmanager
def int8_runtime(model: nn.Module, quantized: Mapping[str, Any], kernels: Mapping[str, str]) -> Iterator[nn.Module]:
    """`quantized`: {linear name: QuantizedWeight (its `input_scale` when static)}; `kernels`:
    {linear name: kernel} (`int8_kernels`)."""
    from infer_tool.kernels.int8_act import fake_quantize

    def hook(w: Any, kernel: str) -> Any:
        static = None if kernel == "sgl" else getattr(w, "input_scale", None)

        def pre(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x = args[0]
            scale = None if static is None else static.to(x.device)
            return (fake_quantize(x, scale, kernel=kernel).to(x.dtype), *args[1:])

        return pre

    handles = []
    try:
        for name, w in quantized.items():
            handles.append(model.get_submodule(name).register_forward_pre_hook(hook(w, kernels[name])))
        yield model
    finally:
        for h in handles:
            h.remove()
