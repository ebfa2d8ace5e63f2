"""Bit packing: round trips and the word layout each format defines, checked bit for bit
against references written here from the definitions (and compressed-tensors' packer)."""

import pytest
import torch

from infer_tool.packers.packing import AWQ_ORDER, AWQ_REVERSE_ORDER, pack_int32, unpack_int32


def _codes(shape, bits, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << bits, shape, generator=g, dtype=torch.int64).to(torch.uint8)


@pytest.mark.parametrize("bits,order", [(2, None), (4, None), (8, None), (4, "awq")])
@pytest.mark.parametrize("dim", [0, 1])
def test_round_trip_bit_exact(bits, dim, order):
    pf = 32 // bits
    perm = AWQ_ORDER if order == "awq" else None
    q = _codes((3 * pf, 5 * pf), bits)
    packed = pack_int32(q, bits, dim=dim, order=perm)
    assert packed.dtype == torch.int32
    assert packed.shape[dim] == q.shape[dim] // pf
    assert torch.equal(unpack_int32(packed, bits, dim=dim, size=q.shape[dim], order=perm), q)


def test_padding_round_trip():
    q = _codes((13, 6), 4)  # 13 rows: not a multiple of 8 along dim 0
    packed = pack_int32(q, 4, dim=0)
    assert packed.shape == (2, 6)
    assert torch.equal(unpack_int32(packed, 4, dim=0, size=13), q)


def test_sequential_layout_matches_definition():
    """Element k of a row sits in word k // 8 at bits 4·(k % 8)."""
    q = _codes((4, 32), 4, seed=1)
    packed = pack_int32(q, 4, dim=1).to(torch.int64) & 0xFFFFFFFF
    for r in range(4):
        for k in range(32):
            assert (int(packed[r, k // 8]) >> (4 * (k % 8))) & 0xF == int(q[r, k])


# AutoAWQ's GEMM packer (`order_map` in awq/modules/linear/gemm.py) and its unpacker's reverse
# order (`AWQ_REVERSE_ORDER` in awq/utils/packing_utils.py), written out here: the oracle is the
# format's definition, not our module's constants.
AUTOAWQ_ORDER_MAP = (0, 2, 4, 6, 1, 3, 5, 7)
AUTOAWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def _autoawq_pack(q: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's loop: word `col` ORs column `col * 8 + order_map[i]` in at bits 4i."""
    packed = torch.zeros(q.shape[0], q.shape[1] // 8, dtype=torch.int64)
    for col in range(q.shape[1] // 8):
        for i in range(8):
            packed[:, col] |= q[:, col * 8 + AUTOAWQ_ORDER_MAP[i]].to(torch.int64) << (i * 4)
    return packed


def test_awq_order_matches_definition():
    """Nibble i of word j holds column 8j + [0,2,4,6,1,3,5,7][i] (AutoAWQ's packer, bit for bit);
    the reverse order inverts it, as AutoAWQ's unpacker does."""
    q = _codes((3, 16), 4, seed=2)
    packed = pack_int32(q, 4, dim=1, order=AWQ_ORDER).to(torch.int64) & 0xFFFFFFFF
    assert torch.equal(packed, _autoawq_pack(q))
    assert tuple(AWQ_ORDER) == AUTOAWQ_ORDER_MAP and tuple(AWQ_REVERSE_ORDER) == AUTOAWQ_REVERSE_ORDER
    for e in range(8):  # element e lives in nibble AUTOAWQ_REVERSE_ORDER[e]
        assert AUTOAWQ_ORDER_MAP[AUTOAWQ_REVERSE_ORDER[e]] == e


def test_matches_compressed_tensors_packer():
    """compressed-tensors packs signed int8 values (+2^(b-1)); its words must equal ours."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q = _codes((16, 64), 4, seed=3)
    signed = (q.to(torch.int16) - 8).to(torch.int8)
    assert torch.equal(pack_int32(q, 4, dim=1), pack_to_int32(signed, 4, packed_dim=1))
    assert torch.equal(pack_int32(q, 4, dim=0), pack_to_int32(signed, 4, packed_dim=0))


def test_rejects_out_of_range_codes():
    with pytest.raises(ValueError):
        pack_int32(torch.tensor([[16, 0, 0, 0, 0, 0, 0, 0]]), 4)
    with pytest.raises(ValueError):
        pack_int32(torch.zeros(2, 6, dtype=torch.uint8), 3)
