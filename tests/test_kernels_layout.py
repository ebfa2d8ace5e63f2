"""The canonical INT4 layout: bit positions and bit-exact round trips."""

import pytest
import torch

from infer_tool.kernels.layout import pack_int4_k, unpack_int4_k


def test_bit_positions_follow_the_contract():
    # Element k = 8r + i must sit at bits 4i of row r; check against a per-element loop.
    g = torch.Generator().manual_seed(0)
    K, N = 19, 5
    q = torch.randint(0, 16, (K, N), generator=g, dtype=torch.uint8)
    packed = pack_int4_k(q)
    assert packed.dtype == torch.int32 and packed.shape == (3, N)
    for k in range(K):
        r, i = divmod(k, 8)
        for n in range(N):
            word = int(packed[r, n]) & 0xFFFFFFFF
            assert (word >> (4 * i)) & 0xF == int(q[k, n])
    # Padding rows past K are zero nibbles.
    assert (int(packed[2, 0]) & 0xFFFFFFFF) >> (4 * (K - 16)) == 0


def test_high_nibble_uses_the_sign_bit():
    q = torch.full((8, 1), 15, dtype=torch.uint8)
    assert int(pack_int4_k(q)[0, 0]) == -1  # 0xFFFFFFFF as int32


@pytest.mark.parametrize("K", [8, 64, 203])
def test_round_trip_is_bit_exact(K):
    g = torch.Generator().manual_seed(K)
    q = torch.randint(0, 16, (K, 37), generator=g, dtype=torch.uint8)
    assert torch.equal(unpack_int4_k(pack_int4_k(q), K), q)


def test_rejects_out_of_range_values():
    with pytest.raises(ValueError, match="0..15"):
        pack_int4_k(torch.tensor([[16]]))
    with pytest.raises(ValueError, match="K=17"):
        unpack_int4_k(torch.zeros(2, 3, dtype=torch.int32), 17)
