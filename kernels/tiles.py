"""Which output tile of a GEMM a Triton program computes: the grouped order of Triton's matmul
tutorial ("L2 cache optimizations"). Programs are numbered along a (⌈M/BLOCK_M⌉, ⌈N/BLOCK_N⌉)
grid of tiles so that GROUP_M consecutive row tiles walk the same column tiles: a weight tile
is then read by GROUP_M programs while it is still in L2. Shared by the W4A16, FP8 and FP4
GEMMs (`kernels/w4a16.py`, `kernels/fp8.py`, `kernels/fp4.py`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n): the row and column tile of program `pid` in 0 .. ⌈M/BLOCK_M⌉·⌈N/BLOCK_N⌉ − 1."""
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n
