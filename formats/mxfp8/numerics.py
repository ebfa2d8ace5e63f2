"""MXFP8 numerics: E4M3 values with one E8M0 scale `2 ** (u - 127)` per 32 values along K.

Weights (compressed-tensors 0.20, `quantization/utils/mxfp_utils.generate_mx_scales` with
8 bits): a group's max |w| is rounded to a power of two by adding a quarter of its binade
(`round_to_power_2` with E2M1's mantissa width, as for every MX width but 6 bits), and the
scale exponent is `u = 127 + log2(that power) - 8` (8 = floor(log2(448))); values are
`e4m3(clamp(w / 2 ** (u - 127), ±448))`. Rounding up a group's max can exceed 448 after the
division, so the clamp saturates (as compressed-tensors' `_quantize` does). An all-zero group
gets u = 0. Dequantized: `value * 2 ** (u - 127)` (exact in float32).

Activations (vLLM 0.32 `mxfp8_utils._mxfp8_e4m3_quantize_torch`, its dynamic MXFP8 input
quantizer): per 32 along K, `u = ceil(log2(max|x| / 448)) + 127` clamped to [0, 254], so no
value saturates; values `e4m3(x / 2 ** (u - 127))`.
"""

from __future__ import annotations

import torch

GROUP_SIZE = 32
E4M3_MAX = 448.0
ELEM_OFFSET = 8  # floor(log2(448))
ROUND_UP = 1 << 21  # a quarter of a float32 binade: round_to_power_2 with a 1-bit element mantissa


def grouped(w: torch.Tensor) -> torch.Tensor:
    """(..., K) -> (..., K/32, 32); K must be a multiple of 32."""
    if w.shape[-1] % GROUP_SIZE:
        raise ValueError(f"MXFP8: K={w.shape[-1]} is not a multiple of {GROUP_SIZE}")
    return w.unflatten(-1, (-1, GROUP_SIZE))


def weight_scales(amax_g: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents uint8 `(N, G)` from group max |w| `(N, G)` (compressed-tensors' rule)."""
    bits = amax_g.to(torch.float32).abs().view(torch.int32)
    binade = ((bits + ROUND_UP) >> 23) & 0xFF  # float32 exponent field after the rounding
    return (binade - ELEM_OFFSET).clamp(0, 254).to(torch.uint8)


def scale_value(u: torch.Tensor) -> torch.Tensor:
    """float32 `2 ** (u - 127)` of E8M0 exponents u."""
    return torch.exp2(u.to(torch.float32) - 127.0)


def to_e4m3(scaled: torch.Tensor) -> torch.Tensor:
    """Saturating cast: clamp to ±448, round to nearest e4m3."""
    return scaled.to(torch.float32).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn values `(N, K)` of w `(N, K)` at the group exponents u `(N, K/32)`."""
    return to_e4m3(grouped(w.float()) / scale_value(u).unsqueeze(-1)).flatten(-2)


def dequantize(values: torch.Tensor, u: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`(N, K)` weight in `dtype`: the float32 product `value * 2 ** (u - 127)`, then cast."""
    return (grouped(values.float()) * scale_value(u).unsqueeze(-1)).flatten(-2).to(dtype)


def fake_quantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize w `(N,)` or `(N, K)` at float32 scales of the same shape, as float32."""
    return to_e4m3(w.float() / scale).float() * scale


def qdq_activations(x: torch.Tensor) -> torch.Tensor:
    """Dynamic MXFP8 input quantize-dequantize `(..., K)` -> x's dtype, as vLLM (module doc)."""
    xg = grouped(x.to(torch.float32))
    amax = xg.abs().amax(dim=-1).clamp(min=torch.finfo(torch.float32).tiny)
    u = (torch.ceil(torch.log2(amax / E4M3_MAX)) + 127.0).clamp(0, 254)
    descale = torch.exp2(u - 127.0).unsqueeze(-1)
    return ((xg / descale).to(torch.float8_e4m3fn).to(torch.float32) * descale).flatten(-2).to(x.dtype)
