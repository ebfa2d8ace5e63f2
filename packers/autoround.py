"""AutoRound / SignRound's weight quantizer (Cheng et al. 2023, "Optimize Weight Rounding via
Signed Gradient Descent for the Quantization of LLMs", §3): learned rounding offsets V and
clip factors α, β on this project's INT grid, differentiable through straight-through
rounding (the descent itself lives in `calib/quantizers/autoround.py`), and the final
rounding to a `QuantizedWeight`.

Per group of g consecutive input columns of W (N, K), with w_min = min(W_group, 0) and
w_max = max(W_group, 0) of the fp weight (fixed), and ⌊·⌉ rounding to nearest (its gradient
taken as 1, the straight-through estimator):
- asymmetric: s = (β·w_max − α·w_min) / (2^b − 1), z = ⌊−α·w_min / s⌉,
  q = clamp(⌊W/s + V⌉ + z, 0, 2^b − 1), Ŵ = s·(q − z);
- symmetric: s = max(−α·w_min, β·w_max) / (2^(b−1) − 1), z = 2^(b−1), same q and Ŵ;
- symmetric, full range (`full_range`, auto-round's own `int_sym` grid):
  s = ±max(−α·w_min, β·w_max) / 2^(b−1), negative when β·w_max ≥ −α·w_min, so that the
  larger side reaches the level −2^(b−1) (all 2^b levels, negative scales where it is the
  positive side).
s is rounded to the checkpoint's scale dtype (straight through) and a zero scale is 1, as in
`packers/rtn.qparams`: at V = 0, α = β = 1 this is exactly RTN on the same grid.

Shapes: W, V (N, K); α, β (N, G) with G = K / g. This module knows no model and no file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer_tool.packers.int_weight import QuantizedWeight
from infer_tool.packers.rtn import _storable, full_range_scale
from infer_tool.schemes.integer import QuantScheme

V_BOUND = 0.5  # |V| <= 0.5: a weight moves at most to the neighbouring level (the paper's range)


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """⌊x⌉ forward, identity backward."""
    return x + (torch.round(x) - x).detach()


@dataclass
class Rounding:
    """One linear's learned parameters: V (N, K), alpha, beta (N, G), float32."""

    V: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor

    @classmethod
    def initial(cls, shape: tuple[int, int], group_size: int, device: torch.device | str = "cpu") -> Rounding:
        """V = 0, α = β = 1 (RTN), each a leaf that requires grad."""
        n, k = shape
        groups = k // group_size
        V = torch.zeros(n, k, device=device, requires_grad=True)
        return cls(
            V,
            torch.ones(n, groups, device=device, requires_grad=True),
            torch.ones(n, groups, device=device, requires_grad=True),
        )

    def tensors(self) -> list[torch.Tensor]:
        return [self.V, self.alpha, self.beta]

    @torch.no_grad()
    def project(self) -> None:
        """Clamp in place to the ranges: V to [−0.5, 0.5], α and β to [0, 1] (auto-round clamps
        α, β the same way before each use)."""
        self.V.clamp_(-V_BOUND, V_BOUND)
        self.alpha.clamp_(0.0, 1.0)
        self.beta.clamp_(0.0, 1.0)

    def detached(self) -> Rounding:
        """A copy that needs no grad (the best iterate kept aside)."""
        return Rounding(*(t.detach().clone() for t in self.tensors()))


@dataclass
class Grouped:
    """W (N, K) as groups, and what the grid reads of them that does not change while tuning."""

    w: torch.Tensor  # (N, G, g) float32
    lo: torch.Tensor  # (N, G): min(W_group, 0)
    hi: torch.Tensor  # (N, G): max(W_group, 0)

    @classmethod
    def of(cls, W: torch.Tensor, scheme: QuantScheme) -> Grouped:
        n, k = W.shape
        g = scheme.group_for(k)
        w = W.detach().float().reshape(n, k // g, g)
        return cls(w, w.amin(dim=-1).clamp(max=0.0), w.amax(dim=-1).clamp(min=0.0))

    @property
    def shape(self) -> tuple[int, int]:
        n, groups, g = self.w.shape
        return n, groups * g


def _grid(W: Grouped, p: Rounding, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q (N, G, g), s (N, G, 1), z (N, G, 1)), differentiable in p (module docstring)."""
    w, lo, hi = W.w, W.lo, W.hi
    maxq = (1 << scheme.bits) - 1
    if scheme.symmetric and scheme.full_range:
        s = full_range_scale(-lo * p.alpha, hi * p.beta, scheme.bits)
    elif scheme.symmetric:
        s = torch.maximum(-lo * p.alpha, hi * p.beta) / ((1 << (scheme.bits - 1)) - 1)
    else:
        s = (hi * p.beta - lo * p.alpha) / maxq
    s = s + (_storable(s.detach(), scheme.torch_scale_dtype) - s.detach())  # the stored scale, straight through
    s = torch.where(s != 0, s, torch.ones_like(s))
    if scheme.symmetric:
        z = torch.full_like(s, float(1 << (scheme.bits - 1)))
    else:
        z = torch.clamp(round_ste(-lo * p.alpha / s), 0, maxq)
    s, z = s.unsqueeze(-1), z.unsqueeze(-1)
    q = torch.clamp(round_ste(w / s + p.V.view_as(w)) + z, 0, maxq)
    return q, s, z


def fake_quantize_rounding(W: Grouped, p: Rounding, scheme: QuantScheme) -> torch.Tensor:
    """Ŵ (N, K) float32 from the grouped weight and the learned parameters, differentiable in them."""
    q, s, z = _grid(W, p, scheme)
    return ((q - z) * s).reshape(W.shape)


@torch.no_grad()
def quantize_rounding(W: torch.Tensor, p: Rounding, scheme: QuantScheme) -> QuantizedWeight:
    """The codes, scales and zero points of W (N, K) with the learned parameters: what
    `fake_quantize_rounding` evaluates, as the canonical `QuantizedWeight` (contiguous groups)."""
    n, k = W.shape
    q, s, z = _grid(Grouped.of(W, scheme), p, scheme)
    return QuantizedWeight(
        q=q.reshape(n, k).to(torch.uint8),
        scale=s.squeeze(-1).contiguous(),
        zero=None if scheme.symmetric else z.squeeze(-1).to(torch.uint8),
        g_idx=None,
        bits=scheme.bits,
        group_size=scheme.group_for(k),
        info={"method": "autoround"},
    )
