"""Write a mixed-precision plan as one checkpoint: `quantize MODEL --target-bits B
--candidates ...` / `--max-kld X`, and `quantize-plan ... --out DIR`.

One sensitivity pass and one budget (`jobs/mixed_plan.py`), then every planned linear solved
by its candidate's solver (`calib.mixed_sensitivity.solved`: for RTN the weight a uniform run of
that scheme writes; for GPTQ with the fp model's statistics), written by
`packers/mixed_precision.write_mixed` (one config group per scheme). With `eval`, the written
checkpoint's KL divergence from the source model is measured as `eval kld` measures it
(`jobs/eval_kld.evaluate`, the checkpoint loaded back from disk), and `max_kld_gate` says
whether it held. The report (quantize_report.json in the checkpoint, rewritten once the KL is
measured) lists every linear's scheme, stored bits and predicted KL, and the bits of the whole
model as stored.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from infer_tool.common.errors import BadInput
from infer_tool.common.progress import Progress, no_progress
from infer_tool.jobs.mixed_plan import GPTQ_FIT_NOTE, MixedPlanOptions


@dataclass
class MixedWriteOptions:
    plan: MixedPlanOptions
    out: str
    eval: str | None = None
    eval_tokens: int = 40960
    eval_seq_len: int = 2048
    max_kld_gate: float | None = None  # exit 3 (the CLI) when the measured KL exceeds it


@dataclass
class MixedLinear:
    """One linear of the checkpoint: `group` (the scheme unit it shares a scheme with),
    `candidate` (its name; NONE: unquantized), `bits` stored bits per weight (as written),
    `predicted_kld` the group's predicted KL increase (nats per token; shared by the group's
    linears, counted once in the total)."""

    name: str
    group: str
    candidate: str
    scheme: str
    bits: float
    predicted_kld: float


@dataclass
class KldGate:
    max_kld: float
    kld: float | None
    passed: bool


@dataclass
class MixedQuantizeReport:
    model: str
    out: str
    method: str
    format: str
    scheme: str
    dtype: str
    estimator: str
    budget: str
    candidates: list[dict[str, Any]]
    counts: dict[str, int]
    bits_planned: float  # stored bits per weight of the planned linears, from the written tensors
    bits_plan: float  # the same as the plan computed it (calib/mixed_bits.py) before writing
    bits_model: float  # 8 x every stored tensor's bytes / the model's parameters
    predicted_kld: float
    predicted_bound: float
    measured_kld: float | None
    kld_eval: dict[str, Any] | None
    kld_gate: KldGate | None
    linears: list[MixedLinear]
    calibration_tokens: int
    seconds: dict[str, float]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check(opts: MixedWriteOptions, overwrite: bool) -> None:
    """Every option, and the output directory, before any work."""
    from infer_tool.jobs.mixed_plan import check_options
    from infer_tool.packers.checkpoint import check_checkpoint_out

    check_options(opts.plan)
    if len(opts.plan.target_bits) > 1:
        bits = ",".join(f"{b:g}" for b in opts.plan.target_bits)
        raise BadInput(
            f"--target-bits {bits}: a checkpoint is written for one budget; `infer-tool quantize-plan` prints the "
            "table for several, then write the one you choose"
        )
    if opts.max_kld_gate is not None and opts.eval is None:
        raise BadInput("--max-kld needs --eval CORPUS (the written checkpoint's KL divergence is measured on it)")
    if opts.eval is not None:
        from infer_tool.calib.corpora import check_corpus

        check_corpus(opts.eval, "--eval")
        if opts.eval_tokens < 2 or opts.eval_seq_len < 2:
            raise BadInput(f"--eval-tokens {opts.eval_tokens} / --eval-seq-len {opts.eval_seq_len}: need >= 2")
    check_checkpoint_out(opts.out, overwrite=overwrite)


def _stored_bytes(tensors: Any, name: str) -> int:
    """Bytes of the tensors of linear `name` (its bias left out: stored either way)."""
    return sum(
        t.numel() * t.element_size()
        for k, t in tensors.items()
        if k.rpartition(".")[0] == name and not k.endswith(".bias")
    )


def write_plan(opts: MixedWriteOptions, *, overwrite: bool, progress: Progress | None = None) -> MixedQuantizeReport:
    """Measure, plan one budget, write the checkpoint to `opts.out`, measure its KL (with
    `eval`); the report (also in the checkpoint's quantize_report.json)."""
    import torch

    from infer_tool.calib.layers import weight_nk
    from infer_tool.calib.mixed_sensitivity import solved
    from infer_tool.jobs.mixed_plan import measure, plan_rows
    from infer_tool.packers.checkpoint import REPORT_NAME
    from infer_tool.packers.codecs.mixed_precision import FORMAT_NAME, write_mixed

    progress = progress or no_progress
    check(opts, overwrite)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    m = measure(opts.plan, progress)
    seconds["sensitivity"] = m.seconds
    sens, arch, model = m.sensitivity, m.arch, m.loaded.model
    rows, _ = plan_rows(sens, m.dtype, opts.plan.estimator, opts.plan.target_bits, opts.plan.max_kld)
    row = rows[0]  # the bits budget when one is given, else the KL limit's plan
    by_name = {c.name: c for c in m.candidates}
    costs = sens.costs(opts.plan.estimator)
    t1 = time.perf_counter()
    quantized: dict[str, Any] = {}
    schemes: dict[str, Any] = {}
    plan_cost: dict[str, tuple[str, str, float]] = {}  # linear -> (group, candidate, group's cost)
    for gi, g in enumerate(sens.groups):
        cand = by_name[row.groups[g.name]]
        cost = costs[gi][m.candidates.index(cand)]
        for n in g.linears:
            plan_cost[n] = (g.name, cand.name, float(cost or 0.0))
        if cand.scheme is None:
            continue
        ws = [weight_nk(model.get_submodule(n), arch.conv1d).detach() for n in g.linears]
        for n, w in zip(g.linears, solved(cand, ws, g.linears, m.stats)):
            quantized[n], schemes[n] = w, cand.scheme
        progress("quantizing", gi + 1, len(sens.groups))
    seconds["quantize"] = time.perf_counter() - t1
    dtype_name, cands, has_stats = m.dtype, m.candidates, m.stats is not None
    dtype = getattr(torch, dtype_name)
    params = sum(p.numel() for p in model.parameters())
    planned = sum(g.weights for g in sens.groups)
    shapes = {n: s for g in sens.groups for n, s in zip(g.linears, g.shapes)}
    report_box: list[MixedQuantizeReport] = []

    def report_files(tensors: Any) -> dict[str, str]:
        linears = [
            MixedLinear(
                name=n,
                group=grp,
                candidate=c,
                scheme=by_name[c].describe(),
                bits=8 * _stored_bytes(tensors, n) / (shapes[n][0] * shapes[n][1]),
                predicted_kld=cost,
            )
            for n, (grp, c, cost) in sorted(plan_cost.items())
        ]
        stored = sum(t.numel() * t.element_size() for t in tensors.values())
        report = MixedQuantizeReport(
            model=opts.plan.model,
            out=str(opts.out),
            method=opts.plan.method,
            format=f"compressed-tensors {FORMAT_NAME}",
            scheme="mixed: " + ", ".join(f"{k} x{v}" for k, v in row.counts.items() if v),
            dtype=dtype_name,
            estimator=opts.plan.estimator,
            budget=row.budget,
            candidates=[{"name": c.name, "describe": c.describe()} for c in cands],
            counts=row.counts,
            bits_planned=8 * sum(_stored_bytes(tensors, n) for n in plan_cost) / planned,
            bits_plan=row.bits,
            bits_model=8 * stored / params,
            predicted_kld=row.predicted_kld,
            predicted_bound=row.bound,
            measured_kld=None,
            kld_eval=None,
            kld_gate=None,
            linears=linears,
            calibration_tokens=sens.tokens,
            seconds=seconds,
            notes=[
                f"every candidate solved by {opts.plan.method} (FP8 by its own RTN)"
                + ("; GPTQ's Hessians from the fp model's inputs, not layer by layer" if has_stats else "")
                + f"; predicted KL: {opts.plan.estimator} Fisher estimate on "
                f"{sens.tokens} calibration tokens, summed over groups (jobs/mixed_plan.py)",
                "bits: as stored (codes, scales, zero points, shapes); bits_planned over the planned decoder "
                "linears, bits_model over every parameter of the model (embeddings, norms, lm_head as stored)",
            ]
            + ([GPTQ_FIT_NOTE] if opts.plan.method == "gptq" else []),
        )
        report_box.append(report)
        return {REPORT_NAME: _to_json(report)}

    t1 = time.perf_counter()
    out = write_mixed(
        model,
        quantized,
        schemes,
        opts.out,
        src_dir=m.loaded.path,
        overwrite=overwrite,
        extra_files=report_files,
        dtype=dtype,
    )
    seconds["write"] = time.perf_counter() - t1
    report = report_box[0]
    del model, quantized, m
    if opts.eval is not None:
        t1 = time.perf_counter()
        report.measured_kld, report.kld_eval, notes = _measure_kld(opts, out, progress)
        report.notes += notes
        seconds["kld"] = time.perf_counter() - t1
    if opts.max_kld_gate is not None:
        kld = report.measured_kld
        ok = kld is not None and math.isfinite(kld) and kld <= opts.max_kld_gate
        report.kld_gate = KldGate(opts.max_kld_gate, kld, ok)
    seconds["total"] = time.perf_counter() - t0
    (Path(out) / REPORT_NAME).write_text(_to_json(report))
    return report


def _measure_kld(opts: MixedWriteOptions, out: Path, progress: Progress) -> tuple[float, dict[str, Any], list[str]]:
    """The checkpoint's mean KL divergence from the source model, as `eval kld` measures it."""
    from infer_tool.jobs.eval_kld import KldOptions, evaluate

    p = opts.plan
    kopts = KldOptions(
        model=str(out),
        reference=p.model,
        data=opts.eval or "",
        seq_len=opts.eval_seq_len,
        max_tokens=opts.eval_tokens,
        device=p.device,
        allow_pickle=p.allow_pickle,
        trust_remote_code=p.trust_remote_code,
    )
    rep = evaluate(kopts, progress=progress)
    res = rep.result
    info = {
        "corpus": rep.corpus,
        "tokens": res.tokens,
        "ppl": res.ppl,
        "reference_ppl": res.reference_ppl,
        "seq_len": opts.eval_seq_len,
        "dtype": rep.dtype,
        "backend": rep.backend,
        "protocol": rep.protocol,
    }
    return float(res.kld.mean.mean), info, [f"kld: {n}" for n in rep.notes]


def _to_json(report: MixedQuantizeReport) -> str:
    return json.dumps(report.to_dict(), indent=2) + "\n"
