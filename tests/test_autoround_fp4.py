"""AutoRound on the FP4 grid (`packers/autoround_fp4.py`): the starting point is FP4 RTN bit for
bit, the straight-through gradients are the chain rule written out, and the rounding written
to the checkpoint is the one the descent evaluated. The pipeline end to end (checkpoints read
by transformers + compressed-tensors, fused global scales, W4A4 input scales, the block losses):
tests/test_fp4_quantize.py."""

from __future__ import annotations

import pytest
import torch

from infer_tool.packers import fp4
from infer_tool.packers.autoround import Rounding
from infer_tool.packers.autoround_fp4 import Fp4Grouped, fake_quantize_rounding_fp4, quantize_rounding_fp4
from infer_tool.packers.fp4_solve import quantize_fp4_rtn
from infer_tool.schemes.fp4 import Fp4AutoRoundScheme, Fp4RTNScheme


def weight(n: int = 12, k: int = 64, seed: int = 0) -> torch.Tensor:
    W = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    W[2, :32] = 0.0  # all-zero groups (NVFP4 stores 0.125, MXFP4 the smallest exponent)
    W[5, 7] = 9.0  # an outlier that sets its group's scale
    return W


def learned(
    fmt: str, n: int, seed: int, beta: tuple[float, float]
) -> tuple[torch.Tensor, Fp4AutoRoundScheme, Fp4Grouped, Rounding]:
    """W (n, 64), the scheme, its groups, and parameters as a descent leaves them: V uniform in
    [−0.5, 0.5], β uniform in `beta`."""
    W = weight(n, 64, seed=seed)
    scheme = Fp4AutoRoundScheme(fp4=fmt)
    p = Rounding.initial(W.shape, scheme.group_size)
    with torch.no_grad():
        p.V.uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(seed + 1))
        p.beta.uniform_(*beta, generator=torch.Generator().manual_seed(seed + 2))
    return W, scheme, Fp4Grouped.of(W, scheme), p


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("amax_dtype", ["float32", "bfloat16"])
def test_the_starting_point_is_fp4_rtn_bit_for_bit(fmt: str, amax_dtype: str) -> None:
    """V = 0, β = 1 gives RTN's codes, stored scales and dequantized weights, with a fused global
    scale passed in (NVFP4) as the pipeline passes it."""
    W = weight()
    gs = fp4.nvfp4_fused_global_scale(W, 3 * W) if fmt == "nvfp4" else None  # a shard with a larger max
    scheme = Fp4AutoRoundScheme(fp4=fmt, amax_dtype=amax_dtype)
    G = Fp4Grouped.of(W, scheme, gs)
    p = Rounding.initial(W.shape, scheme.group_size)
    got = quantize_rounding_fp4(G, p, scheme)
    want = quantize_fp4_rtn(W, None, Fp4RTNScheme(fp4=fmt, amax_dtype=amax_dtype), global_scale=gs)
    assert torch.equal(got.codes, want.codes)
    assert torch.equal(got.w_scale.view(torch.uint8), want.w_scale.view(torch.uint8))
    assert (got.global_scale is None) == (fmt == "mxfp4") and (fmt == "mxfp4" or torch.equal(got.global_scale, gs))
    assert torch.equal(fake_quantize_rounding_fp4(G, p, scheme), want.dequantize())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_straight_through_gradients_are_the_chain_rule(fmt: str) -> None:
    """With the roundings' derivatives taken as 1: ∂Ŵ/∂V = s where |W/s + V| < 6 (0 where the
    clamp saturates), and ∂Ŵ/∂β = Σ G·(q − x_in)·a/6 over the group, x_in = W/s + V inside the
    clamp (the clamped value's own term vanishes), s the exact effective scale."""
    W, scheme, G, p = learned(fmt, 8, seed=1, beta=(0.8, 0.8))
    Gr = torch.randn(W.shape, generator=torch.Generator().manual_seed(3))
    (fake_quantize_rounding_fp4(G, p, scheme) * Gr).sum().backward()
    g = scheme.group_size
    a = G.amax.float()  # (N, G)
    s = fp4.effective_scales(fmt, a * 0.8, G.global_scale).unsqueeze(-1)  # (N, G, 1)
    w, V, Gg = W.reshape(8, -1, g), p.V.detach().reshape(8, -1, g), Gr.reshape(8, -1, g)
    x = w / s + V
    inside = (x.abs() < 6).float()
    q = fp4.round_to_e2m1(x.clamp(-6, 6))
    assert torch.allclose(p.V.grad.reshape(8, -1, g), Gg * s * inside, rtol=1e-6, atol=0)
    dW_ds = q - inside * w / s
    want = (Gg * dW_ds).sum(-1) * a / 6
    assert torch.allclose(p.beta.grad, want, rtol=1e-4, atol=1e-5)
    assert p.alpha.grad is None  # E2M1 is symmetric: one clip factor


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_the_written_rounding_is_the_one_evaluated(fmt: str) -> None:
    """At learned (random) V and β the checkpoint's codes and scales dequantize to exactly the
    Ŵ the descent scored, and the scales are those RTN stores for the clipped group maxima."""
    W, scheme, G, p = learned(fmt, 16, seed=4, beta=(0.7, 1.0))
    got = quantize_rounding_fp4(G, p, scheme)
    assert torch.equal(got.dequantize(), fake_quantize_rounding_fp4(G, p, scheme).detach())
    clipped = G.amax * p.beta.detach()
    want = fp4.nvfp4_group_scales(clipped, G.global_scale) if fmt == "nvfp4" else fp4.mxfp4_group_scales(clipped)
    assert torch.equal(got.w_scale.view(torch.uint8), want.view(torch.uint8))
    assert not torch.equal(got.codes, quantize_fp4_rtn(W, None, Fp4RTNScheme(fp4=fmt)).codes)
