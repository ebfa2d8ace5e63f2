"""W4A16 Triton kernels (on the planar-128 layout, `kernels/w4_layout.py`) under
TRITON_INTERPRET=1 against an independent float64 reference.

Tolerance: relative Frobenius error ||out - ref|| / ||ref||. fp32 activations: 1e-5
(fp32 accumulation of K <= 512 terms); fp16: 2e-3 (the dequantised weight and the
output are rounded to fp16, unit roundoff 4.9e-4).
"""

import pytest
import torch

from infer_tool.kernels import backend, splitk
from infer_tool.kernels.layout import pack_int4_k
from infer_tool.kernels.w4_layout import prepare
from infer_tool.kernels.w4a16 import W4A16Config, choose_config, plan, w4a16_matmul, w4a16_prepared, w4a16_reference

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


FORCED = {  # K = 328 is 3 tiles of 128: SPLIT_K=3 gives each split one tile
    "gemv-splitk": W4A16Config("gemv", BLOCK_M=4, BLOCK_N=32, SPLIT_K=3),
    "splitk": W4A16Config("splitk", BLOCK_M=16, BLOCK_N=32, SPLIT_K=3),
    "tiled": W4A16Config("tiled", BLOCK_M=16, BLOCK_N=32, GROUP_M=2),
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
def test_split_k_is_bitwise_deterministic_in_one_launch(name, monkeypatch):
    """Serial split-K: one launch per product, the same bits on every run, and the tile
    counters left at zero for the next launch (and for CUDA-graph replays)."""
    x, qw, s, z, g_idx, ref = make_problem(4, K, N, 32, asym=True, act_order=False, seed=13)
    w = prepare(qw, s.half(), z, g_idx, 32, K)
    launches = []
    real_run = backend.Launch.run
    monkeypatch.setattr(backend.Launch, "run", lambda self: (launches.append(self.grid), real_run(self))[1])
    runs = [w4a16_prepared(x.half(), w, config=FORCED[name]) for _ in range(3)]
    assert len(launches) == 3 and all(grid[1] == 3 for grid in launches)  # 3 splits, one launch each
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    assert rel_err(runs[0], ref) < TOL[torch.float16]
    assert int(splitk.tile_locks(torch.device("cpu"), 1).abs().sum()) == 0


def test_split_k_matches_one_split_to_rounding():
    """Splitting K changes only the fp32 summation order: against SPLIT_K=1, fp32 results
    agree to a few ulps (not bitwise, and not required to)."""
    x, qw, s, z, g_idx, ref = make_problem(2, K, N, 128, asym=False, act_order=False, seed=19)
    one = w4a16_matmul(x.float(), qw, s.float(), z, g_idx, 128, config=W4A16Config("gemv", 2, 64, SPLIT_K=1))
    three = w4a16_matmul(x.float(), qw, s.float(), z, g_idx, 128, config=W4A16Config("gemv", 2, 64, SPLIT_K=3))
    assert ((one.double() - three.double()).abs().max() / ref.abs().max()).item() < 1e-6
    assert rel_err(one, ref) < TOL[torch.float32] and rel_err(three, ref) < TOL[torch.float32]


@pytest.mark.parametrize("M", [2, 4])
def test_gemv_rows_of_two_and_four(M):
    x, qw, s, z, g_idx, ref = make_problem(M, K, N, 128, asym=True, act_order=False, seed=23 + M)
    out = w4a16_matmul(x.half(), qw, s.half(), z, g_idx, 128)
    assert rel_err(out, ref) < TOL[torch.float16]


GROUPINGS = {  # name: (K, group_size, g_idx kind): each scale mode of the kernels
    "g256-two-tiles-per-group": (328, 256, None),  # per tile, a group spanning tiles
    "per-channel": (512, 512, None),  # one group over K
    "g40-per-element": (328, 40, None),  # not a multiple of the 16-channel plane
    "g16-per-plane": (200, 16, None),
    "dynamic-groups": (328, 32, "uneven"),  # g_idx that sorting cannot make contiguous
}


@pytest.mark.parametrize("name", list(GROUPINGS))
@pytest.mark.parametrize("M", [1, 20])
def test_every_scale_mode(name, M):
    Kg, group, kind = GROUPINGS[name]
    x, qw, s, z, g_idx, ref = make_problem(M, Kg, 72, group, asym=True, act_order=False, seed=29)
    if kind == "uneven":  # group sizes 1 .. G apart: g_idx keeps per-element gathers
        gen = torch.Generator().manual_seed(31)
        G = s.shape[0]
        g_idx = torch.randint(0, G, (Kg,), generator=gen, dtype=torch.int32)
        zf = z.double()[g_idx.long()]
        q = torch.stack([(qw[k // 8] >> (4 * (k % 8))) & 0xF for k in range(Kg)]).double()  # (K, N) codes
        ref = x @ ((q - zf) * s[g_idx.long()])
        assert prepare(qw, s, z, g_idx, group, Kg).g_idx is not None
    out = w4a16_matmul(x.float(), qw, s.float(), z, g_idx, group)
    assert rel_err(out, ref) < TOL[torch.float32]


def test_act_order_is_sorted_once_and_x_gathered():
    x, qw, s, z, g_idx, ref = make_problem(3, K, N, 32, asym=True, act_order=True, seed=37)
    w = prepare(qw, s.float(), z, g_idx, 32, K)
    assert w.g_idx is None and w.perm is not None  # contiguous groups: per-plane scales
    assert torch.equal(g_idx.long()[w.perm], torch.arange(K) // 32)
    assert rel_err(w4a16_prepared(x.float(), w), ref) < TOL[torch.float32]


def test_rejects_a_block_k_other_than_the_layout_tile():
    x, qw, s, z, g_idx, _ = make_problem(1, K, N, 128, asym=False, act_order=False, seed=41)
    with pytest.raises(ValueError, match="BLOCK_K is the layout's tile"):
        plan(x.half(), qw, s.half(), z, g_idx, 128, config=W4A16Config("gemv", 1, 64, BLOCK_K=64))


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
