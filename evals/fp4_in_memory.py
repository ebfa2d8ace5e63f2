"""Run an in-memory FP4-quantized model the way it is deployed, for evaluation.

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
