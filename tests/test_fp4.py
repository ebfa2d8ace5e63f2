"""FP4 (NVFP4, MXFP4) numerics of packers/fp4.py and the bit layout of kernels/fp4_layout.py
against independent references:

- brute force in float64: nearest E2M1 grid point (ties to the even code), nearest E4M3
  value, the E8M0 exponent rule written from the OCP "even" description;
- compressed-tensors (our .venv's copy, the library that reads and writes these formats):
  `cast_to_fp4`, `pack_fp4_to_uint8` / `unpack_fp4_from_uint8`, `generate_gparam`,
  `calculate_qparams`, `fake_quantize`, the dynamic activation path, and the
  `NVFP4PackedCompressor` / `MXFP4PackedCompressor` compress and decompress;
- vLLM's CPU build (.venv-vllm): its NVFP4 activation emulation and weight dequantization.

Equality is exact where the reference computes the same float32 operations; tolerances are
stated where it does not.
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors import MXFP4PackedCompressor, NVFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4
from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

from infer_tool.kernels.fp4_layout import (
    E2M1_VALUES,
    decode_e2m1,
    decode_e8m0,
    dequantize_codes,
    effective_scale,
    pack_fp4,
    unpack_fp4,
)
from infer_tool.packers import fp4

GRID = torch.tensor(E2M1_VALUES, dtype=torch.float64)
TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
DTYPES = [torch.float32, torch.bfloat16]


def scheme(name: str):
    return preset_name_to_scheme(name, ["Linear"])


def nearest_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Brute force: the grid value nearest |x| (float64 distances; on a tie the even code,
    i.e. the even index into E2M1_VALUES), with x's sign. Beyond 6 the nearest is 6."""
    a = x.double().abs().reshape(-1, 1)
    d = (a - GRID).abs()  # (n, 8)
    best = d.min(dim=1, keepdim=True).values
    cand = d == best
    even = cand & (torch.arange(8) % 2 == 0)
    idx = torch.where(even.any(dim=1), even.float().argmax(dim=1), cand.float().argmax(dim=1))
    mag = GRID[idx].reshape(x.shape)
    return torch.where(x < 0, -mag, mag)


def e4m3_values() -> torch.Tensor:
    """Every finite non-negative float8_e4m3fn value, float64, ascending."""
    bits = torch.arange(0, 127, dtype=torch.uint8)  # 0x7F is NaN
    return bits.view(torch.float8_e4m3fn).double()


def nearest_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Brute force nearest E4M3 value of non-negative v (float64), saturating at 448;
    ties go to the even mantissa (even bit pattern)."""
    vals = e4m3_values()
    d = (v.double().reshape(-1, 1) - vals).abs()
    best = d.min(dim=1, keepdim=True).values
    cand = d == best
    even = cand & (torch.arange(127) % 2 == 0)
    idx = torch.where(even.any(dim=1), even.float().argmax(dim=1), cand.float().argmax(dim=1))
    return vals[idx].reshape(v.shape)


def mx_exponent(amax: float) -> int:
    """E8M0 biased exponent of a group max by the OCP "even" rule, from math.frexp: with
    amax = m * 2**e, m in [1, 2), the binade goes up one when m >= 1.75; minus
    floor(log2(6)) = 2; clamped to 0..254."""
    if amax == 0:
        return 0
    f, e = math.frexp(amax)  # amax = f * 2**e, f in [0.5, 1)
    m, e = 2 * f, e - 1
    return min(max(127 + e + (1 if m >= 1.75 else 0) - 2, 0), 254)


def weights(dtype: torch.dtype, N: int = 12, K: int = 128, seed: int = 0) -> torch.Tensor:
    """Random weights with the groups that matter: an all-zero group, groups 1e-4 of the
    tensor max (subnormal E4M3 scales), a negative tensor max, a group of equal values."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g, dtype=torch.float64) * 0.05
    w[0, :32] = 0.0
    w[1, :32] *= 1e-4
    w[2, 5] = -1.5  # the tensor amax, negative
    w[3, 16:32] = 0.02
    return w.to(dtype)


