"""`Mxfp8Linear`: `y = a(x) @ (values * 2 ** (u - 127))ᵀ + b`, MXFP8 weights `(N, K)` run by the
FP8 GEMM (`kernels/fp8.py`, W8A16) with one float32 scale per `(1, 32)` block, which is
exactly the E8M0 scale: fused Triton on CUDA, the torch reference on CPU. With `w8a8`, a(x)
rounds the input to MXFP8 as vLLM does (`numerics.qdq_activations`); otherwise a(x) = x.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from infer_tool.formats.mxfp8 import numerics
from infer_tool.kernels.fp8 import fp8_matmul

BLOCK = (1, numerics.GROUP_SIZE)  # the FP8 kernel's scale block: one row, 32 inputs


class Mxfp8Linear(nn.Module):
    """Buffers: `weight` float8_e4m3fn `(N, K)`, `weight_scale` uint8 `(N, K/32)` (E8M0, as the
    checkpoint stores them), `bias` `(N,)` or None."""

    def __init__(
        self, values: torch.Tensor, scale_exp: torch.Tensor, bias: torch.Tensor | None = None, *, w8a8: bool = False
    ) -> None:
        super().__init__()
        if values.dtype != torch.float8_e4m3fn or values.dim() != 2:
            raise ValueError(f"Mxfp8Linear: values must be float8_e4m3fn (N, K), got {values.dtype}")
        self.out_features, self.in_features = (int(d) for d in values.shape)
        if scale_exp.dtype != torch.uint8 or tuple(scale_exp.shape) != (
            self.out_features,
            self.in_features // numerics.GROUP_SIZE,
        ):
            raise ValueError(f"Mxfp8Linear: scale_exp must be uint8 (N, K/32), got {tuple(scale_exp.shape)}")
        self.w8a8 = w8a8
        self.register_buffer("weight", values)
        self.register_buffer("weight_scale", scale_exp)
        self.register_buffer("bias", bias)

    int8_kernel = None  # its activations are MXFP8 or unquantized, never int8

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Mxfp8Linear:
        """Moves keep the fp8 values and uint8 exponents as they are; only the bias is cast."""
        for name in ("weight", "weight_scale"):
            t = getattr(self, name)
            moved = fn(t)
            setattr(self, name, moved.to(t.dtype) if moved.dtype != t.dtype else moved)
        if self.bias is not None:
            self.bias = fn(self.bias)
        return self

    def activations_label(self) -> str | None:
        """ "mxfp8 (e4m3, e8m0 per 32)" with W8A8; None: unquantized."""
        return "mxfp8 (e4m3, e8m0 per 32)" if self.w8a8 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.w8a8:
            x2 = numerics.qdq_activations(x2)
        scale = numerics.scale_value(self.weight_scale)  # (N, K/32) float32, exact
        y = fp8_matmul(x2, self.weight, scale, "w8a16", BLOCK)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"activations={'mxfp8' if self.w8a8 else 'unquantized'}"
        )
