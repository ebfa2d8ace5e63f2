"""The kernels compile for a Hopper GPU (sm_90) with the configurations the launchers
pick: ahead-of-time through Triton's compiler and ptxas, no GPU needed. This catches
what the interpreter cannot (tl.dot layouts and shapes, fp8 instructions, shared memory)."""

import pytest
import torch

from infer_tool.kernels import fp8, w4a16
from infer_tool.kernels.backend import resource_usage
from infer_tool.kernels.layout import pack_int4_k

K, N = 512, 384


def stack_bytes(compiled) -> int:
    """Per-thread stack of the sm_90 cubin: register spills land there."""
    return resource_usage(compiled)["stack"]


def int4_operands(M, *, asym, act_order, dtype=torch.bfloat16):
    G = K // 128
    qw = pack_int4_k(torch.randint(0, 16, (K, N), dtype=torch.uint8))
    zeros = torch.randint(0, 16, (G, N), dtype=torch.uint8) if asym else None
    g_idx = (torch.arange(K, dtype=torch.int32) // 128) if act_order else None
    return torch.randn(M, K, dtype=dtype), qw, torch.rand(G, N, dtype=dtype), zeros, g_idx


@pytest.mark.parametrize(
    "M,asym,act_order,config",
    [
        (1, True, True, None),  # gemv, act-order scale gathers
        (1, False, False, w4a16.W4A16Config("gemv", BLOCK_M=1, BLOCK_N=64, BLOCK_K=128, SPLIT_K=4)),
        (3, True, False, None),  # gemv, BLOCK_M=4
        (16, False, False, None),  # splitk, one scale row per K-block
        (256, True, False, None),  # tiled
    ],
)
def test_w4a16_compiles_for_sm90(M, asym, act_order, config):
    x, qw, s, z, g = int4_operands(M, asym=asym, act_order=act_order)
    launch, _ = w4a16.plan(x, qw, s, z, g, 128, config=config)
    compiled = launch.compile_for(90)
    uses_tensor_cores = "mma" in compiled.asm["ptx"]  # mma.sync or wgmma
    assert uses_tensor_cores == ("DOT_PRECISION" in launch.meta)  # gemv kernel: no tl.dot
    assert stack_bytes(compiled) == 0  # no register spills


@pytest.mark.parametrize("mode,block,M", [("w8a8", True, 16), ("w8a16", False, 256)])
def test_fp8_compiles_for_sm90(mode, block, M):
    x = torch.randn(M, K, dtype=torch.bfloat16)
    w = torch.randn(N, K).to(torch.float8_e4m3fn)
    scale = torch.rand(N // 128, K // 128) if block else torch.rand(N, 1)
    launch, _ = fp8.plan(x, w, scale, mode, (128, 128) if block else None, None)
    compiled = launch.compile_for(90)
    assert stack_bytes(compiled) == 0  # no register spills
    if mode == "w8a8":  # FP8 x FP8 on Hopper tensor cores
        assert "e4m3" in compiled.asm["ptx"]


def test_split_k_reduction_compiles_for_sm90():
    from infer_tool.kernels.backend import Launch
    from infer_tool.kernels.splitk import BLOCK, _sum_partials_kernel

    partials, out = torch.zeros(4, 3, N), torch.empty(3, N, dtype=torch.bfloat16)
    launch = Launch(
        _sum_partials_kernel, (1,), (partials, out, 3 * N), dict(SPLIT_K=4, BLOCK=BLOCK, num_warps=4, num_stages=1)
    )
    assert stack_bytes(launch.compile_for(90)) == 0
