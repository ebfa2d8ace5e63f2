"""INT8 activations (`kernels/int8_act.py`), vLLM's AMX W4A8 arithmetic (`kernels/w4a8.py`) and
INT8 weights (`packers/int8_activations.py`), each against an independent reference:

- the quantizers against float64 formulas written from vLLM's kernels: identical codes wherever
  the float64 value is not within float32's error of a rounding tie (the reciprocal and the
  product each err by 2^-24 of |x / scale|; there float32 and float64 may round apart, by one
  code);
- exact ties and all-zero rows against codes worked out by hand;
- W4A8 against a float64 fake-quant matmul (bf16 output tolerance);
- the INT8 solvers' codes against their dequantized weights;
- and, in vLLM's environment, vLLM's own CPU ops (`tests/vllm_int8_probe.py`): bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infer_tool.kernels.int8_act import (
    KERNELS,
    dequantize,
    fake_quantize,
    quantize_per_token,
    quantize_static,
    vllm_kernel,
)
from infer_tool.kernels.layout import pack_int4_k
from infer_tool.kernels.w4a8 import w4a8_reference
from infer_tool.packers.int8_activations import int8_input_scale
from infer_tool.packers.int_weight import QuantizedWeight
from infer_tool.packers.rtn import quantize_rtn
from infer_tool.schemes.integer import GPTQScheme, RTNScheme

TIE_REL = 2.0**-21  # |v - (k + 0.5)| / |x / scale| within which float32 and float64 may round apart
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rows(K: int = 300, seed: int = 0) -> torch.Tensor:
    """(M, K) fp32 activations at magnitudes 1e-3 .. 1e3, with outlier channels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, K, generator=g) * torch.logspace(-3, 3, 40).view(-1, 1)
    x[:, ::37] *= 30.0
    return x


def reference_codes(v: torch.Tensor, lo: float, hi: float, away: bool = False) -> torch.Tensor:
    """float64 v -> clamp, round to nearest (ties to even, or away from zero)."""
    v = v.clamp(lo, hi)
    if away:
        return torch.sign(v) * torch.floor(v.abs() + 0.5)
    return torch.round(v)


def assert_codes(q: torch.Tensor, v: torch.Tensor, ref: torch.Tensor, xs: torch.Tensor | None = None) -> None:
    """q equals ref except, by one code, where the float64 value v is near a tie: within
    TIE_REL of |xs| (x / scale; v itself when there is no zero point) plus 1e-6."""
    xs = v if xs is None else xs
    inside = (v > -129) & (v < 128)  # beyond, both saturate
    near_tie = inside & (((v - torch.floor(v)) - 0.5).abs() < TIE_REL * xs.abs() + 1e-6)
    diff = (q.double() - ref).abs()
    assert int(diff.max()) <= 1
    assert not bool((diff > 0)[~near_tie].any()), f"{int((diff > 0)[~near_tie].sum())} codes differ away from ties"
    # the exemption covers few codes (bf16 inputs lie on a coarse lattice: more near-ties)
    assert float(near_tie.double().mean()) < 0.05


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_token_symmetric_matches_float64(kernel: str, dtype: torch.dtype) -> None:
    x = rows().to(dtype)
    q, scale, azp = quantize_per_token(x, kernel=kernel)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and azp is None
    assert scale.shape == (x.shape[0], 1)
    amax = x.double().abs().amax(dim=-1, keepdim=True)
    if kernel == "sgl":
        amax = amax.clamp_min(1e-7)
    torch.testing.assert_close(scale.double(), amax / 127, rtol=2**-23, atol=0)
    v = x.double() / (amax / 127)
    away = kernel == "sgl" and dtype != torch.bfloat16
    assert_codes(q, v, reference_codes(v, -128, 127, away))
    assert int(q.min()) >= -127  # symmetric: -128 is never reached


