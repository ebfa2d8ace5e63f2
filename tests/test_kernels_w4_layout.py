"""The planar-128 INT4 layout the W4A16 kernels read (`kernels/w4_layout.py`), bit for bit
against the canonical layout: repacking then unpacking is the identity, every nibble sits
where the layout's definition puts it (checked element by element, not with the
repacker's own reshapes), and the act-order sort keeps every weight with its channel."""

import pytest
import torch

from infer_tool.kernels.layout import pack_int4_k, unpack_int4_k
from infer_tool.kernels.w4_layout import (
    PLANE_K,
    TILE_K,
    contiguous_groups,
    from_planar,
    padded_k,
    prepare,
    to_planar,
)


def codes(K, N, seed):
    return torch.randint(0, 16, (K, N), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


@pytest.mark.parametrize("K,N", [(128, 8), (136, 5), (203, 16), (512, 3), (7, 4)])
def test_round_trip_is_the_identity(K, N):
    canonical = pack_int4_k(codes(K, N, K))
    planar = to_planar(canonical, K)
    assert planar.dtype == torch.int32 and planar.shape == (padded_k(K) // 8, N)
    assert torch.equal(from_planar(planar, K), canonical)


def test_every_nibble_where_the_definition_puts_it():
    """k = 128t + 16i + r at bits 4i of word row 16t + r; channels past K are zero."""
    K, N = 203, 6
    q = codes(K, N, 1)
    planar = to_planar(pack_int4_k(q), K)
    for k in range(padded_k(K)):
        t, rem = divmod(k, TILE_K)
        i, r = divmod(rem, PLANE_K)
        nib = (planar[t * PLANE_K + r] >> (4 * i)) & 0xF
        want = q[k].to(torch.int32) if k < K else torch.zeros(N, dtype=torch.int32)
        assert torch.equal(nib, want), k


def test_a_plane_is_contiguous_channels():
    """Nibble i of a tile's 16 rows holds channels 16i .. 16i+15: what the kernels feed to
    one (16, N) tl.dot operand or multiply by 16 contiguous activations."""
    K, N = 256, 4
    q = codes(K, N, 2)
    planar = to_planar(pack_int4_k(q), K)
    for t in range(2):
        tile = planar[t * PLANE_K : (t + 1) * PLANE_K]
        for i in range(8):
            assert torch.equal((tile >> (4 * i)) & 0xF, q[t * 128 + 16 * i : t * 128 + 16 * i + 16].int())


def test_from_planar_refuses_a_wrong_shape():
    with pytest.raises(ValueError, match="from_planar expects int32"):
        from_planar(torch.zeros(3, 4, dtype=torch.int32), 128)


def test_act_order_sort():
    K, g = 96, 32
    gen = torch.Generator().manual_seed(3)
    g_idx = (torch.arange(K) // g)[torch.randperm(K, generator=gen)].to(torch.int32)
    perm = contiguous_groups(g_idx, g)
    assert perm is not None and torch.equal(g_idx.long()[perm], torch.arange(K) // g)
    uneven = g_idx.clone()
    uneven[0] = (uneven[0] + 1) % 3  # one group one channel larger
    assert contiguous_groups(uneven, g) is None
    q = codes(K, 5, 4)
    w = prepare(pack_int4_k(q), torch.ones(3, 5), None, g_idx, g, K)
    stored = unpack_int4_k(from_planar(w.qweight, K), K)
    assert torch.equal(stored, q[perm])  # stored channel j is input channel perm[j]
    assert w.g_idx is None
