"""SmoothQuant (Xiao et al. 2023, §4): per-input-channel smoothing factors that move the
activations' outliers into the weights before both are quantized to INT8.

For one mapping (a smoothing module whose output channels feed the balance linears W_i, all
reading the same input X (T, K)), §4 eq. 4:

    s_j = max|X_j|^α / max|W_j|^(1-α),   j = 1..K

with max|W_j| the largest magnitude of input column j over ALL the balance linears (as
llm-compressor's `SmoothQuantModifier` takes it), α the migration strength. Applying s (a
separate step, `calib/quantizers/awq_fold.fold_scales`) divides X's channels by s (the
smoothing module's output channels) and multiplies the balance weights' columns by s, so
X·Wᵀ is unchanged; afterwards max|X_j / s_j| = max|X_j|^(1-α) · max|W_j|^(1-α) = max|W_j · s_j|
(eq. 4's balance: activations and weights share each channel's range).

Channels where either maximum is zero carry no information: s_j = 1 (leaves them as they are).
Every other s_j is kept in [MIN_SCALE, 1/MIN_SCALE]: llm-compressor's floor (1e-5), mirrored
so that no channel is multiplied by more than its inverse.

This module knows nothing about models, layers or calibration; it takes statistics and
weights as tensors and returns the factors as data.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MIN_SCALE = 1e-5  # llm-compressor's MINIMUM_SMOOTHING_SCALE


def weight_abs_max(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """max over every row of every balance weight (N_i, K) of |W|: (K,) float32."""
    if not weights:
        raise ValueError("smoothquant: no balance weights")
    ks = {int(w.shape[1]) for w in weights}
    if len(ks) != 1 or any(w.dim() != 2 for w in weights):
        raise ValueError(
            f"smoothquant: balance weights must be (N_i, K) with one K, got {[tuple(w.shape) for w in weights]}"
        )
    return torch.stack([w.detach().float().abs().amax(dim=0) for w in weights]).amax(dim=0)


def smoothquant_scales(x_abs_max: torch.Tensor, weights: Sequence[torch.Tensor], alpha: float) -> torch.Tensor:
    """s (K,) float32 from the per-channel activation maxima `x_abs_max` (K,) (max |x_j| over the
    calibration tokens of the balance linears' input) and the balance weights (N_i, K).

    alpha in [0, 1]: 0 leaves the activations alone (s = 1/max|W|), 1 moves all of their range
    into the weights (s = max|X|)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"smoothquant: alpha={alpha} is not in [0, 1]")
    w_max = weight_abs_max(weights)
    x_max = x_abs_max.detach().float().reshape(-1)
    if x_max.shape != w_max.shape:
        raise ValueError(f"smoothquant: {x_max.numel()} activation maxima for weights with K={w_max.numel()}")
    if not bool(torch.isfinite(x_max).all()) or bool((x_max < 0).any()):
        raise ValueError("smoothquant: activation maxima must be finite and non-negative")
    s = x_max.pow(alpha) / w_max.pow(1.0 - alpha)
    s = torch.where((x_max > 0) & (w_max > 0), s, torch.ones_like(s))
    return s.clamp(MIN_SCALE, 1.0 / MIN_SCALE)