def test_avx2_build_rounds_the_zero_point_separately() -> None:
    """vLLM's AVX2 build computes x * inv + azp in two roundings, the AVX-512 build in one fused
    multiply-add: -3.475 / 0.05 + 7 (a value the probe found on an AMD Zen 3) is -62.5 after
    the first rounding (ties to even: -62) and just below it with one (-63). Symmetric
    activations quantize to the same values in both builds, zero rows included."""
    x = torch.tensor([[-3.4750001430511475]])
    s, azp = torch.tensor([0.05]), torch.tensor([7], dtype=torch.int32)
    assert quantize_static(x, s, azp, kernel="onednn_avx2").item() == -62
    assert quantize_static(x, s, azp, kernel="onednn").item() == -63
    g = torch.Generator().manual_seed(0)
    rows = torch.cat([torch.randn(6, 64, generator=g) * 3.0, torch.zeros(1, 64)])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd = rows.to(dtype)
        assert torch.equal(fake_quantize(xd, kernel="onednn"), fake_quantize(xd, kernel="onednn_avx2"))
        assert torch.equal(fake_quantize(xd, s, kernel="onednn"), fake_quantize(xd, s, kernel="onednn_avx2"))
    assert vllm_kernel("cpu", 64, 64, amx=False, avx512=False) == "onednn"
    assert vllm_kernel("cpu", 64, 64, amx=False, avx512=False, symmetric=False) == "onednn_avx2"
    assert vllm_kernel("cpu", 64, 64, amx=False, avx512=True, symmetric=False) == "onednn"


def test_per_token_ties_and_zero_rows() -> None:
    """amax 127 gives scale 1 exactly, so every value k + 0.5 is a tie: ties go to even on the
    oneDNN and CUDA paths and the bf16 AMX path, away from zero on the AMX path for fp16.
    An all-zero row gives codes 0 (scale 0, or 1e-7/127 on the AMX path), -128 in vLLM's AVX2
    build (NaN saturated), which still dequantize to 0."""
    halves = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5])
    x = torch.zeros(2, 16)
    x[0, 0] = 127.0
    x[0, 1:9] = halves
    even = [0, 2, 2, 0, -2, -2, 126, -126]
    away = [1, 2, 3, -1, -2, -3, 127, -127]
    for kernel in KERNELS:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            q, scale, _ = quantize_per_token(x.to(dtype), kernel=kernel)
            want = away if kernel == "sgl" and dtype != torch.bfloat16 else even
            assert q[0, 1:9].tolist() == want, (kernel, dtype)
            assert float(scale[0]) == 1.0
            assert q[1].tolist() == [-128 if kernel == "onednn_avx2" else 0] * 16, (kernel, dtype)
            assert dequantize(q, scale)[1].abs().max() == 0
            floor = float(torch.tensor(1e-7) / 127) if kernel == "sgl" else 0.0
            assert float(scale[1]) == floor
            assert bool((fake_quantize(x.to(dtype), kernel=kernel)[1] == 0).all())


