"""FP8 Triton kernel (W8A8 dynamic/static per-token activations, W8A16) under
TRITON_INTERPRET=1 against a float64 reference.

W8A8 activations are rounded to e4m3 by torch's own cast (round to nearest even) before
the kernel runs, as vLLM quantizes before its scaled GEMM; the float64 reference uses the
same rounding and checks the per-token / static scales, the GEMM and the epilogue.
Tolerance: relative Frobenius error; fp32 activations 1e-5 (fp32 accumulation), fp16 2e-3
(fp16 output, unit roundoff 4.9e-4). Any activation rounded differently would cost ~1e-3
relative, so the fp32 bound also checks that the kernel multiplies the codes it was given.
"""

import pytest
import torch

from infer_tool.kernels import backend
from infer_tool.kernels.fp8 import FP8_MAX, Fp8Config, fp8_matmul, fp8_reference

TOL = {torch.float16: 2e-3, torch.float32: 1e-5}
K, N = 328, 200  # not multiples of any tile, nor of the 128 scale block
E4M3_UNIT_ROUNDOFF = 2.0**-4  # 3 mantissa bits


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def poisoned(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(backend, "empty_output", poisoned)


def make_weight(granularity, *, seed, n=N, k=K):
    """e4m3 weight (N, K), fp32 scale of the granularity, block_size."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    if granularity == "tensor":
        scale, block = (w.abs().max() / FP8_MAX).reshape(1), None
        w_fp8 = (w / scale).to(torch.float8_e4m3fn)
    elif granularity == "channel":
        scale, block = w.abs().amax(dim=1, keepdim=True) / FP8_MAX, None
        w_fp8 = (w / scale).to(torch.float8_e4m3fn)
    else:
        block = (128, 128)
        scale = torch.rand(-(-n // 128), -(-k // 128), generator=g) * 1e-3 + 1e-4
        w_fp8 = (torch.randn(n, k, generator=g) * 100).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return w_fp8, scale, block


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("M", [1, 3, 16, 64])
@pytest.mark.parametrize("mode", ["w8a8", "w8a16"])
def test_block_scales_match_float64_reference(mode, M, dtype):
    w_fp8, scale, block = make_weight("block", seed=M)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(100 + M)).to(dtype)
    ref = fp8_reference(x, w_fp8, scale, mode, block, compute_dtype=torch.float64)
    out = fp8_matmul(x, w_fp8, scale, mode, block)
    assert out.dtype == dtype and out.shape == (M, N)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
@pytest.mark.parametrize("mode", ["w8a8", "w8a16"])
def test_tensor_and_channel_scales(mode, granularity):
    w_fp8, scale, block = make_weight(granularity, seed=7)
    x = torch.randn(16, K, generator=torch.Generator().manual_seed(8)).float()
    ref = fp8_reference(x, w_fp8, scale, mode, block, compute_dtype=torch.float64)
    assert rel_err(fp8_matmul(x, w_fp8, scale, mode, block), ref) < TOL[torch.float32]


def test_static_input_scale():
    w_fp8, scale, block = make_weight("channel", seed=9)
    x = torch.randn(16, K, generator=torch.Generator().manual_seed(10)).half()
    input_scale = torch.tensor([x.float().abs().max() / FP8_MAX * 0.5])  # some values saturate
    ref = fp8_reference(x, w_fp8, scale, "w8a8", block, input_scale, compute_dtype=torch.float64)
    out = fp8_matmul(x, w_fp8, scale, "w8a8", block, input_scale)
    assert rel_err(out, ref) < TOL[torch.float16]


def test_activation_rounding_is_round_to_nearest_even():
    # Identity weight, amax 448 so a_scale = 1: the output is the quantized activation
    # itself. Inputs: every finite e4m3 value, every midpoint (ties) and values beyond 448.
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = codes[torch.isfinite(codes)].unique()  # sorted, +-0 merged
    mids = (values[1:] + values[:-1]) / 2
    row = torch.cat([values, mids, torch.tensor([500.0, -1000.0])])
    n = row.numel()
    x = torch.zeros(2, n)
    x[0] = row
    x[1] = -row.flip(0)
    eye = torch.eye(n).to(torch.float8_e4m3fn)
    out = fp8_matmul(x, eye, torch.ones(1), "w8a8")  # amax 1000 -> a_scale 1000/448
    expected = fp8_reference(x, eye, torch.ones(1), "w8a8", compute_dtype=torch.float64)
    # fp32 product of two fp32 numbers = the fp64 product rounded once to fp32.
    assert torch.equal(out, expected.float())
    x_exact = x.clamp(-FP8_MAX, FP8_MAX)  # amax exactly 448 -> a_scale exactly 1
    out = fp8_matmul(x_exact, eye, torch.ones(1), "w8a8")
    assert torch.equal(out, x_exact.to(torch.float8_e4m3fn).float())


def test_reference_w8a8_error_is_within_the_e4m3_rounding_bound():
    # |x̂ŵ - xŵ| <= u · (|x| @ |ŵ|ᵀ) elementwise (normal-range activations), u = 2^-4.
    w_fp8, scale, block = make_weight("channel", seed=12)
    x = torch.randn(8, K, generator=torch.Generator().manual_seed(13)).double()
    w = w_fp8.double() * scale.double()
    exact = x @ w.T
    quant = fp8_reference(x.float(), w_fp8, scale, "w8a8", compute_dtype=torch.float64)
    a_scale = x.abs().amax(dim=1, keepdim=True) / FP8_MAX
    subnormal_slack = (2.0**-10 * a_scale) @ w.abs().sum(dim=1, keepdim=True).T
    bound = E4M3_UNIT_ROUNDOFF * (x.abs() @ w.abs().T) + subnormal_slack
    assert ((quant - exact).abs() <= bound * (1 + 1e-9)).all()
    assert rel_err(quant, exact) > 1e-4  # the activations really were quantized


@pytest.mark.parametrize("mode", ["w8a8", "w8a16"])
def test_split_k_is_bitwise_deterministic(mode):
    w_fp8, scale, block = make_weight("block", seed=14)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(15)).half()
    cfg = Fp8Config(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, SPLIT_K=3)
    first = fp8_matmul(x, w_fp8, scale, mode, block, config=cfg)
    assert torch.equal(first, fp8_matmul(x, w_fp8, scale, mode, block, config=cfg))
    ref = fp8_reference(x, w_fp8, scale, mode, block, compute_dtype=torch.float64)
    assert rel_err(first, ref) < TOL[torch.float16]


def test_tiled_default_for_large_m():
    w_fp8, scale, block = make_weight("block", seed=16, n=72, k=136)
    x = torch.randn(80, 136, generator=torch.Generator().manual_seed(17)).half()
    for mode in ("w8a8", "w8a16"):
        ref = fp8_reference(x, w_fp8, scale, mode, block, compute_dtype=torch.float64)
        assert rel_err(fp8_matmul(x, w_fp8, scale, mode, block), ref) < TOL[torch.float16]


def test_rejects_bad_operands():
    w_fp8, scale, block = make_weight("block", seed=1)
    x = torch.randn(2, K).half()
    with pytest.raises(ValueError, match="block_size"):
        fp8_matmul(x, w_fp8, scale[:1], "w8a8", block)
    with pytest.raises(ValueError, match="mode"):
        fp8_matmul(x, w_fp8, scale, "w4a8", block)
    with pytest.raises(ValueError, match="none of"):
        fp8_matmul(x, w_fp8, torch.ones(3, 3), "w8a16")


@pytest.mark.parametrize("mode", ["w8a8", "w8a16"])
@pytest.mark.parametrize("M", [1, 3])
def test_gemv_split_k_matches_float64_in_one_launch(mode, M, monkeypatch):
    """The decode gemv (M <= 4, no tl.dot), its K split three ways and reduced in the same
    launch: one launch per product, the same bits twice, float64 reference within tolerance."""
    from infer_tool.kernels import backend

    w_fp8, scale, block = make_weight("block", seed=20 + M)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(21)).half()
    cfg = Fp8Config(BLOCK_M=4, BLOCK_N=16, BLOCK_K=32, SPLIT_K=3, path="gemv")
    launches = []
    real_run = backend.Launch.run
    monkeypatch.setattr(backend.Launch, "run", lambda self: (launches.append(self), real_run(self))[1])
    first = fp8_matmul(x, w_fp8, scale, mode, block, config=cfg)
    assert torch.equal(first, fp8_matmul(x, w_fp8, scale, mode, block, config=cfg))
    assert len(launches) == 2 and launches[0].grid[1] == 3 and launches[0].kernel.fn.__name__ == "_fp8_gemv_kernel"
    ref = fp8_reference(x, w_fp8, scale, mode, block, compute_dtype=torch.float64)
    assert rel_err(first, ref) < TOL[torch.float16]


def test_decode_defaults_to_the_gemv():
    from infer_tool.kernels.fp8 import choose_config

    assert choose_config(1, 14336, 4096, 132).path == "gemv"
    assert choose_config(1, 14336, 4096, 132).SPLIT_K > 1
    assert choose_config(5, 14336, 4096, 132).path == "dot"