# --- the grid and its codes -------------------------------------------------------------


def grid_inputs() -> torch.Tensor:
    ties = torch.tensor(TIES, dtype=torch.float32)
    up = torch.nextafter(ties, torch.tensor(float("inf")))
    down = torch.nextafter(ties, torch.tensor(0.0))
    g = torch.Generator().manual_seed(1)
    rnd = (torch.rand(4000, generator=g) - 0.5) * 16
    exact = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    extra = torch.tensor([6.5, 7.0, 100.0, 1e-30, 0.0])
    pos = torch.cat([ties, up, down, exact, extra, rnd.abs()])
    return torch.cat([pos, -pos, rnd])


def test_round_to_e2m1_is_the_nearest_grid_point_ties_to_even():
    x = grid_inputs()
    got = fp4.round_to_e2m1(x)
    assert torch.equal(got.double(), nearest_e2m1(x))
    assert fp4.round_to_e2m1(torch.tensor(TIES)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_round_to_e2m1_small_and_large_tensors_round_alike_in_every_dtype(dtype: torch.dtype) -> None:
    """A tensor of at most `SEARCH_MAX` elements (a GPTQ column) takes the binary search over
    exclusive bounds, a larger one the rounding within binades (float64: the pass per
    threshold; codes: always the lookup): all give the nearest grid point (ties to even) on
    the ties and their neighbours in `dtype`, and a NaN gives code 0."""
    from infer_tool.kernels.fp4_act import SEARCH_MAX

    ties = torch.tensor(TIES, dtype=dtype)
    big, small = torch.tensor(float("inf"), dtype=dtype), torch.tensor(0.0, dtype=dtype)
    near = torch.cat([ties, torch.nextafter(ties.double(), big.double()).to(dtype)]) if dtype == torch.float64 else None
    if near is None:  # neighbours in the dtype itself, from its bit patterns
        ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
        bits = ties.view(ints)
        near = torch.cat([ties, (bits + 1).view(dtype), (bits - 1).view(dtype)])
    else:
        near = torch.cat([near, torch.nextafter(ties, small)])
    x = torch.cat([near, -near, grid_inputs().to(dtype), torch.tensor([-0.0, 1e4], dtype=dtype)])
    assert x.numel() > SEARCH_MAX
    want = nearest_e2m1(x)
    large = fp4.round_to_e2m1(x)
    pieces = fp4.round_to_e2m1(x.reshape(-1, 1)[:SEARCH_MAX].reshape(-1))  # one small tensor
    pieces = torch.cat([pieces] + [fp4.round_to_e2m1(c) for c in x[SEARCH_MAX:].split(1000)])
    for got in (large, pieces):
        assert got.dtype == dtype and torch.equal(got.double(), want)
        assert torch.equal(torch.signbit(got), torch.signbit(large))
    assert torch.equal(fp4.e2m1_codes(x[:100]), fp4.e2m1_codes(x[:100].repeat(50))[:100])
    nan = torch.tensor([float("nan")] * 3, dtype=dtype)
    assert fp4.e2m1_index(nan).tolist() == [0] * 3 and fp4.e2m1_index(nan.repeat(2000)).unique().tolist() == [0]


def test_round_to_e2m1_over_a_sweep_of_float32_bit_patterns():
    """The large-tensor path (rounding within binades, from the exponent bits) against the
    brute-force nearest grid point on about a million float32 bit patterns spread over all
    of them (every sign, binade and mantissa region: subnormals, infinities, NaN), and
    against the lookup path on the same values in small pieces. NaN gives +0."""
    from infer_tool.kernels.fp4_act import SEARCH_MAX

    bits = torch.arange(0, 1 << 32, 4093, dtype=torch.int64)
    bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
    x = torch.cat([bits.view(torch.float32), torch.tensor([float("nan"), -float("nan"), float("inf"), -0.0])])
    got = fp4.round_to_e2m1(x)
    nan = torch.isnan(x)
    want = nearest_e2m1(torch.where(nan, 0.0, x).clamp(-6.0, 6.0)).float()  # beyond 6 (inf too): 6
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bit for bit: the sign of zero too
    assert nan.sum() > 1000 and not torch.signbit(got[nan]).any()
    pieces = torch.cat([fp4.round_to_e2m1(c) for c in x.split(SEARCH_MAX)[:64]])
    assert torch.equal(pieces.view(torch.int32), got[: pieces.numel()].view(torch.int32))


def test_round_to_e2m1_matches_compressed_tensors_with_the_sign_of_zero():
    x = grid_inputs().clamp(-6, 6)  # cast_to_fp4 runs after the clamp to the FP4 range
    ref = cast_to_fp4(x.clone())
    got = fp4.round_to_e2m1(x)
    assert torch.equal(got, ref)
    assert torch.equal(torch.signbit(got), torch.signbit(ref))  # -0.1 -> -0.0, -0.0 -> +0.0
    assert torch.signbit(fp4.round_to_e2m1(torch.tensor([-0.1]))).item()
    assert not torch.signbit(fp4.round_to_e2m1(torch.tensor([-0.0]))).item()


def test_codes_pack_to_compressed_tensors_bytes():
    x = grid_inputs().clamp(-6, 6).reshape(2, -1)  # rows of even length
    ref = pack_fp4_to_uint8(cast_to_fp4(x.clone()))
    assert torch.equal(pack_fp4(fp4.e2m1_codes(x)), ref)


def test_pack_order_low_nibble_first_and_round_trip():
    assert pack_fp4(torch.tensor([[0x1, 0x2]])).item() == 0x21  # element 0 low, element 1 high
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(4, 64)
    codes = unpack_fp4(every)
    assert codes.shape == (4, 128) and int(codes.max()) <= 15
    assert torch.equal(pack_fp4(codes), every)
    ref = unpack_fp4_from_uint8(every, 4, 128, dtype=torch.float32)
    assert torch.equal(decode_e2m1(codes), ref)
    assert torch.equal(torch.signbit(decode_e2m1(codes)), torch.signbit(ref))
    with pytest.raises(ValueError, match="even last dimension"):
        pack_fp4(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="0..15"):
        pack_fp4(torch.tensor([[3, 16]]))


def test_effective_scale_names_the_format_it_needs():
    s = torch.full((2, 1), 448.0).to(torch.float8_e4m3fn)
    assert effective_scale(s, torch.tensor([2.0])).tolist() == [[224.0], [224.0]]
    with pytest.raises(ValueError, match="need the tensor's global scale"):
        effective_scale(s)
    with pytest.raises(ValueError, match="have no global scale"):
        effective_scale(torch.full((2, 1), 127, dtype=torch.uint8), torch.ones(1))
    with pytest.raises(ValueError, match="float8_e4m3fn \\(NVFP4\\) or uint8"):
        effective_scale(torch.ones(2, 1))


def test_decode_e8m0_is_exact():
    u = torch.arange(255, dtype=torch.int32).to(torch.uint8)
    ref = torch.tensor([math.ldexp(1.0, int(i) - 127) for i in u], dtype=torch.float64)
    assert torch.equal(decode_e8m0(u).double(), ref)


# --- NVFP4 scales -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_nvfp4_scales_match_compressed_tensors(dtype):
    w = weights(dtype)
    gs_ref = generate_gparam(w.amin().reshape(1), w.amax().reshape(1))
    gs = fp4.nvfp4_global_scale(fp4.tensor_amax(w))
    assert gs.dtype == torch.float32 and gs.shape == (1,)
    assert torch.equal(gs, gs_ref)
    grouped = w.unflatten(-1, (-1, 16))
    s_ref, _ = calculate_qparams(grouped.amin(-1), grouped.amax(-1), scheme("NVFP4A16").weights, global_scale=gs_ref)
    s = fp4.nvfp4_group_scales(fp4.group_amax(w, 16), gs)
    assert s.dtype == torch.float8_e4m3fn and s.shape == (12, 8)
    assert torch.equal(s.float(), s_ref.float())
    assert s[2, 0].float().item() == 448.0  # the group holding the tensor amax
    assert s[0, 0].float().item() == 0.125  # all-zero group: compressed-tensors' stand-in
    sub = s[1, :2].float()
    assert ((sub > 0) & (sub < 2**-6)).all()  # subnormal E4M3 scales


def test_nvfp4_scales_are_the_nearest_e4m3_value():
    w = weights(torch.float32, N=64, K=256, seed=4)
    gs = fp4.nvfp4_global_scale(fp4.tensor_amax(w))
    amax = fp4.group_amax(w, 16)
    exact = gs.double() * amax.double() / 6  # float64, no intermediate rounding
    s = fp4.nvfp4_group_scales(amax, gs).double()
    ref = nearest_e4m3(exact.clamp(max=448))
    ref = torch.where(ref == 0, 0.125, ref)
    # float32 arithmetic may round a product sitting on an E4M3 midpoint the other way
    vals = e4m3_values()
    mids = (vals[1:] + vals[:-1]) / 2
    near_mid = ((exact.reshape(-1, 1) - mids).abs() <= 1e-6 * exact.reshape(-1, 1)).any(dim=1).reshape(exact.shape)
    assert torch.equal(s[~near_mid], ref[~near_mid])
    assert near_mid.float().mean() < 0.01


def test_global_scale_of_an_all_zero_tensor_is_one():
    assert fp4.nvfp4_global_scale(torch.zeros(1)).item() == 1.0
    codes, s, gs = fp4.nvfp4_quantize(torch.zeros(4, 32))
    assert gs.item() == 1.0 and (codes == 0).all() and (s.float() == 0.125).all()


def test_fused_shards_share_the_global_scale_of_their_max():
    q, k, v = (weights(torch.float32, N=8, K=64, seed=s) * f for s, f in ((1, 1.0), (2, 3.0), (3, 0.5)))
    gs = fp4.nvfp4_fused_global_scale(q, k, v)
    stacked = torch.cat([q, k, v])
    assert torch.equal(gs, generate_gparam(stacked.amin().reshape(1), stacked.amax().reshape(1)))
    assert torch.equal(gs, fp4.nvfp4_global_scale(k.abs().amax()))  # k holds the max
    scales = [fp4.nvfp4_quantize(t, gs)[1].float() for t in (q, k, v)]
    assert scales[1].max() == 448 and scales[0].max() < 448 and scales[2].max() < 448
    # the shards' own global scales differ, the fused one is their minimum (vLLM keeps 1/max)
    own = [fp4.nvfp4_global_scale(fp4.tensor_amax(t)) for t in (q, k, v)]
    assert len({x.item() for x in own}) == 3 and gs.item() == min(x.item() for x in own)


# --- weights: quantize, pack, dequantize against the compressors -------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_nvfp4_weight_bytes_and_dequant_match_the_compressor(dtype):
    w = weights(dtype)
    codes, s, gs = fp4.nvfp4_quantize(w)
    sch = scheme("NVFP4A16")
    comp = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": s.to(dtype), "weight_global_scale": gs}, sch)
    assert torch.equal(comp["weight_packed"], pack_fp4(codes))
    assert torch.equal(comp["weight_scale"].view(torch.uint8), s.view(torch.uint8))
    dec = NVFP4PackedCompressor.decompress(comp, sch)["weight"]  # bfloat16
    ours = dequantize_codes(unpack_fp4(comp["weight_packed"]), effective_scale(comp["weight_scale"], gs), dec.dtype)
    assert torch.equal(ours, dec)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_mxfp4_weight_bytes_and_dequant_match_the_compressor(dtype):
    w = weights(dtype)
    codes, u = fp4.mxfp4_quantize(w)
    assert u.dtype == torch.uint8 and u.shape == (12, 4)
    sch = scheme("MXFP4A16")
    grouped = w.unflatten(-1, (-1, 32))
    s_ref, _ = calculate_qparams(grouped.amin(-1), grouped.amax(-1), sch.weights)
    assert torch.equal(effective_scale(u), s_ref.float())
    comp = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": s_ref}, sch)
    assert torch.equal(comp["weight_packed"], pack_fp4(codes))
    assert torch.equal(comp["weight_scale"], u)
    dec = MXFP4PackedCompressor.decompress(comp, sch)["weight"]
    assert torch.equal(dequantize_codes(codes, effective_scale(u), dec.dtype), dec)


def test_mxfp4_exponent_rule():
    amax = [
        0.0,
        1.0,
        1.5,
        1.7499999,
        1.75,
        1.9999999,
        6.0,
        7.0,
        2.0**-126,
        2.0**-130,
        3.0e-39,
        448.0,
        1.0e30,
        2.0**-120 * 1.8,
    ]
    g = torch.Generator().manual_seed(5)
    amax += (
        torch.rand(500, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-8, 8, (500,), generator=g)
    ).tolist()
    a = torch.tensor(amax, dtype=torch.float32)
    ref = torch.tensor([mx_exponent(float(v)) for v in a.double()], dtype=torch.uint8)
    assert torch.equal(fp4.mxfp4_group_scales(a), ref)
    assert fp4.mxfp4_group_scales(torch.tensor([6.0])).item() == 127  # 6 -> scale 1, max code 6
    assert fp4.mxfp4_group_scales(torch.tensor([7.0])).item() == 128  # 1.75 * 4 rounds up a binade


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_dequantize_matches_float64(fmt):
    w = weights(torch.float32, N=16, K=256, seed=6)
    if fmt == "nvfp4":
        codes, s, gs = fp4.nvfp4_quantize(w)
        eff = s.double() / gs.double()
        out = dequantize_codes(codes, effective_scale(s, gs))
    else:
        codes, u = fp4.mxfp4_quantize(w)
        eff = torch.tensor([[math.ldexp(1.0, int(e) - 127) for e in row] for row in u], dtype=torch.float64)
        out = dequantize_codes(codes, effective_scale(u))
    g = 16 if fmt == "nvfp4" else 32
    ref = decode_e2m1(codes, torch.float64) * eff.repeat_interleave(g, dim=1)
    assert ref.abs().max() > 0
    # NVFP4: s / gs and the product are each rounded to float32 (2 half-ulps); MXFP4 is exact
    tol = 2 * 2.0**-24 if fmt == "nvfp4" else 0.0
    assert ((out.double() - ref).abs() <= tol * ref.abs()).all()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_rtn_picks_the_nearest_representable_value(fmt):
    w = weights(torch.float32, N=16, K=256, seed=7)
    g = 16 if fmt == "nvfp4" else 32
    if fmt == "nvfp4":
        codes, s, gs = fp4.nvfp4_quantize(w)
        eff = (s.double() / gs.double()).repeat_interleave(g, dim=1)
    else:
        codes, u = fp4.mxfp4_quantize(w)
        eff = effective_scale(u).double().repeat_interleave(g, dim=1)
    assert torch.equal(decode_e2m1(codes, torch.float64), nearest_e2m1((w.double() / eff).clamp(-6, 6)))


def test_k_not_a_multiple_of_the_group_is_refused():
    with pytest.raises(ValueError, match="multiple of the group size 16"):
        fp4.nvfp4_quantize(torch.randn(4, 40))
    with pytest.raises(ValueError, match="multiple of the group size 32"):
        fp4.mxfp4_fake_quantize_input(torch.randn(2, 48))
    with pytest.raises(ValueError, match="unknown FP4 format"):
        fp4.fake_quantize_weight(torch.randn(4, 32), "fp4")


# --- the solvers' hooks -----------------------------------------------------------------


def test_gptq_column_quantizer_and_static_act_order():
    w = weights(torch.float32, N=16, K=128, seed=8)
    codes, s, gs = fp4.nvfp4_quantize(w)
    eff = effective_scale(s, gs)  # (N, G)
    per_col = fp4.expand_scales(eff, 16)  # (N, K)
    dense = dequantize_codes(codes, effective_scale(s, gs))
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(9))  # act-order visit order
    cols = torch.empty_like(w)
    for k in perm.tolist():  # column by column, each with its own group's fixed scale
        cols[:, k] = fp4.fake_quantize(w[:, k], per_col[:, k])
    assert torch.equal(cols, dense)
    # a solver's dequantized output maps back to the same codes, but for -0 (code 8), which
    # reads back as +0 (code 0), as compressed-tensors' compressor packs it too
    again = fp4.quantize_codes(dense, eff)
    assert torch.equal(decode_e2m1(again), decode_e2m1(codes))
    assert torch.equal(again[again != codes], torch.zeros_like(again[again != codes]))
    assert (codes == 8).any()