@pytest.mark.parametrize("kernel", ("onednn", "cuda"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_token_asymmetric_matches_float64(kernel: str, dtype: torch.dtype) -> None:
    x = rows(seed=1).to(dtype)
    x[::3] = x[::3].abs() + 1.0  # some rows all positive: zero outside the range
    q, scale, azp = quantize_per_token(x, symmetric=False, kernel=kernel)
    assert azp is not None and azp.dtype == torch.int32
    xd = x.double()
    lo, hi = xd.amin(dim=-1, keepdim=True), xd.amax(dim=-1, keepdim=True)
    torch.testing.assert_close(scale.double(), (hi - lo) / 255, rtol=2**-23, atol=0)
    z = torch.round(-128 - lo / scale.double())
    assert torch.equal(azp.double(), z)
    v = xd / scale.double() + z
    assert_codes(q, v, reference_codes(v, -128, 127), xd / scale.double())
    assert int(q.min()) == -128 and int(q.max()) >= 126  # the range is used end to end
    err = (dequantize(q, scale, azp) - xd.float()).abs()
    assert bool((err <= 0.5 * scale * (1 + 1e-5)).all())


@pytest.mark.parametrize("kernel", ("onednn", "cuda"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("zero_point", (None, 7))
def test_static_matches_float64_and_saturates(kernel: str, dtype: torch.dtype, zero_point: int | None) -> None:
    x = rows(seed=2)[10:30].to(dtype)  # magnitudes ~0.01 .. 100: many saturate at scale 0.05
    scale = torch.tensor([0.05])
    azp = None if zero_point is None else torch.tensor([zero_point], dtype=torch.int32)
    q = quantize_static(x, scale, azp, kernel=kernel)
    v = x.double() / 0.05 + (zero_point or 0)
    assert_codes(q, v, reference_codes(v, -128, 127), x.double() / 0.05)
    assert int(q.min()) == -128 and int(q.max()) == 127
    fq = fake_quantize(x, scale, azp, kernel=kernel)
    inside = (v > -128) & (v < 127)
    assert bool(((fq - x.float()).abs()[inside] <= 0.025 * (1 + 1e-5)).all())


def test_fake_quantize_error_is_half_a_step() -> None:
    for kernel in KERNELS:
        x = rows(seed=3)
        q, scale, _ = quantize_per_token(x, kernel=kernel)
        fq = fake_quantize(x, kernel=kernel)
        assert fq.dtype == torch.float32
        assert torch.equal(fq, q.float() * scale)
        assert bool(((fq - x).abs() <= 0.5 * scale * (1 + 1e-5)).all())


def test_sgl_refuses_what_the_amx_kernels_do_not_do() -> None:
    x = rows()
    with pytest.raises(ValueError, match="symmetrically"):
        quantize_per_token(x, symmetric=False, kernel="sgl")
    with pytest.raises(ValueError, match="ignores a static input_scale"):
        quantize_static(x, torch.tensor([0.1]), kernel="sgl")
    with pytest.raises(ValueError, match="unknown kernel"):
        quantize_per_token(x, kernel="avx2")


def _int4_weight(K: int, N: int, group: int, symmetric: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (K, N), generator=g, dtype=torch.uint8)
    G = K // group
    zeros = None if symmetric else torch.randint(0, 16, (G, N), generator=g, dtype=torch.uint8)
    scales = (torch.rand(G, N, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
    return q, scales, zeros


@pytest.mark.parametrize("group,symmetric", [(32, False), (128, True), (256, False)])
def test_w4a8_matches_float64_fake_quant(group: int, symmetric: bool) -> None:
    """vLLM's W4A8 arithmetic (int32 block sums, float32 scaling) against float64: activations
    rounded as the AMX kernel rounds them, times the dequantized INT4 weight, plus the bias;
    within bf16 output rounding (2^-8 relative) plus float32 accumulation."""
    K, N = 512, 64
    q, scales, zeros = _int4_weight(K, N, group, symmetric)
    x = rows(K, seed=4)[18:27].to(torch.bfloat16)  # magnitudes ~0.5 .. 10, outlier channels
    bias = torch.randn(N) * 0.1
    out = w4a8_reference(x, pack_int4_k(q), scales, zeros, group, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (9, N)
    xd = x.double()
    amax = xd.abs().amax(dim=-1, keepdim=True).clamp_min(1e-7)
    xq = torch.round(xd * 127 / amax) * (amax / 127)  # float64 fake quant (no ties in random data)
    gi = torch.arange(K) // group
    z = 8.0 if zeros is None else zeros.double()[gi]
    w = (q.double() - z) * scales.double()[gi]
    ref = xq @ w + bias.double()
    err = (out.double() - ref).abs()
    assert bool((err <= 2**-8 * ref.abs() + 1e-3 * ref.abs().mean()).all()), float(err.max())
    # and it is not the W4A16 product: the activation rounding is visible
    assert float((x.double() @ w + bias.double() - out.double()).abs().max()) > 4 * float(err.max())


def test_w4a8_refuses_groups_it_cannot_block() -> None:
    q, scales, zeros = _int4_weight(192, 32, 192, True)
    with pytest.raises(ValueError, match="multiple of the 128"):
        w4a8_reference(torch.randn(2, 192).to(torch.bfloat16), pack_int4_k(q), scales, zeros, 192)


def test_int8_weights_from_the_int_solvers() -> None:
    """RTN and GPTQ at 8 bits, symmetric, per channel and per group: int8 codes whose product
    with the scales is the solver's dequantized weight; RTN's codes stay in [-127, 127]."""
    g = torch.Generator().manual_seed(5)
    W = torch.randn(48, 256, generator=g)
    W[:, 7] *= 20.0
    X = torch.randn(512, 256, generator=g)
    from infer_tool.calib.stats import LayerStats
    from infer_tool.packers.gptq import quantize_gptq

    stats = LayerStats(
        H=2 * X.T @ X / X.shape[0], act_abs_mean=X.abs().mean(0), act_abs_max=float(X.abs().max()), tokens=X.shape[0]
    )
    for group in (-1, 64):
        for solved in (
            quantize_rtn(W, None, RTNScheme(bits=8, group_size=group)),
            quantize_gptq(W, stats, GPTQScheme(bits=8, group_size=group, act_order=False)),
        ):
            w8, scale = solved.int8()
            assert w8.dtype == torch.int8 and w8.shape == W.shape
            assert scale.shape == (48, 1 if group == -1 else 256 // group)
            gi = torch.arange(256) // (256 if group == -1 else group)
            assert torch.equal(w8.float() * scale[:, gi], solved.dequantize())
        rtn = quantize_rtn(W, None, RTNScheme(bits=8, group_size=group))
        w8, scale = rtn.int8()
        assert int(w8.min()) >= -127 and int(w8.abs().max()) == 127
        torch.testing.assert_close(scale[:, 0], W[:, : (256 if group == -1 else group)].abs().amax(1) / 127)
    with pytest.raises(ValueError, match="symmetric 8-bit"):
        quantize_rtn(W, None, RTNScheme(bits=4, group_size=64)).int8()
    with pytest.raises(ValueError, match="act-order"):
        QuantizedWeight(
            q=rtn.q,
            scale=rtn.scale,
            zero=None,
            g_idx=torch.arange(256, dtype=torch.int32).flip(0) // 64,
            bits=8,
            group_size=64,
        ).int8()


def test_int8_input_scale() -> None:
    assert float(int8_input_scale(12.7)[0]) == pytest.approx(0.1, rel=1e-7)
    assert float(int8_input_scale(0.0)[0]) == 1.0
    from infer_tool.common.errors import BadInput

    with pytest.raises(BadInput, match="not finite"):
        int8_input_scale(float("inf"))


PROBE = Path(__file__).with_name("vllm_int8_probe.py")


@pytest.mark.vllm
def test_matches_vllm_cpu_kernels(tmp_path: Path) -> None:
    """vLLM's CPU ops, run in its environment on crafted inputs, against ours: every code and
    every W8A8/W4A8 GEMM output bit equal (the oneDNN linear, whose GEMM we do not emulate,
    within bf16 rounding), with the rounding of the vLLM build this CPU loads. vLLM's AVX2
    build has no AMX ops (`sgl`, `w4a8`): there they must be missing, not wrong. On a CPU
    without VNNI, oneDNN's dynamic per-token W8A8 GEMM saturates its int16 pair sums
    (docs/vllm-cpu.md): its output must be what that saturation gives, and off the exact
    product by more than 5% per row (so the day vLLM or oneDNN changes it, this fails)."""
    import vllm_formats

    try:
        python = vllm_formats.vllm_python()
    except vllm_formats.VllmEnvMissing as exc:
        pytest.fail(str(exc))
    out = tmp_path / "probe.safetensors"
    run = subprocess.run(
        [str(python), str(PROBE), "record", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**__import__("os").environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    res = subprocess.run(
        [sys.executable, str(PROBE), "compare", str(out), "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    probe = json.loads(res.stdout)
    rows_, host = probe["rows"], probe["host"]
    assert len(rows_) >= 50
    assert host["build"] in ("_C", "_C_AVX512", "_C_AVX2"), host
    for row in rows_:
        if host["build"] == "_C_AVX2" and row["case"].split(".")[0] in ("sgl", "w4a8"):
            assert "object has no attribute 'convert_weight_packed" in row.get("error", ""), row
            continue
        assert "error" not in row, row
        for key in ("codes_differ", "outputs_differ", "scale_bits_differ", "azp_differ"):
            assert row.get(key, 0) == 0, row
        if row["case"] == "onednn.dynamic" and not host["vnni"]:
            assert row["saturating_row_rel"] < 0.01 and row["row_rel"] > 0.05, row
        elif row["case"].startswith("onednn"):
            assert row["max_rel"] < 2**-7, row
