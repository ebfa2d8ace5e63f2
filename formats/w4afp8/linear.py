"""`W4Afp8Linear`: `y = a(x) @ Wᵀ + b`, the INT4 weight of `kernels/quant_linear.Int4Linear` (its
Triton W4A16 kernel on CUDA, the torch reference on CPU) at the group scales vLLM's W4A8-FP8
kernel applies (`numerics.hopper_group_scales`), with a(x) the input rounded to e4m3 per token."""

from __future__ import annotations

import torch

from infer_tool.formats.w4afp8.numerics import hopper_group_scales, qdq_activations
from infer_tool.kernels.quant_linear import Int4Linear
from infer_tool.packers.int_weight import QuantizedWeight


class W4Afp8Linear(Int4Linear):
    """An `Int4Linear` whose input is rounded to e4m3 per token when `fp8` is set."""

    fp8 = True

    @classmethod
    def of(cls, w: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype, *, fp8: bool = True) -> W4Afp8Linear:
        """From the INT4 weight `w`: vLLM's rounded group scales with `fp8`, else the stored ones."""
        scale = hopper_group_scales(w.scale) if fp8 else w.scale.float()
        layer = cls.from_unpacked(w.q, scale.to(dtype), w.zero, w.g_idx, w.group_size, bias)
        layer.fp8 = fp8
        return layer

    def activations_label(self) -> str | None:
        return "fp8 (e4m3) per token, W4AFP8" if self.fp8 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(qdq_activations(x) if self.fp8 else x)