@pytest.mark.parametrize("fmt,preset", [("nvfp4", "NVFP4A16"), ("mxfp4", "MXFP4A16")])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_awq_fake_quantize_matches_compressed_tensors(fmt, preset, dtype):
    w = weights(dtype, seed=10)
    g = 16 if fmt == "nvfp4" else 32
    args = scheme(preset).weights
    grouped = w.unflatten(-1, (-1, g))
    gs = generate_gparam(w.amin().reshape(1), w.amax().reshape(1)) if fmt == "nvfp4" else None
    s, _ = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args, global_scale=gs)
    ref = ct_fake_quantize(w, s.to(dtype), None, args, global_scale=gs)
    got = fp4.fake_quantize_weight(w, fmt)
    assert got.dtype == dtype
    assert torch.equal(got, ref)


def test_awq_fake_quantize_uses_the_fused_global_scale():
    a, b = weights(torch.float32, seed=11), weights(torch.float32, seed=12) * 4
    gs = fp4.nvfp4_fused_global_scale(a, b)
    got = fp4.fake_quantize_weight(a, "nvfp4", gs)
    codes, s, _ = fp4.nvfp4_quantize(a, gs)
    assert torch.equal(got, dequantize_codes(codes, effective_scale(s, gs)))
    assert not torch.equal(got, fp4.fake_quantize_weight(a, "nvfp4"))


