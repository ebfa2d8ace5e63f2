"""FP4 weights-only Triton kernel (NVFP4A16, MXFP4A16) under TRITON_INTERPRET=1 against an
independent float64 reference built from the codes and scale bits directly.

Tolerance: relative Frobenius error ||out - ref|| / ||ref||. fp32 activations: 1e-5
(fp32 scales and accumulation of K <= 512 terms); fp16: 2e-3 (the dequantised weight and
the output are rounded to fp16, unit roundoff 4.9e-4).
"""

import pytest
import torch
from compressed_tensors.compressors import MXFP4PackedCompressor, NVFP4PackedCompressor
from compressed_tensors.quantization import preset_name_to_scheme

from infer_tool.kernels import backend
from infer_tool.kernels.fp4 import Fp4Config, choose_config, dequantize_fp4, fp4_matmul, fp4_reference

TOL = {torch.float16: 2e-3, torch.float32: 1e-5}
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1 = torch.cat([E2M1, -E2M1]).double()  # code -> value, code 8 is -0
SHAPES = {"nvfp4": (336, 200), "mxfp4": (352, 200)}  # (K, N): K not a multiple of any BLOCK_K >= 32


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    """Run Triton kernels on the CPU interpreter; poison every kernel output buffer."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def poisoned(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(backend, "empty_output", poisoned)


def make_problem(fmt, M, K, N, *, seed):
    """Random codes and scale bits, packed by hand, and the float64 product `x @ Wᵀ`."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)  # (N, K)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # (N, K/2): even k in the low nibble
    if fmt == "nvfp4":
        G = K // 16
        s = (torch.rand(N, G, generator=g) * 440 + 0.002).to(torch.float8_e4m3fn)  # normal and subnormal
        s[0, 0] = torch.tensor(2.0**-9).to(torch.float8_e4m3fn)  # the smallest subnormal
        s[1, 0] = 448.0
        gs = torch.tensor([2688.0 / 0.37])
        eff = s.double() / gs.double()
        args = (s, gs)
    else:
        G = K // 32
        u = torch.randint(118, 124, (N, G), generator=g, dtype=torch.uint8)
        eff = torch.exp2(u.double() - 127)
        args = (u, None)
    w = E2M1[codes.long()] * eff.repeat_interleave(K // G, dim=1)  # (N, K)
    x = torch.randn(M, K, generator=g, dtype=torch.float64)
    return x, packed, args, x @ w.t()


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("M", [1, 3, 16, 64])
def test_matches_float64_reference(M, dtype, fmt):
    K, N = SHAPES[fmt]
    x, packed, (s, gs), ref = make_problem(fmt, M, K, N, seed=M * 7 + len(fmt))
    out = fp4_matmul(x.to(dtype), packed, s, gs)
    assert out.dtype == dtype and out.shape == (M, N)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype]


FORCED = {
    "gemv-splitk": Fp4Config("gemv", BLOCK_M=4, BLOCK_N=32, BLOCK_K=64, SPLIT_K=3),
    "splitk": Fp4Config("splitk", BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=4),
    "tiled": Fp4Config("tiled", BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=2),
}


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("name", list(FORCED))
def test_each_path_with_explicit_config(name, fmt):
    # M=20 spans two row-tiles of 16, so the grouped program order is exercised too.
    K, N = SHAPES[fmt]
    x, packed, (s, gs), ref = make_problem(fmt, 20, K, N, seed=3)
    out = fp4_matmul(x.half(), packed, s, gs, config=FORCED[name])
    assert rel_err(out, ref) < TOL[torch.float16]


def test_default_config_follows_m():
    sms = 132  # an H100/H200
    assert choose_config(1, 4096, 4096, sms).path == "gemv"
    assert choose_config(1, 4096, 4096, sms).SPLIT_K > 1
    assert choose_config(16, 4096, 4096, sms).path == "splitk"
    assert choose_config(2048, 4096, 4096, sms).path == "tiled"
    assert choose_config(2048, 4096, 4096, sms).SPLIT_K == 1


def test_tiled_default_for_large_m():
    x, packed, (s, gs), ref = make_problem("nvfp4", 80, 128, 72, seed=5)
    out = fp4_matmul(x.half(), packed, s, gs)
    assert rel_err(out, ref) < TOL[torch.float16]


