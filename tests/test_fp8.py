"""FP8 e4m3 weight quantization numerics (packers/fp8.py).

References: the compressed-tensors package's own FP8 compressor (independent code that
vLLM's checkpoints are written with) for the stored bytes and the dequantization, and the
e4m3 rounding bound |W - W~| <= max(2^-4 |W|, 2^-10 s) derived in packers/fp8.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from infer_tool.common.errors import BadInput
from infer_tool.packers.fp8 import (
    E4M3_MAX,
    Fp8Scheme,
    quantize_fp8_weight,
    search_fp8_clip,
    static_input_scale,
)

SHAPE = (200, 300)  # N, K: neither a multiple of 128 -> partial edge blocks


def _weight(seed: int = 0, shape: tuple[int, int] = SHAPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # heavy-tailed rows with different magnitudes, so the scales differ per row/block
    w = torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g).mul(4).exp()
    w[3, 7] = 40.0  # an outlier
    return w


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_round_trip_within_e4m3_bound(granularity: str) -> None:
    W = _weight()
    f = quantize_fp8_weight(W, Fp8Scheme(granularity=granularity))
    assert f.weight.dtype == torch.float8_e4m3fn and f.weight.shape == SHAPE
    expected_scale_shape = {"tensor": (1,), "channel": (SHAPE[0], 1), "block": (2, 3)}[granularity]
    assert tuple(f.weight_scale.shape) == expected_scale_shape
    s = f.scale_full()
    err = (W - f.dequantize()).abs()
    bound = torch.maximum(W.abs() * 2.0**-4, s * 2.0**-10)
    assert bool((err <= bound * (1 + 1e-6)).all()), float((err / bound).max())
    # the bound is tight enough to matter: some element uses more than half of it
    assert float((err / bound).max()) > 0.5
    # per-group amax is exactly representable: the largest |W| of each group round-trips
    # to within fp32 rounding of s * 448
    assert torch.allclose(f.dequantize().abs().amax(), W.abs().amax(), rtol=1e-6)


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_matches_compressed_tensors_compressor(granularity: str) -> None:
    """Given our scales, compressed-tensors' FP8 compressor stores the same bytes and
    dequantizes to the same weights (bit-exact)."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    W = _weight(1)
    f = quantize_fp8_weight(W, Fp8Scheme(granularity=granularity))
    args = QuantizationArgs(
        num_bits=8,
        type="float",
        strategy=granularity,
        symmetric=True,
        dynamic=False,
        block_structure=[128, 128] if granularity == "block" else None,
    )
    act = QuantizationArgs(num_bits=8, type="float", strategy="token", dynamic=True, symmetric=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=act)
    packed = FloatQuantizationCompressor.compress({"weight": W, "weight_scale": f.weight_scale}, scheme)
    assert torch.equal(packed["weight"].view(torch.uint8), f.weight.view(torch.uint8))
    unpacked = FloatQuantizationCompressor.decompress({"weight": f.weight, "weight_scale": f.weight_scale}, scheme)
    assert torch.equal(unpacked["weight"].float(), f.dequantize())


def test_scale_is_amax_over_448() -> None:
    W = _weight(2)
    f = quantize_fp8_weight(W, Fp8Scheme(granularity="block"))
    # block (1, 2): rows 128..199, columns 256..299
    assert torch.equal(f.weight_scale[1, 2], W[128:, 256:].abs().max() / 448)
    f = quantize_fp8_weight(W, Fp8Scheme(granularity="channel"))
    assert torch.equal(f.weight_scale[:, 0], W.abs().amax(dim=1) / 448)


def test_all_zero_tensor_and_block_give_finite_scale_and_exact_zeros() -> None:
    Z = torch.zeros(130, 260)
    for g in ("tensor", "channel", "block"):
        f = quantize_fp8_weight(Z, Fp8Scheme(granularity=g))
        assert bool(torch.isfinite(f.weight_scale).all()) and bool((f.weight_scale > 0).all())
        assert torch.equal(f.dequantize(), Z)
    W = _weight(3, (256, 256))
    W[:128, 128:] = 0.0  # one all-zero block
    f = quantize_fp8_weight(W, Fp8Scheme(granularity="block"))
    assert float(f.weight_scale[0, 1]) == 1.0
    assert bool(torch.isfinite(f.dequantize()).all())
    assert torch.equal(f.dequantize()[:128, 128:], torch.zeros(128, 128))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_inf_refused_naming_tensor(bad: float) -> None:
    W = _weight(4)
    W[5, 5] = bad
    with pytest.raises(BadInput, match="model.layers.3.mlp.up_proj.weight"):
        quantize_fp8_weight(W, Fp8Scheme(), name="model.layers.3.mlp.up_proj.weight")


