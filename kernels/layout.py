"""The canonical INT4 weight layout every kernel and loader in infer-tool agrees on.

Layout ("packed along K"): a weight with unsigned 4-bit values `q` of shape `(K, N)`
(input channels x output channels, i.e. the transpose of `nn.Linear.weight`) is stored
as int32 `(ceil(K/8), N)`. Element `q[k, n]` with `k = 8*r + i` sits at bits
`4*i .. 4*i+3` of `packed[r, n]`; rows of K beyond the end are zero nibbles. This is
the GPTQ v1 `qweight` orientation; AWQ and compressed-tensors checkpoints are repacked
into it once at load time.

This module knows nothing about scales, zero points or formats: it only moves nibbles.
"""

from __future__ import annotations

import torch

PACK_FACTOR = 8  # int4 values per int32 word
_NIBBLE_SHIFTS = tuple(4 * i for i in range(PACK_FACTOR))


def pack_int4_k(q: torch.Tensor) -> torch.Tensor:
    """Pack unsigned 4-bit values `q` `(K, N)` (any integer dtype, values 0..15) into
    int32 `(ceil(K/8), N)`, element `k = 8*r + i` at bits `4*i` of row `r`."""
    if q.dim() != 2:
        raise ValueError(f"pack_int4_k expects a 2-D (K, N) tensor, got shape {tuple(q.shape)}")
    if q.dtype.is_floating_point or q.dtype == torch.bool:
        raise ValueError(f"pack_int4_k expects an integer tensor, got {q.dtype}")
    q32 = q.to(torch.int32)
    if q32.numel() and (int(q32.min()) < 0 or int(q32.max()) > 15):
        raise ValueError(f"pack_int4_k expects values in 0..15, got range {int(q32.min())}..{int(q32.max())}")
    K, N = q32.shape
    rows = -(-K // PACK_FACTOR)
    padded = torch.zeros(rows * PACK_FACTOR, N, dtype=torch.int32, device=q.device)
    padded[:K] = q32
    nibbles = padded.view(rows, PACK_FACTOR, N)  # (K/8, 8, N)
    shifts = torch.tensor(_NIBBLE_SHIFTS, dtype=torch.int32, device=q.device).view(1, PACK_FACTOR, 1)
    # Nibbles occupy disjoint bits, so the sum is a bitwise OR; int32 wraps for bit 31.
    return (nibbles << shifts).sum(dim=1, dtype=torch.int32)  # (K/8, N)


def unpack_int4_k(packed: torch.Tensor, K: int) -> torch.Tensor:
    """Inverse of `pack_int4_k`: int32 `(ceil(K/8), N)` -> uint8 `(K, N)` values 0..15."""
    if packed.dim() != 2 or packed.dtype != torch.int32:
        raise ValueError(f"unpack_int4_k expects int32 (ceil(K/8), N), got {packed.dtype} {tuple(packed.shape)}")
    rows = packed.shape[0]
    if rows != -(-K // PACK_FACTOR):
        raise ValueError(f"unpack_int4_k: {rows} packed rows cannot hold K={K} (need ceil(K/8))")
    shifts = torch.tensor(_NIBBLE_SHIFTS, dtype=torch.int32, device=packed.device).view(1, PACK_FACTOR, 1)
    nibbles = (packed.unsqueeze(1) >> shifts) & 0xF  # (K/8, 8, N)
    return nibbles.reshape(rows * PACK_FACTOR, -1)[:K].to(torch.uint8)