@pytest.mark.parametrize("name", ["gemv-splitk", "splitk"])
def test_split_k_is_bitwise_deterministic(name):
    x, packed, (s, gs), _ = make_problem("nvfp4", 5, 336, 200, seed=13)
    first = fp4_matmul(x.half(), packed, s, gs, config=FORCED[name])
    second = fp4_matmul(x.half(), packed, s, gs, config=FORCED[name])
    assert torch.equal(first, second)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_cpu_without_interpreter_runs_the_reference(monkeypatch, fmt):
    monkeypatch.delenv("TRITON_INTERPRET")
    assert backend.backend_name("cpu") == "torch-reference"
    K, N = SHAPES[fmt]
    x, packed, (s, gs), ref = make_problem(fmt, 4, K, N, seed=17)
    out = fp4_matmul(x.float(), packed, s, gs)
    assert torch.equal(out, fp4_reference(x.float(), packed, s, gs))
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("preset", ["NVFP4A16", "MXFP4A16"])
def test_reference_dequant_is_compressed_tensors_decompression(preset):
    """The kernel module's torch dequantisation reads compressor-written tensors as the
    compressor's own decompressor does."""
    from infer_tool.packers import fp4

    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(19)) * 0.05
    sch = preset_name_to_scheme(preset, ["Linear"])
    if preset == "NVFP4A16":
        _, s, gs = fp4.nvfp4_quantize(w)
        state = {"weight": w, "weight_scale": s.float(), "weight_global_scale": gs}
        comp = NVFP4PackedCompressor.compress(state, sch)
        dec = NVFP4PackedCompressor.decompress(comp, sch)["weight"]
        ours = dequantize_fp4(comp["weight_packed"], comp["weight_scale"], comp["weight_global_scale"], dec.dtype)
    else:
        _, u = fp4.mxfp4_quantize(w)
        comp = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": torch.exp2(u.float() - 127)}, sch)
        dec = MXFP4PackedCompressor.decompress(comp, sch)["weight"]
        ours = dequantize_fp4(comp["weight_packed"], comp["weight_scale"], None, dec.dtype)
    assert torch.equal(ours, dec)


def test_rejects_mismatched_operands():
    x, packed, (s, gs), _ = make_problem("nvfp4", 2, 64, 16, seed=1)
    with pytest.raises(ValueError, match="w_scale must be"):
        fp4_matmul(x.half(), packed, s[:, :2], gs)
    with pytest.raises(ValueError, match="neither NVFP4"):
        fp4_matmul(x.half(), packed, s, None)
    with pytest.raises(ValueError, match="K a multiple of 16"):
        fp4_matmul(x[:, :40].half(), packed[:, :20], s[:, :2], gs)
    with pytest.raises(ValueError, match="w_packed must be uint8"):
        fp4_matmul(x.half(), packed.int(), s, gs)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("M", [2, 16], ids=["gemv", "splitk"])
def test_every_scale_code_decodes_exactly(fmt, M):
    """Row n of the weight uses scale bit pattern n in every group (all 127 finite E4M3
    patterns, subnormals included; E8M0 exponents 0..250); one-hot fp32 rows of x pick
    single columns, so the output is the dequantised weight itself, exactly."""
    g = torch.Generator().manual_seed(23)
    if fmt == "nvfp4":
        K, bits = 64, torch.arange(127, dtype=torch.int32).to(torch.uint8)
        s = bits.view(torch.float8_e4m3fn)[:, None].expand(-1, K // 16).contiguous()
        gs, eff = torch.ones(1), s.double()
    else:
        K, bits = 64, torch.arange(251, dtype=torch.int32).to(torch.uint8)
        s, gs = bits[:, None].expand(-1, K // 32).contiguous(), None
        eff = torch.exp2(s.double() - 127)
    N = bits.numel()
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    w = E2M1[codes.long()] * eff.repeat_interleave(K // eff.shape[1], dim=1)  # (N, K) float64
    cols = torch.randperm(K, generator=g)[:M]
    x = torch.zeros(M, K)
    x[torch.arange(M), cols] = 1.0
    out = fp4_matmul(x, packed, s, gs)
    assert torch.equal(out.double(), w[:, cols].t())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("M", [1, 3, 16, 2048], ids=["gemv1", "gemv4", "splitk", "tiled"])
@pytest.mark.parametrize("arch", [80, 90])
def test_compiles_for_ampere_and_hopper(fmt, M, arch):
    """Ahead of time through Triton and ptxas (no GPU), the default configurations for a
    4096 x 4096 weight on a 132-SM GPU: they compile for sm_80 (no fp8 instructions: the
    scales are decoded with integer arithmetic) and sm_90, the dot paths use tensor
    cores, and nothing spills to the stack."""
    from infer_tool.kernels import fp4
    from infer_tool.kernels.backend import resource_usage

    K = N = 4096
    packed = torch.zeros(N, K // 2, dtype=torch.uint8)
    if fmt == "nvfp4":
        s, gs = torch.ones(N, K // 16).to(torch.float8_e4m3fn), torch.ones(1)
    else:
        s, gs = torch.full((N, K // 32), 127, dtype=torch.uint8), None
    x = torch.zeros(M, K, dtype=torch.bfloat16)  # CPU tensors: only dtypes and shapes matter
    launch, _ = fp4.plan(x, packed, s, gs, config=choose_config(M, N, K, 132))
    compiled = launch.compile_for(arch)
    assert ("mma" in compiled.asm["ptx"]) == ("DOT_PRECISION" in launch.meta)
    assert resource_usage(compiled)["stack"] == 0
