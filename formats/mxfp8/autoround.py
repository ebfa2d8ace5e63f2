"""AutoRound's learned rounding on the MXFP8 grid (auto-round's `mx_fp8` tuning, Cheng et al.
2023 §3 on E4M3): the differentiable quantizer the descent in `calib/quantizers/autoround.py`
tunes, and the final rounding to an `Mxfp8Weight`.

Per group of 32 input columns of W (N, K), with a = max |W_group| of the fp weight (fixed), β
the group's clip factor in [0, 1] and V (N, K) the offsets in [−0.5, 0.5]:
    s = 2^(u − 127), u = E8M0(β·a)     the exponent RTN takes for the group maximum β·a
                                       (`numerics.weight_scales`), its gradient that of β·a / 448
                                       (straight through; the descent reads only its sign)
    Ŵ = s · E4M3(clamp(W/s + V, −448, 448))    E4M3 rounding straight through.
V lives in the scaled domain, as auto-round adds it before the element rounding. α, the INT
grid's clip of the negative side, takes no part (E4M3 is symmetric). At V = 0, β = 1 this is
MXFP8 RTN bit for bit (`solve.quantize_rtn`).

Shapes: W, V (N, K); β (N, G), G = K / 32. This module knows no model and no file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer_tool.formats.mxfp8 import numerics
from infer_tool.formats.mxfp8.scheme import Mxfp8Scheme
from infer_tool.formats.mxfp8.weight import Mxfp8Weight
from infer_tool.packers.autoround import Rounding


@dataclass
class Mxfp8Grouped:
    """W (N, K) as MXFP8 groups and the group maxima the grid reads (fixed while tuning)."""

    w: torch.Tensor  # (N, G, 32) float32
    amax: torch.Tensor  # (N, G) float32 max |W_group|

    @classmethod
    def of(cls, W: torch.Tensor) -> Mxfp8Grouped:
        w = numerics.grouped(W.detach().float())
        return cls(w, w.abs().amax(dim=-1))

    @property
    def shape(self) -> tuple[int, int]:
        n, groups, g = self.w.shape
        return n, groups * g


def _grid(W: Mxfp8Grouped, p: Rounding) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x = clamp(W/s + V, ±448) (N, G, 32), s (N, G, 1), u (N, G) uint8), differentiable in V and β."""
    u = numerics.weight_scales(W.amax * p.beta.detach())
    exact = numerics.scale_value(u)
    smooth = W.amax * p.beta / numerics.E4M3_MAX
    s = (exact + (smooth - smooth.detach())).unsqueeze(-1)  # exact forward, smooth's gradient
    x = torch.clamp(W.w / s + p.V.view_as(W.w), -numerics.E4M3_MAX, numerics.E4M3_MAX)
    return x, s, u


def fake_quantize_rounding(W: Mxfp8Grouped, p: Rounding, scheme: Mxfp8Scheme) -> torch.Tensor:
    """Ŵ (N, K) float32 from the grouped weight and the learned parameters, differentiable in them."""
    x, s, _ = _grid(W, p)
    q = numerics.to_e4m3(x.detach()).float() + (x - x.detach())  # exact forward, identity backward
    return (q * s).reshape(W.shape)


@torch.no_grad()
def quantize_rounding(W: Mxfp8Grouped, p: Rounding, scheme: Mxfp8Scheme) -> Mxfp8Weight:
    """The E4M3 values and E8M0 exponents of the learned rounding: what `fake_quantize_rounding`
    evaluates."""
    x, _, u = _grid(W, p)
    return Mxfp8Weight(numerics.to_e4m3(x).flatten(-2), u, scheme.mxfp8_activations, {"method": "autoround"})
