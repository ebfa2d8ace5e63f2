"""W4A16 Triton kernel under TRITON_INTERPRET=1 against an independent float64 reference.

Tolerance: relative Frobenius error ||out - ref|| / ||ref||. fp32 activations: 1e-5
(fp32 accumulation of K <= 512 terms); fp16: 2e-3 (the dequantised weight and the
output are rounded to fp16, unit roundoff 4.9e-4).
"""

import pytest
import torch

from infer_tool.kernels import backend
from infer_tool.kernels.layout import pack_int4_k
from infer_tool.kernels.w4a16 import W4A16Config, choose_config, w4a16_matmul, w4a16_reference

TOL = {torch.float16: 2e-3, torch.float32: 1e-5}
K, N = 328, 200  # neither a multiple of any BLOCK_K (>= 16) nor of BLOCK_N


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    """Run Triton kernels on the CPU interpreter; poison every kernel output buffer."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def poisoned(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(backend, "empty_output", poisoned)


def make_problem(M, K, N, group_size, *, asym, act_order, seed, signed=False):
    """Random INT4 operands and the float64 product computed without our code; `signed`:
    scales of either sign (the full-range grid's checkpoints, `quantize --full-range`)."""
    g = torch.Generator().manual_seed(seed)
    G = -(-K // group_size)
    q = torch.randint(0, 16, (K, N), generator=g, dtype=torch.uint8)  # (K, N)
    s = torch.rand(G, N, generator=g, dtype=torch.float64) * 0.02 + 0.005  # never zero
    if signed:
        s = torch.where(torch.rand(G, N, generator=g) < 0.5, -s, s)
    z = torch.randint(0, 16, (G, N), generator=g, dtype=torch.uint8) if asym else None
    if act_order:  # every group used, channels in a random order
        g_idx = (torch.arange(K) // group_size)[torch.randperm(K, generator=g)].to(torch.int32)
    else:
        g_idx = None
    x = torch.randn(M, K, generator=g, dtype=torch.float64)
    groups = g_idx.long() if act_order else torch.arange(K) // group_size
    zf = z.double()[groups] if asym else 8.0
    W = (q.double() - zf) * s[groups]  # (K, N)
    return x, pack_int4_k(q), s, z, g_idx, x @ W


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


VARIANTS = {  # name: (group_size, asym, act_order, signed scales)
    "sym-g64": (64, False, False, False),  # one scale row per 64-wide K-block on the dot paths
    "sym-g64-signed": (64, False, False, True),  # --full-range: negative scales too
    "asym-g32": (32, True, False, False),  # per-element scale gather
    "actorder-g32": (32, True, True, False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("M", [1, 3, 16, 64])
def test_matches_float64_reference(M, dtype, variant):
    group_size, asym, act_order, signed = VARIANTS[variant]
    x, qw, s, z, g_idx, ref = make_problem(
        M, K, N, group_size, asym=asym, act_order=act_order, seed=M * 7 + len(variant), signed=signed
    )
    out = w4a16_matmul(x.to(dtype), qw, s.to(dtype), z, g_idx, group_size)
    assert out.dtype == dtype and out.shape == (M, N)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype]


FORCED = {
    "gemv-splitk": W4A16Config("gemv", BLOCK_M=4, BLOCK_N=32, BLOCK_K=64, SPLIT_K=3),
    "splitk": W4A16Config("splitk", BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=4),
    "tiled": W4A16Config("tiled", BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2),
}


@pytest.mark.parametrize("name", list(FORCED))
def test_each_path_with_explicit_config(name):
    # M=20 spans two row-tiles of 16, so the grouped program order is exercised too.
    x, qw, s, z, g_idx, ref = make_problem(20, K, N, 32, asym=True, act_order=False, seed=3)
    out = w4a16_matmul(x.half(), qw, s.half(), z, g_idx, 32, config=FORCED[name])
    assert rel_err(out, ref) < TOL[torch.float16]


def test_default_config_follows_m():
    sms = 132  # an H100/H200
    assert choose_config(1, 4096, 4096, sms).path == "gemv"
    assert choose_config(1, 4096, 4096, sms).SPLIT_K > 1  # one row still fills the GPU
    assert choose_config(16, 4096, 4096, sms).path == "splitk"
    assert choose_config(64, 4096, 4096, sms).SPLIT_K > 1
    assert choose_config(2048, 4096, 4096, sms).path == "tiled"
    assert choose_config(2048, 4096, 4096, sms).SPLIT_K == 1


def test_tiled_default_for_large_m_and_fp32_scales():
    x, qw, s, z, g_idx, ref = make_problem(80, 136, 72, 64, asym=False, act_order=False, seed=5)
    out = w4a16_matmul(x.half(), qw, s.float(), z, g_idx, 64)  # fp32 scales, fp16 x
    assert rel_err(out, ref) < TOL[torch.float16]


def test_k_not_a_multiple_of_eight():
    x, qw, s, z, g_idx, ref = make_problem(3, 203, 72, 64, asym=True, act_order=False, seed=11)
    out = w4a16_matmul(x.float(), qw, s.float(), z, g_idx, 64)
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("name", ["gemv-splitk", "splitk"])
def test_split_k_is_bitwise_deterministic(name):
    x, qw, s, z, g_idx, _ = make_problem(5, K, N, 32, asym=True, act_order=False, seed=13)
    xh, sh = x.half(), s.half()
    first = w4a16_matmul(xh, qw, sh, z, g_idx, 32, config=FORCED[name])
    second = w4a16_matmul(xh, qw, sh, z, g_idx, 32, config=FORCED[name])
    assert torch.equal(first, second)


def test_cpu_without_interpreter_runs_the_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    assert backend.backend_name("cpu") == "torch-reference"
    x, qw, s, z, g_idx, ref = make_problem(4, K, N, 32, asym=True, act_order=True, seed=17)
    out = w4a16_matmul(x.float(), qw, s.float(), z, g_idx, 32)
    assert torch.equal(out, w4a16_reference(x.float(), qw, s.float(), z, g_idx, 32))
    assert rel_err(out, ref) < TOL[torch.float32]


def test_rejects_mismatched_operands():
    x, qw, s, z, g_idx, _ = make_problem(2, 64, 16, 32, asym=True, act_order=False, seed=1)
    with pytest.raises(ValueError, match="scale rows"):
        w4a16_matmul(x.half(), qw, s.half(), z, g_idx, 16)
    with pytest.raises(ValueError, match="zeros must be uint8"):
        w4a16_matmul(x.half(), qw, s.half(), z.int(), g_idx, 32)
