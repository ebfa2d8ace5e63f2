"""Bit packing of unsigned integer codes into int32 words, along either dimension.

With `bits` dividing 32, `32 // bits` consecutive elements along `dim` share one int32.
Nibble (bit field) i of a word, at bits [i·bits, (i+1)·bits), holds element `order[i]`
of its run; the default order is sequential (compressed-tensors, GPTQ), AWQ GEMM uses
`AWQ_ORDER`. A run is padded with zeros when the packed dim is not a multiple of the run.
This module knows nothing of formats beyond these orders.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

AWQ_ORDER: tuple[int, ...] = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds element AWQ_ORDER[i]
AWQ_REVERSE_ORDER: tuple[int, ...] = (0, 4, 1, 5, 2, 6, 3, 7)  # element j sits in nibble AWQ_REVERSE_ORDER[j]


def _per_word(bits: int) -> int:
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits={bits} does not divide 32; packing supports 2, 4 or 8")
    return 32 // bits


def pack_int32(q: torch.Tensor, bits: int, dim: int = -1, order: Sequence[int] | None = None) -> torch.Tensor:
    """Pack codes 0..2^bits-1 (any integer dtype) along `dim` of a 2-D tensor into int32.

    (R, C) with dim=1 -> (R, ceil(C / (32/bits))); dim=0 -> (ceil(R / (32/bits)), C).
    """
    pf = _per_word(bits)
    order = tuple(range(pf)) if order is None else tuple(order)
    if sorted(order) != list(range(pf)):
        raise ValueError(f"order {order} is not a permutation of 0..{pf - 1}")
    x = q.to(torch.int64).movedim(dim, -1)  # (..., C)
    if int(x.min()) < 0 or int(x.max()) >= 1 << bits:
        raise ValueError(f"codes outside 0..{(1 << bits) - 1}")
    c = x.shape[-1]
    pad = (-c) % pf
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    x = x.reshape(*x.shape[:-1], -1, pf)[..., list(order)]  # (..., C/pf, pf): nibble i <- element order[i]
    shifts = torch.arange(pf, device=x.device, dtype=torch.int64) * bits
    words = (x << shifts).sum(dim=-1)  # (..., C/pf) in [0, 2^32)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def unpack_int32(
    packed: torch.Tensor, bits: int, dim: int = -1, size: int | None = None, order: Sequence[int] | None = None
) -> torch.Tensor:
    """Inverse of `pack_int32`: int32 words -> uint8 codes, `size` elements along `dim`."""
    pf = _per_word(bits)
    order = tuple(range(pf)) if order is None else tuple(order)
    w = packed.to(torch.int64).movedim(dim, -1) & 0xFFFFFFFF  # (..., W)
    shifts = torch.arange(pf, device=w.device, dtype=torch.int64) * bits
    fields = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # (..., W, pf): nibble i
    x = torch.empty_like(fields)
    x[..., list(order)] = fields  # element order[i] <- nibble i
    x = x.reshape(*x.shape[:-2], -1)
    if size is not None:
        x = x[..., :size]
    return x.to(torch.uint8).movedim(-1, dim).contiguous()
