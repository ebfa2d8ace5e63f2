"""The cross-check of our loop against vLLM, printed whenever both engines ran.

Both count per-position acceptance the same way (vLLM's `vllm/v1/spec_decode/metrics.py`):
drafts that accepted at least i tokens / drafts, a draft being a target pass with at least
one proposed token. At temperature 0 on the same prompts both are deterministic: a draft model
proposes its argmax and the target accepts while the argmaxes agree, prompt lookup proposes
the same match (ours follows vLLM's rule when both run: the longest suffix n-gram, its
earliest occurrence), so the two must agree up to the engines' numerics (vLLM's CPU kernels
against torch's: a near-tie of two logits can flip an argmax and the continuation with it).
`TOLERANCE` is the largest absolute difference per position accepted as agreement.

At temperature > 0 the two engines' continuations are different random draws, so only
expectations can agree: ours is the expected per-position acceptance of vLLM's rounds along our
continuations (`sampled_per_position`, the rounds sampled from the teacher-forced acceptance:
p(argmax q) where vLLM drafts a model's argmax, its default `draft_sample_method: greedy`, else
Σ min(p, q), or p(proposal) for a one-hot proposal), vLLM's a count over its drafts; agreement
allows Z binomial standard errors of that count beside `TOLERANCE`.

Where they may differ, the row says why: temperature > 0 (different random streams, the
proposals' acceptance rule); the continuations themselves differing (the share of prompts
whose greedy output is identical in both engines is printed); vLLM's batch size.

What this module does not know: how either engine ran.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from infer_tool.spec.vllm_costs import _accepted

TOLERANCE = 0.02  # absolute, per position
Z = 2.0  # at temperature > 0: standard errors of vLLM's count allowed beside TOLERANCE
SAMPLES = 64  # Monte Carlo runs of each continuation at temperature > 0


@dataclass
class CrossRow:
    draft: str
    k: int
    batch: int  # vLLM's batch size compared (the smallest measured)
    ours: list[float]  # our per-position acceptance (unconditional), positions 1..k (at least)
    vllm: list[float]
    max_diff: float  # how far vLLM's lies outside [ours, ours_max], per position at most
    agree: bool
    reason: str | None  # why they may differ, when they do (or cannot be compared)
    ours_max: list[float] | None = None  # at most: the rounds that ran past the requested tokens accepting all


def per_position_bounds(rounds: list[tuple[int, int, int]], k: int) -> tuple[list[float], list[float]] | None:
    """(at least, at most) per-position acceptance, positions 1..k, from rounds (accepted at
    least, at most, drafted); None without a draft."""
    if not rounds:
        return None
    n = len(rounds)
    return (
        [sum(lo >= i for lo, _, _ in rounds) / n for i in range(1, k + 1)],
        [sum(hi >= i for _, hi, _ in rounds) / n for i in range(1, k + 1)],
    )


def sampled_per_position(
    acceptance: list[list[list[float]]],
    drafted: list[list[int]],
    n_tokens: int,
    k: int,
    samples: int = SAMPLES,
    seed: int = 0,
) -> list[float] | None:
    """Expected per-position acceptance (unconditional, positions 1..k) of vLLM's rounds along
    each continuation when acceptance is random (temperature > 0): from position t (tokens
    generated, the prefill gave the first) a round drafts `drafted[t]` tokens (vLLM's rule: the
    whole proposal), accepted in order with probabilities `acceptance[t]` until the first
    rejection, and moves t on by the accepted tokens + 1, until `n_tokens`; the mean over
    `samples` runs of every continuation. A round that drafts nothing is no draft. None without a draft."""
    rng = random.Random(seed)
    drafts = 0
    at_least = [0] * k
    for _ in range(samples):
        for acc, dr in zip(acceptance, drafted):
            t = 1
            while t < n_tokens:
                d = dr[t] if t < len(dr) else 0
                j = _accepted(acc[t][:d], rng) if d else 0
                if d:
                    drafts += 1
                    for i in range(min(j, k)):
                        at_least[i] += 1
                t += j + 1
    return None if not drafts else [x / drafts for x in at_least]


def identical_share(ours: list[list[int]], vllm: list[list[int]]) -> float | None:
    """Share of prompts whose generated tokens are identical in both engines."""
    if not ours or len(ours) != len(vllm):
        return None
    return sum(a == b for a, b in zip(ours, vllm)) / len(ours)


def cross_check(
    ours: dict[str, dict[int, tuple[list[float], list[float]] | None]],
    vllm: dict[str, dict[int, list[float]]],
    batch: int,
    temperature: float,
    same_text: float | None,
    tolerance: float = TOLERANCE,
    drafts: dict[str, dict[int, int]] | None = None,
) -> list[CrossRow]:
    """Rows per (draft, k) both engines measured: `ours[draft][k]` (at least, at most) and
    `vllm[draft][k]` per-position acceptance; `same_text`: the share of identical greedy
    continuations. At temperature > 0 both are random: ours is an expectation
    (`sampled_per_position`), vLLM's a count over `drafts[draft][k]` drafts, and agreement is
    within `tolerance` or Z binomial standard errors of vLLM's count, whichever is larger."""
    rows = []
    for draft, per_k in ours.items():
        for k, mine in per_k.items():
            theirs = vllm.get(draft, {}).get(k)
            if theirs is None:
                continue
            if mine is None or not theirs:
                rows.append(CrossRow(draft, k, batch, [], theirs, float("nan"), False, "one engine drafted nothing"))
                continue
            lo, hi = mine
            diff = max(max(a - v, v - b, 0.0) for a, b, v in zip(lo, hi, theirs))
            n = (drafts or {}).get(draft, {}).get(k, 0)
            if temperature > 0 and n:
                allowed = [max(tolerance, Z * math.sqrt(v * (1 - v) / n)) for v in theirs]
                agree = all(max(a - v, v - b, 0.0) <= t for a, b, v, t in zip(lo, hi, theirs, allowed))
            else:
                agree = diff <= tolerance
            reason = None
            if not agree:
                why = []
                if temperature > 0:
                    why.append(
                        "temperature > 0: different random streams, and vLLM's default draft_sample_method "
                        "'greedy' accepts the draft's argmax with probability p(argmax q), not our sum min(p, q)"
                    )
                if same_text is not None and same_text < 1.0:
                    why.append(
                        f"only {same_text:.0%} of the prompts got the same greedy continuation in both engines "
                        "(vLLM's CPU kernels and torch round differently; a near-tie flips an argmax)"
                    )
                if batch > 1:
                    why.append(f"vLLM ran at batch size {batch}, ours at 1")
                reason = "; ".join(why) or "unexplained: the same prompts, text and rule gave different acceptance"
            rows.append(CrossRow(draft, k, batch, lo, theirs, diff, agree, reason, None if hi == lo else hi))
    return rows
