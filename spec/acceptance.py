"""Exact per-token acceptance rates from logits, and the speculative-decoding speedup model.

β_t = Σ_x min(p_t(x), q_t(x)) = 1 − TV(p_t, q_t) is the probability that speculative
sampling accepts the draft's token at position t (Leviathan et al. 2023, Definition 3.1
and Lemma 3.3), p and q being the target's and the draft's next-token distributions
after the same temperature and top-p. α = E[β] is the conditional per-token acceptance
rate; under the independence approximation a round with lookahead k emits on average
(1 − α^(k+1)) / (1 − α) tokens per target pass (eq. 1). What a round costs, and so the
speedup, is `costs` and `predict`'s business.

vLLM reports accepted / drafted tokens instead: E[accepted in a round] / k =
(α − α^(k+1)) / ((1 − α)·k) (`vllm_rate`), e.g. 0.54 at α = 0.8, k = 5.

What this module does not know: models or decoding; it works on probability rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def beta(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Acceptance probabilities (T,) from p, q (T, V). A zero q row gives β = 0 (no
    proposal counts as a rejection)."""
    return torch.minimum(p, q).sum(-1).clamp(0.0, 1.0)


def expected_tokens(alpha: float, k: int) -> float:
    """Mean tokens per target pass with lookahead k: (1 − α^(k+1)) / (1 − α)."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def vllm_rate(alpha: float, k: int) -> float:
    """Expected accepted / drafted: (α − α^(k+1)) / ((1 − α)·k)."""
    return (expected_tokens(alpha, k) - 1.0) / k


@dataclass
class Acceptance:
    """α over all scored positions with its bootstrap interval over prompts."""

    alpha: float
    alpha_ci: tuple[float, float]
    per_position: list[float]  # mean β at continuation position j, over prompts
    per_prompt: list[float]  # mean β of each prompt's continuation
    positions: int  # β values pooled


def bootstrap_ci(betas: list[torch.Tensor], n_boot: int, seed: int, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of the pooled mean β when prompts are resampled with
    replacement (a cluster bootstrap: positions of one prompt are not independent)."""
    sums = torch.tensor([float(b.sum()) for b in betas], dtype=torch.float64)
    counts = torch.tensor([b.numel() for b in betas], dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(betas), (n_boot, len(betas)), generator=g)
    means = sums[idx].sum(1) / counts[idx].sum(1).clamp_min(1)
    lo, hi = torch.quantile(means, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
    return float(lo), float(hi)


def summarize(betas: list[torch.Tensor], n_boot: int, seed: int) -> Acceptance:
    """α, its interval and the per-position / per-prompt breakdowns from per-prompt β (T_i,)."""
    pooled = torch.cat(betas).double()
    longest = max(b.numel() for b in betas)
    per_position = []
    for j in range(longest):
        col = [float(b[j]) for b in betas if b.numel() > j]
        per_position.append(sum(col) / len(col))
    return Acceptance(
        alpha=float(pooled.mean()),
        alpha_ci=bootstrap_ci(betas, n_boot, seed),
        per_position=per_position,
        per_prompt=[float(b.double().mean()) for b in betas],
        positions=pooled.numel(),
    )
