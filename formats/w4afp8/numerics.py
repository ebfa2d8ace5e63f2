"""W4AFP8 as vLLM 0.32 runs it (its only kernel: CUTLASS W4A8 on Hopper, `kernels/linear/
mixed_precision/cutlass.py`).

Weights: the checkpoint's INT4 codes and group scales `s (N, G)`; at load vLLM turns the group
scales into e4m3 relative to a per-row scale (`quant_utils.convert_bf16_scales_to_fp8`):
`c = max_g |s| / 448` per row (vLLM's dynamic per-token floor applies), `f = e4m3(e4m3(s / c) / 8)`,
and the kernel multiplies by `f * (8 c)`. So the effective group scale is `e4m3(e4m3(s / c) / 8)
* 8c`: `s` rounded to 3 mantissa bits (and to e4m3's subnormals where `s / c` is below 2^-3).
Activations: e4m3 per token, dynamic (`QuantFP8` per token: the scale `max|x| / 448`, floored),
the FP8 kernels' `quantize_per_token`.
"""

from __future__ import annotations

import torch

from infer_tool.kernels.fp8 import quantize_per_token


def hopper_group_scales(scale: torch.Tensor) -> torch.Tensor:
    """float32 `(N, G)`: the group scales `scale (N, G)` as vLLM's W4A8-FP8 kernel applies them."""
    f, c = quantize_per_token(scale.float())  # e4m3 (N, G), per-row scale (N, 1)
    f = (f.float() / 8.0).to(torch.float8_e4m3fn)
    return f.float() * (c * 8.0)


def qdq_activations(x: torch.Tensor) -> torch.Tensor:
    """Per-token dynamic e4m3 quantize-dequantize of x `(..., K)`, in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, a_scale = quantize_per_token(x2)
    return (xq.float() * a_scale).reshape(x.shape).to(x.dtype)
