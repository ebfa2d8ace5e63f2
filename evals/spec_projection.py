"""Projection of speculative-decoding speedups to serving: one GPU type at several batch
sizes (concurrencies), from the acceptance a profile measured and roofline round costs.

Acceptance (α, and the acceptance along each continuation) is a property of the pair and
the text, not of the hardware; what a round costs is not. At batch B a verify pass runs
B x (k + 1) tokens: nearly the cost of a plain step while the pass is memory-bound (the
weights are read once for all of them), k + 1 steps once it is compute-bound. So the
best k falls as the concurrency grows, and a draft that pays at batch 1 can lose at 128.

Per concurrency B and draft, `spec_costs.RooflineCosts` from `sizing.spec_roofline`'s
pass times go to `spec_predict`: `sequence_prediction` over each prompt's acceptance
windows (the projected speedup, and the best k by it) and `alpha_prediction` (α alone).

Nothing here is measured. `Projection.inputs` states what the figures rest on: the GPU's
datasheet peaks, the efficiencies, the dtypes, the models' shapes and the context.

What this module does not know: models, timing, or where acceptance comes from.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from infer_tool.evals.spec_costs import RooflineCosts
from infer_tool.evals.spec_predict import alpha_prediction, sequence_prediction
from infer_tool.evals.spec_ranking import best
from infer_tool.sizing.defaults import DEFAULT_MEM_UTIL, DEFAULT_RESERVE_BYTES
from infer_tool.sizing.spec_roofline import ServedModel, Serving, memory_needed, pass_times

ASSUMPTIONS = (
    "one GPU per model pair (no tensor or pipeline parallelism), draft and target on it",
    "every sequence of the batch drafts the same number of tokens (a homogeneous batch)",
    "a model draft runs its k steps at the same batch; prompt lookup costs nothing on the GPU",
    "decode phase only (no prefill, no prefill interference), no per-step launch or scheduling overhead",
)


@dataclass(frozen=True)
class ProjectionRequest:
    """What to project onto: where the passes run, the concurrencies, the target and, per
    draft of the profile, its served model (None: a free draft, prompt lookup)."""

    serving: Serving
    concurrencies: tuple[int, ...]
    target: ServedModel
    drafts: tuple[ServedModel | None, ...]


@dataclass
class ProjectedK:
    k: int
    verify_cost: float  # v(k): target pass over B x (k + 1) tokens / a B x 1 step
    draft_cost: float  # per round, catch-up at rate α^k, in target steps
    cost_ratio: float  # draft_cost / k
    predicted_speedup: float  # from the acceptance along each continuation
    alpha_speedup: float  # from α alone, under independence
    measured_speedup: None = None  # nothing is measured (keeps `spec_ranking.best`'s contract)


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
    fits: bool  # within the GPU's memory x DEFAULT_MEM_UTIL less DEFAULT_RESERVE_BYTES


@dataclass
class TargetRow:
    """The target's side at one concurrency."""

    concurrency: int
    step_ms: float  # plain decode step of the batch
    bound: str  # what bounds that step: "memory" or "compute"
    verify_costs: dict[int, float]  # v(m) at the profile's ks
    verify_bound: dict[int, str]  # what bounds the pass over B x (m + 1) tokens


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


def _model_inputs(m: ServedModel) -> dict[str, Any]:
    s = m.shape
    assert s.params is not None
    return {
        "weights": m.weights, "group_size": m.group_size if m.weights == "int4" else None,
        "weight_bytes": m.weight_bytes, "shares_target_weights": m.shares_weights,
        "layers": s.num_layers, "hidden_size": s.hidden_size, "attention_heads": s.num_attention_heads,
        "kv_heads": s.layers[0].kv_heads if s.layers else 0, "params": s.params.total,
        "active_params": s.params.active, "source": s.source,
    }


def inputs_of(req: ProjectionRequest, names: list[str]) -> dict[str, Any]:
    """What the projection rests on, for the report."""
    sv, gpu = req.serving, req.serving.gpu
    models = [{"name": req.target.shape.name, "role": "target", **_model_inputs(req.target)}]
    for name, d in zip(names, req.drafts):
        models.append({"name": name, "role": "draft", **({"free": True} if d is None else _model_inputs(d))})
    return {
        "gpu": gpu.key, "gpu_name": gpu.name, "hbm_bytes_per_s": gpu.hbm_bytes_per_s,
        "bf16_flops": gpu.bf16_flops, "fp8_flops": gpu.fp8_flops, "gpu_memory_bytes": gpu.memory_bytes,
        "gpu_source": gpu.spec_source, "efficiency": asdict(sv.eff), "kv_dtype": sv.kv,
        "prompt_len": sv.prompt_len, "output_len": sv.output_len, "mean_context": sv.context,
        "concurrencies": list(req.concurrencies), "models": models, "assumptions": list(ASSUMPTIONS),
    }


def project(
    req: ProjectionRequest, names: list[str], alphas: list[float],
    round_acceptance: list[dict[int, list[list[list[float]]]]], ks: list[int],
) -> Projection:
    """Per draft j (name, α, acceptance windows per k per prompt, as in
    `DraftProfile.round_acceptance`) and per concurrency: each k's projected speedup."""
    sv = req.serving
    usable = sv.gpu.memory_bytes * DEFAULT_MEM_UTIL - DEFAULT_RESERVE_BYTES
    ms = range(max(ks) + 1)  # a round may draft fewer than k (prompt lookup, the last rounds)
    targets: list[TargetRow] = []
    drafts = [DraftProjection(n, a, []) for n, a in zip(names, alphas)]
    notes: list[str] = []
    for B in req.concurrencies:
        step, bound = pass_times(req.target, sv, B, 1)
        passes = {m: pass_times(req.target, sv, B, m + 1) for m in ms}
        pass_s = {m: s for m, (s, _) in passes.items()}
        targets.append(TargetRow(B, 1e3 * step, bound, {k: pass_s[k] / step for k in ks},
                                 {k: passes[k][1] for k in ks}))
        for j, d in enumerate(req.drafts):
            one = two = 0.0
            if d is not None:
                one, two = pass_times(d, sv, B, 1)[0], pass_times(d, sv, B, 2)[0]
            costs = RooflineCosts(step, pass_s, one, two)
            per_k = []
            for k in ks:
                preds = [sequence_prediction(w, k, costs) for w in round_acceptance[j][k]]
                a = alpha_prediction(alphas[j], k, costs)
                per_k.append(ProjectedK(
                    k, a.verify_cost, a.draft_cost, a.draft_cost / k,
                    sum(e.tokens for e in preds) / sum(e.cost for e in preds), a.speedup,
                ))
            top = best(per_k, "predicted")
            need = memory_needed([req.target] + ([d] if d is not None else []), sv, B)
            drafts[j].rows.append(ProjectedRow(
                B, 1e3 * one, per_k, top.k, top.predicted_speedup,
                all(r.predicted_speedup < 1.0 for r in per_k), need, need <= usable,
            ))
            if need > usable:
                notes.append(
                    f"{names[j]} at concurrency {B}: target + draft need {need / 2**30:.1f} GiB of weights and KV "
                    f"cache, more than the {usable / 2**30:.1f} GiB usable on {sv.gpu.key}; projected as if it fit"
                )
    return Projection(inputs_of(req, names), targets, drafts, notes)