def heavy_tailed(seed: int) -> torch.Tensor:
    """Student-t (3 degrees of freedom) weights `(32, 256)`: z / sqrt(chi2_3 / 3)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(32, 256, generator=g)
    chi2 = torch.randn(3, 32, 256, generator=g).square().sum(0)
    return z / (chi2 / 3).sqrt() * 0.02


def mse_reference(w: torch.Tensor, preset: str, grid=100.0, maxshrink=0.2, norm=2.4, patience=5):
    """llm-compressor's `_grid_search_mse` loop on compressed-tensors' primitives: for each
    shrink factor, `calculate_qparams` on the shrunk range (`scale_dtype` dropped for
    tensor_group, no global scale) and `fake_quantize` per group."""
    args = scheme(preset).weights
    if args.strategy == "tensor_group":
        args = args.model_copy(update={"scale_dtype": None})
    token = args.model_copy(update={"strategy": "token"})
    g = args.group_size
    x = w.float().unflatten(-1, (-1, g)).unsqueeze(0)  # (1, N, G, g)
    mn, mx = x.amin(dim=(0, -1)), x.amax(dim=(0, -1))
    best_err = torch.full_like(mn, torch.finfo(torch.float32).max)
    best = torch.maximum(mn.abs(), mx.abs())
    stale = 0
    for i in range(int(maxshrink * grid)):
        p = 1 - i / grid
        s, z = calculate_qparams(mn * p, mx * p, args, global_scale=None)
        q = ct_fake_quantize(x, s.unsqueeze(-1), z.unsqueeze(-1), token)
        err = torch.sum((q - x).abs().pow(norm), dim=(0, -1))
        improved = err < best_err
        if improved.any():
            best_err[improved] = err[improved]
            best[improved] = torch.maximum((mn * p).abs(), (mx * p).abs())[improved]
            stale = 0
        else:
            stale += 1
            if stale >= patience:
                break
    return best


@pytest.mark.parametrize("fmt,preset", [("nvfp4", "NVFP4A16"), ("mxfp4", "MXFP4A16")])
def test_mse_search_matches_llm_compressors_loop(fmt, preset):
    w = heavy_tailed(13)  # shrinking pays
    w[0, :64] = 0.0
    got = fp4.mse_group_amax(w, fmt)
    ref = mse_reference(w, preset)
    assert torch.equal(got, ref)
    shrunk = (got < fp4.group_amax(w, 16 if fmt == "nvfp4" else 32)).float().mean()
    assert shrunk > (0.1 if fmt == "nvfp4" else 0.01)  # E8M0 scales move only a binade at a time


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_mse_search_never_loses_to_min_max(fmt):
    w = heavy_tailed(14)
    gs = fp4.nvfp4_global_scale(fp4.tensor_amax(w)) if fmt == "nvfp4" else None
    g = 16 if fmt == "nvfp4" else 32
    x = w.unflatten(-1, (-1, g))

    def err(amax):
        eff = fp4.effective_scales(fmt, amax, gs)
        return (fp4.fake_quantize(x, eff.unsqueeze(-1)) - x).abs().pow(2.4).sum(-1)

    best = fp4.mse_group_amax(w, fmt, gs)  # scored with the stored scales
    minmax = err(fp4.group_amax(w, g))
    assert (err(best) <= minmax).all()
    assert err(best).sum() < (0.98 if fmt == "nvfp4" else 0.995) * minmax.sum()


# --- W4A4 activations -------------------------------------------------------------------


def activations(dtype: torch.dtype, seed: int = 15) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(48, 256, generator=g) * 2.0
    x[0, :64] = 0.0  # all-zero groups
    x[1, :32] *= 1e-3
    x[2, 7] = -40.0  # a negative outlier
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_mxfp4_activations_match_compressed_tensors(dtype):
    x = activations(dtype)
    args = scheme("MXFP4").input_activations
    s, z = compute_dynamic_scales_and_zp(x, args, None)
    ref = ct_fake_quantize(x, s, z, args)
    got = fp4.mxfp4_fake_quantize_input(x)
    assert got.dtype == dtype and torch.equal(got, ref)
    assert (got[0, :64] == 0).all()


def test_mxfp4_activations_match_float64_brute_force():
    x = activations(torch.float32)
    xg = x.double().unflatten(-1, (-1, 32))
    u = torch.tensor([[mx_exponent(float(a)) for a in row] for row in xg.abs().amax(-1)])
    scale = torch.tensor([[math.ldexp(1.0, int(e) - 127) for e in row] for row in u], dtype=torch.float64)
    ref = (nearest_e2m1((xg / scale[..., None]).clamp(-6, 6)) * scale[..., None]).flatten(-2)
    assert torch.equal(fp4.mxfp4_fake_quantize_input(x).double(), ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_nvfp4_activations_compressed_tensors_rule(dtype):
    x = activations(dtype)
    gs = fp4.nvfp4_global_scale(fp4.tensor_amax(x))
    args = scheme("NVFP4").input_activations
    s, z = compute_dynamic_scales_and_zp(x, args, None, global_scale=gs)
    ref = ct_fake_quantize(x, s, z, args, global_scale=gs)
    got = fp4.nvfp4_fake_quantize_input(x, gs, rule="compressed-tensors")
    assert got.dtype == dtype and torch.equal(got, ref)


def test_nvfp4_activation_rules_differ_only_in_last_bits_in_float32():
    """compressed-tensors divides by 6 and by s / gs where vLLM multiplies by 1/6 and
    1 / (s * (1/gs)): in float32 the same value but for rare last-bit differences, each
    moving one element by at most one grid step of its group."""
    x = activations(torch.float32)
    gs = fp4.nvfp4_global_scale(fp4.tensor_amax(x))
    ct = fp4.nvfp4_fake_quantize_input(x, gs, rule="compressed-tensors")
    vllm = fp4.nvfp4_fake_quantize_input(x, gs)
    assert (ct != vllm).float().mean() <= 1e-3
    s = fp4.nvfp4_group_scales(fp4.group_amax(x, 16), gs).float()
    step = 2 * s.repeat_interleave(16, dim=-1) / gs  # the widest grid step (4 -> 6) times s / gs
    assert ((ct - vllm).abs() <= step).all()
    with pytest.raises(ValueError, match="unknown rule"):
        fp4.nvfp4_fake_quantize_input(x, gs, rule="torch")


def test_nvfp4_activations_match_float64_where_no_rounding_is_near():
    x = activations(torch.float32)
    gs = fp4.nvfp4_global_scale(fp4.tensor_amax(x))
    xg = x.double().unflatten(-1, (-1, 16))
    s = nearest_e4m3(gs.double() * xg.abs().amax(-1) / 6)[..., None]
    ref = (nearest_e2m1((xg * gs.double() / s).clamp(-6, 6)) * s / gs.double()).flatten(-2)
    ref = torch.where(s.expand_as(xg).flatten(-2) == 0, 0.0, ref)
    got = fp4.nvfp4_fake_quantize_input(x, gs).double()
    assert (got[0, :64] == 0).all()
    rel = (got - ref).abs() / ref.abs().clamp(min=1e-30)
    assert (rel[ref != 0] < 1e-6).float().mean() > 0.999  # float32 vs exact scale products


@pytest.mark.vllm
def test_nvfp4_activation_and_weight_dequant_match_vllm(tmp_path):
    """vLLM's own functions run in .venv-vllm (tests/vllm_fp4_worker.py): activation
    quantize-dequantize bit-exact; weight dequantization within one bfloat16 ulp (vLLM
    multiplies by 1/gs, compressed-tensors and we divide by gs), and rarely off at all."""
    import vllm_formats
    from safetensors.torch import load_file, save_file

    try:
        python = vllm_formats.vllm_python()
    except vllm_formats.VllmEnvMissing as exc:
        pytest.fail(str(exc))
    inputs = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        x = activations(dtype)
        inputs[f"x.{name}"] = x
        inputs[f"igs.{name}"] = fp4.nvfp4_global_scale(fp4.tensor_amax(x))
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(16)) * 0.03
    codes, s, gs = fp4.nvfp4_quantize(w)
    inputs.update({"packed.w": pack_fp4(codes), "scale.w": s, "gs.w": gs})
    src, dst = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(inputs, str(src))
    worker = Path(__file__).with_name("vllm_fp4_worker.py")
    r = subprocess.run(
        [str(python), str(worker), str(src), str(dst)], capture_output=True, text=True, timeout=300, check=False
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = load_file(str(dst))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        ours = fp4.nvfp4_fake_quantize_input(inputs[f"x.{name}"], inputs[f"igs.{name}"])
        assert torch.equal(ours, out[f"qdq.{name}"]), name
    theirs = out["w.w"]
    ours = dequantize_codes(codes, effective_scale(s, gs), torch.bfloat16)
    ulp = torch.finfo(torch.bfloat16).eps * ours.float().abs()
    assert ((ours.float() - theirs.float()).abs() <= ulp).all()
    assert (ours != theirs).float().mean() < 1e-3
