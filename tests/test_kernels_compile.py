"""The kernels compile for a Hopper GPU (sm_90) with the configurations the launchers
pick: ahead-of-time through Triton's compiler and ptxas, no GPU needed, specialized as the
JIT specializes a launch (`Launch.compile_for`). This catches what the interpreter cannot
(tl.dot layouts and shapes, fp8 instructions, shared memory), and reads each cubin's
per-thread stack with the cuobjdump shipped in Triton: register spills land there, so a
stack of 0 bytes means no spills."""

import pytest
import torch

from infer_tool.kernels import fp8, w4a16
from infer_tool.kernels.backend import resource_usage
from infer_tool.kernels.layout import pack_int4_k

K, N = 512, 384
SMS = 132  # an H100 / H200: the split-K the GPU would get


def stack_bytes(compiled) -> int:
    """Per-thread stack of the sm_90 cubin: register spills land there."""
    return resource_usage(compiled)["stack"]


def int4_operands(M, *, asym, g_idx_kind, group=128, dtype=torch.bfloat16):
    G = K // group
    qw = pack_int4_k(torch.randint(0, 16, (K, N), dtype=torch.uint8))
    zeros = torch.randint(0, 16, (G, N), dtype=torch.uint8) if asym else None
    if g_idx_kind == "sorted":  # GPTQ act-order: sorted into contiguous groups at prepare
        g_idx = (torch.arange(K, dtype=torch.int32) // group)[torch.randperm(K)]
    elif g_idx_kind == "uneven":  # stays a per-element gather
        g_idx = torch.randint(0, G, (K,), dtype=torch.int32)
    else:
        g_idx = None
    return torch.randn(M, K, dtype=dtype), qw, torch.rand(G, N, dtype=dtype), zeros, g_idx


@pytest.mark.parametrize(
    "M,asym,g_idx_kind,group",
    [
        (1, False, None, 128),  # gemv, per-tile scales (the decode case)
        (2, True, None, 128),
        (4, True, None, 128),
        (1, True, "sorted", 32),  # gemv, per-plane scales
        (1, True, "uneven", 128),  # gemv, per-element gathers
        (16, False, None, 128),  # splitk
        (64, True, "sorted", 64),
        (2048, False, None, 128),  # tiled
    ],
)
def test_w4a16_compiles_for_sm90_without_spills(M, asym, g_idx_kind, group):
    x, qw, s, z, g = int4_operands(M, asym=asym, g_idx_kind=g_idx_kind, group=group)
    cfg = w4a16.choose_config(M, N, K, SMS)
    launch, _ = w4a16.plan(x, qw, s, z, g, group, config=cfg)
    compiled = launch.compile_for(90)
    ptx = compiled.asm["ptx"]
    uses_tensor_cores = "mma" in ptx  # mma.sync or wgmma
    assert uses_tensor_cores == (cfg.path != "gemv")
    # The packed words come in 16-byte loads: vector loads, or (pipelined) cp.async.cg,
    # which copies 16 bytes at a time.
    assert "ld.global.v4" in ptx or "cp.async.cg.shared.global" in ptx
    if launch.meta["SPLIT_K"] > 1:  # one launch: the tile counter's atomic is in the kernel
        assert "atom.global" in ptx and "acq_rel" in ptx
    assert stack_bytes(compiled) == 0  # no register spills


@pytest.mark.parametrize(
    "mode,block,M",
    [("w8a16", False, 1), ("w8a8", True, 2), ("w8a8", True, 16), ("w8a8", False, 2048), ("w8a16", False, 256)],
)
def test_fp8_compiles_for_sm90_without_spills(mode, block, M):
    x = torch.randn(M, K, dtype=torch.bfloat16)
    w = torch.randn(N, K).to(torch.float8_e4m3fn)
    scale = torch.rand(N // 128, K // 128) if block else torch.rand(N, 1)
    launch, _ = fp8.plan(x, w, scale, mode, (128, 128) if block else None, None)
    compiled = launch.compile_for(90)
    assert stack_bytes(compiled) == 0  # no register spills
    if M <= 4:  # the decode gemv: no tensor cores, split-K reduced in the kernel
        assert launch.meta.get("FP8_DOT") is None and "mma" not in compiled.asm["ptx"]
        assert launch.meta["SPLIT_K"] == 1 or "atom.global" in compiled.asm["ptx"]
        return
    if mode == "w8a8":  # FP8 x FP8 on Hopper tensor cores
        assert "e4m3" in compiled.asm["ptx"]
    if M >= 64 and mode == "w8a8":  # wgmma on float8e4nv operands
        assert "wgmma" in compiled.asm["ptx"]


def test_split_k_reduction_compiles_for_sm90():
    from infer_tool.kernels.backend import Launch
    from infer_tool.kernels.splitk import BLOCK, _sum_partials_kernel

    partials, out = torch.zeros(4, 3, N), torch.empty(3, N, dtype=torch.bfloat16)
    launch = Launch(
        _sum_partials_kernel, (1,), (partials, out, 3 * N), dict(SPLIT_K=4, BLOCK=BLOCK, num_warps=4, num_stages=1)
    )
    assert stack_bytes(launch.compile_for(90)) == 0
