"""kernels/tiles.py's grouped tile order, run by the Triton interpreter: every program gets a
distinct tile and every tile a program, and the order is the one its docstring states
(groups of GROUP_M row tiles, row tile fastest inside a group)."""

import pytest
import torch
import triton
import triton.language as tl

from infer_tool.kernels import backend
from infer_tool.kernels.tiles import grouped_tile


@triton.jit
def _tiles_kernel(out_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    tl.store(out_ptr + 2 * pid, pid_m)
    tl.store(out_ptr + 2 * pid + 1, pid_n)


@pytest.mark.parametrize("M,N,group", [(1, 1, 8), (100, 70, 8), (64, 300, 3), (33, 16, 1), (500, 40, 4)])
def test_grouped_tile_is_a_bijection_in_the_stated_order(monkeypatch, M: int, N: int, group: int) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    bm, bn = 16, 32
    tm, tn = -(-M // bm), -(-N // bn)
    out = torch.full((tm * tn, 2), -1, dtype=torch.int32)
    backend.resolve(_tiles_kernel)[(tm * tn,)](out, M, N, BLOCK_M=bm, BLOCK_N=bn, GROUP_M=group)
    got = [tuple(r) for r in out.tolist()]
    assert sorted(got) == [(m, n) for m in range(tm) for n in range(tn)]  # each tile exactly once
    # the stated order, built independently: groups of `group` row tiles; inside one, column
    # tiles in turn, and for each column tile the group's row tiles in turn
    want = [(m, n) for first in range(0, tm, group) for n in range(tn) for m in range(first, min(first + group, tm))]
    assert got == want
