"""Run an in-memory INT-quantized model with its activations rounded to int8 as vLLM's kernels
do, for `quantize --eval`.

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
