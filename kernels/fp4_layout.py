"""The FP4 weight layout of compressed-tensors' `nvfp4-pack-quantized` and
`mxfp4-pack-quantized` formats, which every FP4 kernel, packer and loader in infer-tool
shares (the checkpoint layout is used as is: no repacking at load time).

E2M1 code (4 bits): bit 3 is the sign, bits 0..2 index `E2M1_VALUES`
(0, 0.5, 1, 1.5, 2, 3, 4, 6). A weight of codes `(N, K)` (the `nn.Linear` orientation)
is stored as uint8 `(N, K/2)`: code `k = 2*j` in the low nibble of byte `j`, code
`k = 2*j + 1` in the high nibble. Sources: compressed-tensors 0.19/0.20
`compressors/nvfp4/helpers.py` `pack_fp4_to_uint8` (`packed = idx[:, 0] | idx[:, 1] << 4`
over consecutive pairs of a row) and `unpack_fp4_from_uint8`; vLLM 0.32
`layers/quantization/utils/nvfp4_emulation_utils.py` `break_fp4_bytes` (low nibble first)
and vLLM's `tests/quantization/reference_mxfp4.py` `upcast_fp4_to_fp16_or_bf16`
(`unpacked[..., ::2] = val & 0x0F`). MXFP4 (`compressors/mxfp4/base.py`
`MXFP4PackedCompressor`) inherits the NVFP4 packing.

Scales: NVFP4 `weight_scale` float8_e4m3fn `(N, K/16)` with `weight_global_scale`
float32 `(1,)`, a divisor: `w = value(code) * (s / global_scale)` (compressed-tensors
`quantization/lifecycle/forward_helpers.py` `_dequantize`, float32 `s / gs` first, then
the product); MXFP4 `weight_scale` uint8 `(N, K/32)` holding E8M0 biased exponents,
`w = value(code) * 2 ** (u - 127)` (`compressors/mx_utils.py` `decompress_mx_scale`).

This module knows nothing about how codes or scales are chosen: it moves bits and applies
the dequantization formula.
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of code & 7
E2M1_MAX = 6.0
SIGN_BIT = 0x8
GROUP_SIZE = {"nvfp4": 16, "mxfp4": 32}  # values per scale along K
E8M0_BIAS = 127


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes `(..., K)` (any integer dtype, values 0..15, K even) into uint8
    `(..., K/2)`: code 2j in the low nibble of byte j, code 2j+1 in the high nibble."""
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise ValueError(f"pack_fp4 expects integer codes, got {codes.dtype}")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dimension, got shape {tuple(codes.shape)}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError(f"pack_fp4 expects codes in 0..15, got {int(codes.min())}..{int(codes.max())}")
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))  # (..., K/2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_fp4`: uint8 `(..., K/2)` -> codes uint8 `(..., K)`."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_fp4 expects uint8, got {packed.dtype}")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def decode_e2m1(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of E2M1 codes (uint8, 0..15) in `dtype`; code 8 is -0.0."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=dtype, device=codes.device)
    return table[codes.long()]


def decode_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """float32 `2 ** (u - 127)` of E8M0 biased exponents (uint8). u = 0 is 2**-127 (an fp32
    subnormal); u = 255, NaN in OCP MX, is never written by our packers."""
    if scale.dtype != torch.uint8:
        raise ValueError(f"decode_e8m0 expects uint8 exponents, got {scale.dtype}")
    u = scale.to(torch.int32)
    bits = torch.where(u == 0, 1 << 22, u << 23)  # fp32 exponent field = u; u = 0: subnormal 2**-127
    return bits.view(torch.float32)


def effective_scale(w_scale: torch.Tensor, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """float32 `(N, G)` multiplier of the codes of each group: NVFP4 (float8_e4m3fn scales,
    `global_scale` float32 `(1,)` required) `s / global_scale`; MXFP4 (uint8 E8M0 scales,
    no global scale) `2 ** (u - 127)`."""
    if w_scale.dtype == torch.float8_e4m3fn:
        if global_scale is None:
            raise ValueError("NVFP4 scales (float8_e4m3fn) need the tensor's global scale")
        return w_scale.to(torch.float32) / global_scale.to(torch.float32)
    if w_scale.dtype == torch.uint8:
        if global_scale is not None:
            raise ValueError("MXFP4 scales (uint8 E8M0) have no global scale")
        return decode_e8m0(w_scale)
    raise ValueError(f"FP4 scales must be float8_e4m3fn (NVFP4) or uint8 (MXFP4), got {w_scale.dtype}")


def dequantize_codes(codes: torch.Tensor, eff_scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`value(code) * s` (float32 product, then cast to `dtype`): codes `(N, K)`, effective
    scales `(N, G)` with K a multiple of G -> `(N, K)`."""
    K, G = codes.shape[-1], eff_scale.shape[-1]
    if G == 0 or K % G or codes.shape[:-1] != eff_scale.shape[:-1]:
        raise ValueError(f"FP4: scales {tuple(eff_scale.shape)} do not divide codes {tuple(codes.shape)} into groups")
    v = decode_e2m1(codes, torch.float32).unflatten(-1, (G, K // G))
    return (v * eff_scale.to(torch.float32).unsqueeze(-1)).flatten(-2).to(dtype)
