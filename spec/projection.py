"""Projection of speculative-decoding speedups to serving: one GPU type at several batch
sizes (concurrencies), from the acceptance a profile measured and roofline round costs.

Acceptance (α, and the acceptance along each continuation) is a property of the pair and
the text, not of the hardware; what a round costs is not. At batch B a verify pass runs
B x (k + 1) tokens: nearly the cost of a plain step while the pass is memory-bound (the
weights are read once for all of them), k + 1 steps once it is compute-bound. So the
best k falls as the concurrency grows, and a draft that pays at batch 1 can lose at 128.

Per concurrency and draft, the pass times of `roofline.batch_times` become a
`costs.RooflineCosts` for `predict`: `sequence_prediction` over each prompt's
acceptance windows (the projected speedup, and the best k by it) and `alpha_prediction`
(α alone).

Nothing here is measured. `ProjectionRequest.inputs` states what the figures rest on:
the GPU's datasheet peaks, the efficiencies, the dtypes, the models' shapes, the context.

What this module does not know: models, the roofline, or where acceptance comes from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from infer_tool.spec.costs import RooflineCosts
from infer_tool.spec.predict import alpha_prediction, sequence_prediction
from infer_tool.spec.ranking import best


class PassTimes(Protocol):
    """Seconds of a round's passes at one concurrency B (`roofline.BatchTimes`)."""

    concurrency: int
    step_s: float  # target pass over B x 1 tokens
    bound: str
    pass_s: dict[int, float]  # m -> target pass over B x (m + 1) tokens, m = 0..max k
    pass_bound: dict[int, str]
    draft_s: tuple[tuple[float, float], ...]  # per draft: passes over B x 1 and B x 2 tokens
    memory_bytes: tuple[int, ...]  # per draft: target + draft weights and KV caches
    usable_bytes: int


@dataclass(frozen=True)
class ProjectionRequest:
    """Pass times per concurrency (one entry per draft of the profile, in order) and what
    they rest on (`inputs`, reported as is; `inputs["gpu"]` names the GPU)."""

    batches: tuple[PassTimes, ...]  # per concurrency
    inputs: dict[str, Any]


@dataclass
class ProjectedK:
    k: int
    verify_cost: float  # v(k): target pass over B x (k + 1) tokens / a B x 1 step
    draft_cost: float  # per round, catch-up at rate α^k, in target steps
    cost_ratio: float  # draft_cost / k
    predicted_speedup: float  # from the acceptance along each continuation
    alpha_speedup: float  # from α alone, under independence
    measured_speedup: None = None  # nothing is measured (keeps `ranking.best`'s contract)


@dataclass
class ProjectedRow:
    """One draft at one concurrency."""

    concurrency: int
    draft_step_ms: float  # the draft's pass over B x 1 tokens (0: a free draft)
    per_k: list[ProjectedK]
    best_k: int
    speedup: float  # projected, at best_k
    slower_than_plain: bool  # at every k
    memory_bytes: int  # target + draft weights and KV caches at this concurrency
    fits: bool  # within the GPU's usable memory


@dataclass
class TargetRow:
    """The target's side at one concurrency."""

    concurrency: int
    step_ms: float  # plain decode step of the batch
    bound: str  # what bounds that step: "memory" or "compute"
    verify_costs: dict[int, float]  # v(k) at the profile's ks
    verify_bound: dict[int, str]  # what bounds the pass over B x (k + 1) tokens


@dataclass
class DraftProjection:
    name: str
    alpha: float
    rows: list[ProjectedRow]


@dataclass
class Projection:
    inputs: dict[str, Any]
    target: list[TargetRow]
    drafts: list[DraftProjection]
    notes: list[str] = field(default_factory=list)


def _speedup(windows: list[list[list[float]]], k: int, costs: RooflineCosts) -> float:
    preds = [sequence_prediction(w, k, costs) for w in windows]
    return sum(e.tokens for e in preds) / sum(e.cost for e in preds)


def project(
    req: ProjectionRequest,
    names: list[str],
    alphas: list[float],
    round_acceptance: list[dict[int, list[list[list[float]]]]],
    ks: list[int],
) -> Projection:
    """Per draft j (name, α, acceptance windows per k per prompt, as in
    `DraftProfile.round_acceptance`) and per concurrency: each k's projected speedup."""
    assert len(names) == len(alphas) == len(round_acceptance)
    targets: list[TargetRow] = []
    drafts = [DraftProjection(n, a, []) for n, a in zip(names, alphas)]
    notes: list[str] = []
    for t in req.batches:
        B, step = t.concurrency, t.step_s
        assert len(t.draft_s) == len(names) and max(ks) <= max(t.pass_s)
        targets.append(
            TargetRow(B, 1e3 * step, t.bound, {k: t.pass_s[k] / step for k in ks}, {k: t.pass_bound[k] for k in ks})
        )
        for j, ((one, two), need) in enumerate(zip(t.draft_s, t.memory_bytes)):
            costs = RooflineCosts(step, t.pass_s, one, two)
            per_k = []
            for k in ks:
                a = alpha_prediction(alphas[j], k, costs)
                per_k.append(
                    ProjectedK(
                        k,
                        a.verify_cost,
                        a.draft_cost,
                        a.draft_cost / k,
                        _speedup(round_acceptance[j][k], k, costs),
                        a.speedup,
                    )
                )
            top = best(per_k, "predicted")
            drafts[j].rows.append(
                ProjectedRow(
                    B,
                    1e3 * one,
                    per_k,
                    top.k,
                    top.predicted_speedup,
                    all(r.predicted_speedup < 1.0 for r in per_k),
                    need,
                    need <= t.usable_bytes,
                )
            )
            if need > t.usable_bytes:
                notes.append(
                    f"{names[j]} at concurrency {B}: target + draft need {need / 2**30:.1f} GiB of weights and KV "
                    f"cache, more than the {t.usable_bytes / 2**30:.1f} GiB usable on {req.inputs['gpu']}; "
                    "projected as if it fit"
                )
    return Projection(req.inputs, targets, drafts, notes)