def test_saturation_beyond_448_never_nan() -> None:
    W = _weight(5)
    # clip to half the amax: every |W| above amax/2 lands beyond +-448 after scaling
    f = quantize_fp8_weight(W, Fp8Scheme(granularity="tensor"), clip=torch.tensor([0.5]))
    q = f.weight.float()
    assert bool(torch.isfinite(q).all())
    over = W.abs() > W.abs().max() * 0.5 * (1 + 2.0**-4)
    assert int(over.sum()) > 0
    assert torch.equal(q[over].abs(), torch.full_like(q[over], E4M3_MAX))
    assert torch.equal(torch.sign(q[over]), torch.sign(W[over]))
    assert float(f.clip_ratio) == 0.5


def test_scheme_refusals() -> None:
    with pytest.raises(BadInput, match="dynamic"):
        Fp8Scheme(granularity="block", activations="static")
    with pytest.raises(BadInput, match="tensor, channel, block"):
        Fp8Scheme(granularity="group")
    with pytest.raises(BadInput, match="dynamic, static"):
        Fp8Scheme(activations="token")
    assert Fp8Scheme(granularity="tensor", activations="static").needs_activation_stats


def test_static_input_scale() -> None:
    assert torch.equal(static_input_scale(896.0), torch.tensor([2.0]))
    assert float(static_input_scale(0.0)) == 1.0
    with pytest.raises(BadInput):
        static_input_scale(float("inf"))


def test_clip_search_loss_is_output_error_and_finds_cheap_outlier() -> None:
    """The search's loss equals 2 * mean ||dW x||^2 computed from the inputs themselves;
    with huge weight outliers (1e5 x the typical weight) on an input channel that carries
    almost no signal, clipping them wins: unclipped, the typical weights fall into e4m3's
    subnormal range (scaled |x| < 2^-6) and lose precision."""
    g = torch.Generator().manual_seed(6)
    N, K, T = 64, 96, 512
    W = torch.randn(N, K, generator=g) * 1e-3
    W[:, 0] = 100.0 * torch.randn(N, generator=g).sign()  # outliers on a dead-ish input column
    X = torch.randn(T, K, generator=g) @ (torch.eye(K) + 0.3 * torch.randn(K, K, generator=g))
    X[:, 0] *= 1e-7
    H = 2 * X.T @ X / T  # (K, K)
    scheme = Fp8Scheme(granularity="tensor", clip_search=True, clip_min_ratio=0.05, clip_steps=19)
    search = search_fp8_clip(W, H, scheme)
    assert search.ratios.shape == (1,) and search.loss.shape == (20, 1)
    for i in (0, 7, 19):
        dW = W - quantize_fp8_weight(W, scheme, clip=search.grid[i].reshape(1)).dequantize()
        direct = 2 * ((X @ dW.T) ** 2).sum(dim=1).mean()
        assert math.isclose(float(search.loss[i, 0]), float(direct), rel_tol=1e-3)
    assert float(search.ratios[0]) < 1.0
    assert search.loss_chosen < 0.5 * search.loss_unclipped


def test_clip_search_per_channel_groups() -> None:
    W = _weight(7, (40, 64))
    X = torch.randn(256, 64, generator=torch.Generator().manual_seed(7))
    H = 2 * X.T @ X / 256
    for g, groups in (("channel", 40), ("block", 1)):
        search = search_fp8_clip(W, H, Fp8Scheme(granularity=g, clip_search=True))
        assert search.ratios.shape == (groups,)
        f = quantize_fp8_weight(W, Fp8Scheme(granularity=g), clip=search.ratios)
        dW = W - f.dequantize()
        assert math.isclose(float(((dW @ H) * dW).sum()), search.loss_chosen, rel_tol=1e-3)
        assert search.loss_chosen <= search.loss_unclipped
