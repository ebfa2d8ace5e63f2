"""`W4Afp8Weight`: an INT4 weight (`packers/quantized.QuantizedWeight`, the INT solvers' result and
layout) that runs with FP8 activations; only how it is evaluated differs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from infer_tool.packers.deploy import Deploy
from infer_tool.packers.int_weight import QuantizedWeight


@dataclass
class W4Afp8Weight(QuantizedWeight):
    label = "W4AFP8"

    @classmethod
    def of(cls, w: QuantizedWeight) -> W4Afp8Weight:
        return cls(**{f.name: getattr(w, f.name) for f in fields(QuantizedWeight)})

    def takes_int8_activations(self, deploy: Deploy) -> bool:
        return False

    def to_linear(self, bias: torch.Tensor | None, dtype: torch.dtype, deploy: Deploy, where: str) -> Any:
        """`linear.W4Afp8Linear`: the INT4 GEMM at vLLM's e4m3-rounded group scales, its input
        rounded to e4m3 per token (unless activations are "none": the stored scales, W4A16)."""
        from infer_tool.formats.w4afp8.linear import W4Afp8Linear

        return W4Afp8Linear.of(self, bias, dtype, fp8=deploy.activations != "none")

    @classmethod
    def activations_note(
        cls, layers: Mapping[str, QuantizedWeight], deploy: Deploy, kernels: set[str], dtype: torch.dtype
    ) -> str:
        if deploy.activations == "none":
            return "activations unquantized, the stored group scales (W4AFP8 as W4A16)"
        return (
            "activations e4m3 per token as the checkpoint says (W4AFP8), group scales rounded to e4m3 as vLLM's "
            "W4A8-FP8 kernel applies them"
        )
