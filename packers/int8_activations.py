"""INT8 weights and static INT8 activation scales, as compressed-tensors' `int-quantized`
format stores them (W8A8 and W8A16).

Weights: the INT solvers (RTN, GPTQ) with `bits=8, symmetric=True` return the canonical
`QuantizedWeight`: codes q uint8 0..255 with the implied zero point 128 and scale = absmax / 127
per group. The format stores the signed codes q - 128 as int8 `weight` (N, K) and the scales as
`weight_scale` (N, G) ((N, 1) per output channel), dequantized as weight * weight_scale
(`QuantizedWeight.int8()`).
RTN codes lie in [-127, 127] (|w| / scale <= 127); GPTQ's error feedback can reach -128.

Static activations: one per-tensor `input_scale` = act_abs_max / 127, so that every calibrated
value is representable without clipping (dynamic per-token activations use the same rule on
each token at run time, `kernels/int8_act.py`).

This module knows nothing about files or models.
"""

from __future__ import annotations

import torch

from infer_tool.common.errors import BadInput

INT8_MAX = 127
ZERO = 128  # the implied zero point of symmetric 8-bit codes in `QuantizedWeight`


def int8_input_scale(act_abs_max: float | torch.Tensor) -> torch.Tensor:
    """(1,) float32 static activation scale act_abs_max / 127 (1 when the input was all zero)."""
    a = torch.as_tensor(act_abs_max, dtype=torch.float32).reshape(1)
    if not bool(torch.isfinite(a).all()) or float(a) < 0:
        raise BadInput(
            f"activation abs-max {float(a)} is not finite and non-negative; the calibration inputs overflowed"
        )
    return torch.where(a > 0, a / INT8_MAX, torch.ones_like(a))
