"""AutoRound's learned rounding on the FP4 grid (auto-round's `nv_fp4` / `mx_fp4` tuning, Cheng
et al. 2023 §3 on E2M1): the differentiable quantizer the descent in
`calib/quantizers/autoround.py` tunes, and the final rounding to an `Fp4Weight`.

Per group of g input columns of W (N, K) (16 for NVFP4, 32 for MXFP4), with a = max |W_group|
of the fp weight (fixed, in the scheme's `amax_dtype`), β the group's clip factor in [0, 1] and
V (N, K) the offsets in [−0.5, 0.5]:
    s = S(β·a)                 the effective scale RTN takes for the group maximum β·a
                               (`fp4.effective_scales`: NVFP4 E4M3 relative to the fused global
                               scale, MXFP4 E8M0), its gradient that of β·a / 6 (straight through)
    Ŵ = s · E2M1(clamp(W/s + V, −6, 6))    E2M1 rounding straight through.
V lives in the scaled domain, as auto-round adds it (a step of E2M1 is 0.5 near 0 and 2 at the
top). α, the INT grid's clip of the negative side, takes no part (E2M1 is symmetric). At V = 0,
β = 1 this is FP4 RTN with the min-max observer bit for bit. The global scale (NVFP4) is the
fp weights' and is not tuned, so fused shards keep sharing theirs.

Shapes: W, V (N, K); β (N, G), G = K / g. This module knows no model and no file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer_tool.kernels.fp4_act import round_to_e2m1
from infer_tool.kernels.fp4_layout import E2M1_MAX
from infer_tool.packers import fp4
from infer_tool.packers.autoround import Rounding
from infer_tool.packers.fp4_solve import fp4_global_scale
from infer_tool.packers.fp4_weight import Fp4Weight
from infer_tool.schemes.fp4 import Fp4Scheme


@dataclass
class Fp4Grouped:
    """W (N, K) as FP4 groups and what the grid reads of them that does not change while tuning."""

    w: torch.Tensor  # (N, G, g) float32
    amax: torch.Tensor  # (N, G) max |W_group| in the scheme's amax dtype
    global_scale: torch.Tensor | None  # (1,) float32, NVFP4 only

    @classmethod
    def of(cls, W: torch.Tensor, scheme: Fp4Scheme, global_scale: torch.Tensor | None = None) -> Fp4Grouped:
        """`global_scale`: the fused shards' (NVFP4), default W's own."""
        g = scheme.group_size
        gs = global_scale if global_scale is not None else fp4_global_scale([W], scheme)
        amax = fp4.group_amax(W.detach().to(getattr(torch, scheme.amax_dtype)), g)  # as FP4 RTN's observer
        return cls(W.detach().float().unflatten(-1, (-1, g)), amax, gs)

    @property
    def shape(self) -> tuple[int, int]:
        n, groups, g = self.w.shape
        return n, groups * g


def _clipped_amax(W: Fp4Grouped, p: Rounding) -> torch.Tensor:
    """β·a rounded to the amax dtype (exactly a at β = 1), without grad."""
    return (W.amax.float() * p.beta.detach()).to(W.amax.dtype)


def _grid(W: Fp4Grouped, p: Rounding, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x = clamp(W/s + V, −6, 6) (N, G, g), s (N, G, 1)), differentiable in V and β."""
    exact = fp4.effective_scales(fmt, _clipped_amax(W, p), W.global_scale)
    smooth = W.amax.float() * p.beta / E2M1_MAX
    s = (exact + (smooth - smooth.detach())).unsqueeze(-1)  # exact forward, smooth's gradient
    x = torch.clamp(W.w / s + p.V.view_as(W.w), -E2M1_MAX, E2M1_MAX)
    return x, s


def fake_quantize_rounding_fp4(W: Fp4Grouped, p: Rounding, scheme: Fp4Scheme) -> torch.Tensor:
    """Ŵ (N, K) float32 from the grouped weight and the learned parameters, differentiable in them."""
    x, s = _grid(W, p, scheme.fp4)
    q = round_to_e2m1(x.detach()) + (x - x.detach())  # exact forward, identity backward
    return (q * s).reshape(W.shape)


@torch.no_grad()
def quantize_rounding_fp4(W: Fp4Grouped, p: Rounding, scheme: Fp4Scheme) -> Fp4Weight:
    """The codes and stored scales of the learned rounding: what `fake_quantize_rounding_fp4`
    evaluates, as an `Fp4Weight` (weights only; a W4A4 input scale is set by the caller)."""
    x, _ = _grid(W, p, scheme.fp4)
    amax = _clipped_amax(W, p)
    if scheme.global_scales:
        w_scale = fp4.nvfp4_group_scales(amax, W.global_scale)
    else:
        w_scale = fp4.mxfp4_group_scales(amax)
    return Fp4Weight(
        codes=fp4.e2m1_codes(x).flatten(-2),
        w_scale=w_scale,
        global_scale=None if W.global_scale is None else W.global_scale.to(torch.float32),
        activations=scheme.fp4_activations,
        info={"method": "autoround"},
    )
