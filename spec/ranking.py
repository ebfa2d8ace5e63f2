"""Choose k and order drafts: by the measured speedup where the loop ran, else by the
prediction, always saying which (`basis`).

What this module does not know: how speedups were predicted or measured; it reads the
per-k results `profile` assembled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class KFigures(Protocol):
    k: int
    predicted_speedup: float
    measured_speedup: float | None


def speedup_on(r: KFigures, basis: str) -> float:
    value = r.measured_speedup if basis == "measured" else r.predicted_speedup
    assert value is not None, f"no {basis} speedup at k={r.k}"
    return value


def best(per_k: list[Any], basis: str) -> Any:
    """The k result with the highest speedup on `basis` (the smaller k on a tie)."""
    return max(per_k, key=lambda r: (speedup_on(r, basis), -r.k))


@dataclass
class CategoryResult:
    """α and the best k over the prompts of one category (as Spec-Bench reports per task)."""

    category: str
    prompts: int
    alpha: float
    best_k: int
    speedup: float  # at best_k, on the profile's basis
    predicted_speedup: float  # at best_k


def rank(drafts: list[Any], basis: str) -> list[dict[str, object]]:
    """Drafts ordered by their speedup at their best k on `basis`, each with a reason."""

    def top(d: Any) -> Any:
        return next(r for r in d.per_k if r.k == d.best_k)

    ordered = sorted(drafts, key=lambda d: speedup_on(top(d), basis), reverse=True)
    ranking: list[dict[str, object]] = []
    for i, d in enumerate(ordered):
        b = top(d)
        a = d.acceptance.alpha
        s = speedup_on(b, basis)
        reason = f"{basis} {s:.2f}x at k={b.k}"
        if basis == "measured":
            reason += f" (predicted {b.predicted_speedup:.2f}x, error {b.error:+.0%})"
        reason += (
            f": alpha {a:.3f}, {b.predicted_tokens:.2f} tokens per target pass for "
            f"{b.draft_cost:.2f} draft + {b.verify_cost:.2f} verify target steps"
        )
        below = [o for o in ordered[i + 1 :] if o.acceptance.alpha > a]
        above = [o for o in ordered[:i] if o.acceptance.alpha < a]
        if below:
            o = below[0]
            reason += (
                f"; ranks above {o.name} despite lower acceptance ({a:.3f} < {o.acceptance.alpha:.3f}) "
                f"because its drafts are cheaper (c {b.cost_ratio:.3g} vs {top(o).cost_ratio:.3g} per drafted token)"
            )
        if above:
            o = above[0]
            reason += (
                f"; higher acceptance than {o.name} ({a:.3f} > {o.acceptance.alpha:.3f}) but loses to it: "
                f"c {b.cost_ratio:.3g} (vs {top(o).cost_ratio:.3g}) per drafted token makes each round dearer"
            )
        if d.slower_everywhere:
            reason += f"; slower than plain decoding at every k tried ({basis})"
        ranking.append(
            {
                "rank": i + 1,
                "name": d.name,
                "best_k": b.k,
                "basis": basis,
                "speedup": s,
                "predicted_speedup": b.predicted_speedup,
                "measured_speedup": b.measured_speedup,
                "slower_than_plain": d.slower_everywhere,
                "reason": reason,
            }
        )
    return ranking
