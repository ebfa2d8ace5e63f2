"""The speculative-sampling step (Leviathan et al. 2023, Algorithm 1 and §2.3).

Given the target's next-token distributions `p` at the k drafted positions plus one more,
the draft's distributions `q` at the k positions and the k drafted tokens, accept each
drafted token x with probability min(1, p(x)/q(x)); at the first rejection sample the
replacement from norm(max(0, p - q)); when all k are accepted sample a bonus token from
the target's (k+1)-th distribution. The emitted tokens are distributed exactly as the
target's (Theorem 3.5 of the paper), whatever q is.

This module knows nothing about models, caches or vocabularies: it works on probability
rows. `warp` turns logits into the probabilities both models are compared under
(temperature, then top-p); at temperature 0 it is a one-hot on the argmax, so the step
reduces to greedy "accept while the argmaxes agree".
"""

from __future__ import annotations

import torch


def warp(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Probabilities after temperature and nucleus (top-p) filtering, float32.

    `logits` (..., V) -> (..., V). Temperature 0 means greedy: a one-hot on the argmax
    (ties go to the lowest index, as `argmax` does). Top-p keeps the smallest set of
    most probable tokens whose mass reaches `top_p` (always at least the top one) and
    renormalises it.
    """
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(-1) - sorted_p  # mass of the strictly more probable tokens
    keep_sorted = mass_before < top_p
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    probs = probs * keep
    return probs / probs.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id drawn from `probs` (V,) with the generator (on its device)."""
    if generator is not None:
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) for rows (V,); falls back to p when p <= q everywhere
    (then no rejection can happen, the guard only covers rounding)."""
    r = (p - q).clamp_min(0)
    total = r.sum()
    return r / total if total > 0 else p


def verify(
    p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor, generator: torch.Generator | None
) -> tuple[int, int]:
    """Accept a prefix of the drafted tokens and pick the token that follows it.

    p: (k+1, V) target probabilities at the k drafted positions and the one after;
    q: (k, V) draft probabilities at the k drafted positions (a one-hot row for a
    deterministic draft such as prompt lookup); drafted: (k,) token ids.
    Returns (n, token): the first n drafted tokens are accepted and `token` is emitted
    after them (the resampled replacement if n < k, else the bonus token).
    """
    k = drafted.shape[0]
    for i in range(k):
        x = int(drafted[i])
        px, qx = float(p[i, x]), float(q[i, x])
        u = float(torch.rand((), generator=generator))  # on the generator's device (CPU)
        if qx <= 0 or u >= px / qx:  # rejected (u < min(1, p/q) accepts)
            return i, sample(residual(p[i], q[i]), generator)
    return k, sample(p[k], generator)
