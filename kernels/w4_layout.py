"""The INT4 weight layout the W4A16 kernels read ("planar-128"), repacked once from the
canonical layout (`layout.py`) when a layer is prepared for the kernels, as Marlin and
Machete pre-shuffle their weights at load.

Canonical: int32 `(ceil(K/8), N)`, element `q[k, n]`, `k = 8r + i`, at bits `4i` of
`packed[r, n]`: the 8 nibbles of a word are 8 *consecutive* input channels, so unpacking
nibble `i` of a tile of words yields every 8th row of the tile, and feeding `tl.dot` needs
an interleave (a register shuffle) or a strided gather of the activations.

Planar-128: K is cut into tiles of 128 input channels (the last one padded with zero
nibbles); tile `t` is 16 int32 rows `16t .. 16t+15` of `N` words each, and element
`k = 128t + 16i + r` sits at bits `4i` of `planar[16t + r, n]`. Nibble `i` of the tile's
16 x N words is then the contiguous K-slice `128t + 16i .. 128t + 16i + 15` (a "plane"),
so:
- the GEMV reads each 16 x BLOCK_N tile of words once (rows of N words: 16-byte vector
  loads along N, coalesced), shifts out one plane at a time, and multiplies it by 16
  *contiguous* activations;
- the tensor-core path feeds each plane straight to `tl.dot` as a `(16, BLOCK_N)` operand
  against a contiguous `(BLOCK_M, 16)` activation tile (16 = the K of one bf16 MMA);
- a K tile never straddles a word, and with group sizes that are multiples of 16 a plane
  never straddles a group: scales are loaded once per plane (once per tile at group 128).

Act-order (GPTQ `desc_act`) weights whose `g_idx` is a permutation of `k // group_size`
are sorted by group here, once (Marlin's approach): the kernels then see contiguous
groups, and the activations are gathered by the same permutation at run time.

The result has the canonical shape `(16 * ceil(K/128), N)`, int32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer_tool.kernels.layout import PACK_FACTOR, pack_int4_k, unpack_int4_k

TILE_K = 128  # input channels per tile
PLANE_K = TILE_K // PACK_FACTOR  # 16: rows of words per tile = contiguous channels per nibble plane


def padded_k(K: int) -> int:
    """K rounded up to whole tiles."""
    return -(-K // TILE_K) * TILE_K


def to_planar(qweight: torch.Tensor, K: int) -> torch.Tensor:
    """Canonical int32 `(ceil(K/8), N)` -> planar-128 int32 `(16 * ceil(K/128), N)`."""
    q = unpack_int4_k(qweight, K)  # (K, N) uint8
    N = q.shape[1]
    Kp = padded_k(K)
    full = torch.zeros(Kp, N, dtype=torch.uint8, device=q.device)
    full[:K] = q
    # k = 128t + 16i + r -> word row 16t + r, nibble i: order the rows (t, r, i) and pack i.
    tri = full.view(Kp // TILE_K, PACK_FACTOR, PLANE_K, N).permute(0, 2, 1, 3)  # (T, 16, 8, N)
    return pack_int4_k(tri.reshape(Kp, N))  # (T*16, N): 8 consecutive rows of tri per word


def from_planar(planar: torch.Tensor, K: int) -> torch.Tensor:
    """Inverse of `to_planar`: planar-128 -> canonical int32 `(ceil(K/8), N)`."""
    Kp = padded_k(K)
    if planar.dtype != torch.int32 or planar.dim() != 2 or planar.shape[0] != Kp // PACK_FACTOR:
        raise ValueError(
            f"from_planar expects int32 ({Kp // PACK_FACTOR}, N) for K={K}, got {planar.dtype} {tuple(planar.shape)}"
        )
    N = planar.shape[1]
    tri = unpack_int4_k(planar, Kp).view(Kp // TILE_K, PLANE_K, PACK_FACTOR, N)  # (T, r, i, N)
    q = tri.permute(0, 2, 1, 3).reshape(Kp, N)[:K]  # (K, N) in k order
    return pack_int4_k(q)


def contiguous_groups(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The stable sort of `g_idx` if it puts every channel in group `k // group_size`
    (GPTQ act-order with static-size groups), else None."""
    perm = torch.argsort(g_idx.long(), stable=True)
    want = torch.arange(g_idx.numel(), device=g_idx.device) // group_size
    if torch.equal(g_idx.long()[perm], want):
        return perm
    return None


@dataclass
class W4Weights:
    """A W4A16 weight prepared for the kernels.

    `qweight` planar-128 int32 `(16 * ceil(K/128), N)`; `scales` `(G, N)`; `zeros` uint8
    `(G, N)` or None (symmetric, zero point 8); `g_idx` int32 `(K,)` per *stored* channel
    (the kernels then gather scales per element) or None (`k // group_size`); `perm`
    int64 `(K,)` or None: stored channel j is input channel `perm[j]` (x is gathered by it).
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    perm: torch.Tensor | None
    group_size: int
    K: int
    N: int

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return {
            "qweight": self.qweight,
            "scales": self.scales,
            "zeros": self.zeros,
            "g_idx": self.g_idx,
            "perm": self.perm,
        }


def prepare(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    group_size: int,
    K: int,
) -> W4Weights:
    """Canonical operands (see `w4a16.py`) -> `W4Weights` for the kernels, on the same
    device: planar-128 words, act-order sorted into contiguous groups where it can be."""
    perm = None
    if g_idx is not None:
        perm = contiguous_groups(g_idx, group_size)
        if perm is not None:
            q = unpack_int4_k(qweight, K)[perm]  # (K, N) rows in stored order
            qweight = pack_int4_k(q)
            g_idx = None
    planar = to_planar(qweight, K)
    return W4Weights(planar, scales, zeros, g_idx, perm, group_size, K, int(qweight.shape[1]))
