"""Output of `spec-profile`: the --json document and the rich tables, from a
`jobs.spec_profile.SpecProfileReport`. Imported only when the command runs."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from rich.table import Table

from infer_tool.cli.output import out
from infer_tool.jobs.spec_profile import SpecProfileReport


def conditional(per_position: list[float]) -> list[float]:
    """Per-position acceptance given the position before was accepted, from the unconditional."""
    at_least = [1.0, *per_position]
    return [at_least[i + 1] / at_least[i] if at_least[i] else 0.0 for i in range(len(per_position))]


def document(report: SpecProfileReport) -> dict[str, Any]:
    """The --json document: target, drafts[name, alpha, alpha_ci, per_k, best_k, ...] (our
    loop's), ranking, vllm (vLLM's measurements, the table and the config), cross_check,
    priced (our acceptance priced with vLLM's step costs), loop_table (our loop batched),
    warnings, settings and notes."""
    extra = {
        "vllm": None if report.vllm is None else asdict(report.vllm),
        "cross_check": None if report.cross_check is None else [asdict(r) for r in report.cross_check],
        "priced": None if report.priced is None else [asdict(r) for r in report.priced],
        "warnings": report.warnings,
    }
    if extra["vllm"] is not None:
        extra["vllm"].pop("outputs", None)
    profile = report.profile
    if profile is None:
        return {
            "target": report.vllm.target if report.vllm else None,
            "engine": report.settings.get("engine"),
            "drafts": [],
            "ranking": [],
            "projection": None,
            "loop_table": None,
            **extra,
            "settings": report.settings,
            "notes": report.notes,
        }
    drafts = []
    for d in profile.drafts:
        acc = d.acceptance
        drafts.append(
            {
                "name": d.name,
                "alpha": acc.alpha,
                "alpha_ci": list(acc.alpha_ci),
                "cost_ratio": d.cost_ratio,
                "cost_source": d.cost_source,
                "draft_seconds": asdict(d.times),
                "per_k": [_per_k(r) for r in d.per_k],
                "best_k": d.best_k,
                "best_k_basis": profile.basis,
                "slower_than_plain": d.slower_everywhere,
                "per_category": [asdict(c) for c in d.per_category],
                "positions_scored": acc.positions,
                "per_position": acc.per_position,
                "per_prompt": acc.per_prompt,
            }
        )
    doc = {
        "target": profile.target,
        "engine": report.settings.get("engine"),
        "target_step_ms": profile.target_step_ms,
        "verify_costs": profile.verify_costs,
        "basis": profile.basis,
        "baseline_seconds": profile.baseline_seconds,
        "tokens_decoded": profile.tokens,
        "drafts": drafts,
        "ranking": profile.ranking,
        "projection": None if profile.projection is None else asdict(profile.projection),
        **extra,
        "settings": report.settings,
        "notes": report.notes,
    }
    doc["predicted_vs_vllm"] = predicted_vs_vllm(doc) if doc["vllm"] is not None else None
    doc["loop_table"] = None if profile.batched is None else asdict(profile.batched)
    return doc


def _per_k(r: Any) -> dict[str, Any]:
    """One k of our loop, with the measured per-position acceptance also given conditionally."""
    d = asdict(r)
    if d["vllm_measured"] is not None:
        d["vllm_measured"]["per_position_conditional"] = conditional(d["vllm_measured"]["per_position"])
    return d


def _pm(pred: float, meas: float | None, fmt: str = ".2f") -> str:
    return f"{pred:{fmt}} / " + ("-" if meas is None else f"{meas:{fmt}}")


def human(report: dict[str, Any]) -> None:
    if report["drafts"]:
        _ours(report)
    if report.get("loop_table") is not None:
        _loop_table(report["loop_table"])
    if report["vllm"] is not None:
        _vllm(report["vllm"])
    if report["cross_check"] is not None:
        _cross_check(report["cross_check"], report["settings"])
        _predicted_vs_vllm(report)
    console = out()
    if report["drafts"]:
        console.print(f"\nranking (by {report['basis']} speedup at each draft's best k):")
        for r in report["ranking"]:
            console.print(f"  {r['rank']}. {r['name']} (k={r['best_k']}): {r['reason']}", highlight=False, markup=False)
    if report["projection"] is not None:
        _projection(report["projection"])
    for w in report["warnings"]:
        console.print(f"warning: {w}", style="yellow", highlight=False, markup=False)
    for note in report["notes"]:
        console.print(f"note: {note}", style="dim", highlight=False, markup=False)


def _ours(report: dict[str, Any]) -> None:
    """Our loop's tables (measured by our transformers loop at batch 1)."""
    console = out()
    s = report["settings"]
    measured = report["basis"] == "measured"
    table = Table(
        title=f"spec-profile, our loop: target {report['target']}  (T={s['temperature']}, top-p={s['top_p']}, "
        f"{s['num_prompts']} prompts x {s['max_new_tokens']} tokens, target step "
        f"{report['target_step_ms']:.2f} ms)",
    )
    for col in ("draft", "k", "alpha (95% CI)", "c", "v(k)", "tok/pass", "speedup", "error"):
        table.add_column(col, justify="left" if col == "draft" else "right")
    for d in report["drafts"]:
        lo, hi = d["alpha_ci"]
        for i, r in enumerate(d["per_k"]):
            table.add_row(
                d["name"] if i == 0 else "",
                f"{r['k']}{' *' if r['k'] == d['best_k'] else ''}",
                f"{d['alpha']:.3f} ({lo:.2f}-{hi:.2f})" if i == 0 else "",
                f"{r['cost_ratio']:.3g}" + ("" if d["cost_source"] == "measured" else " given"),
                f"{r['verify_cost']:.2f}",
                _pm(r["predicted_tokens"], r["measured_tokens"]),
                _pm(r["predicted_speedup"], r["measured_speedup"]),
                "-" if r["error"] is None else f"{r['error']:+.1%}",
            )
        table.add_section()
    console.print(table)
    console.print(
        "a / b reads predicted / measured (speedups exclude the prefill); c: draft cost per drafted token, "
        "v(k): target pass over k+1 tokens, both in target decode steps; error: predicted / measured - 1; "
        f"* best k by {report['basis']} speedup" + ("" if measured else " (--no-loop: nothing measured)"),
        highlight=False,
    )

    vllm = Table(title="vLLM's metrics (vllm/v1/spec_decode/metrics.py): predicted from alpha / measured by our loop")
    for col in ("draft", "k", "mean acceptance length", "acceptance rate", "per-position acceptance"):
        vllm.add_column(col, justify="left" if col in ("draft", "per-position acceptance") else "right")
    for d in report["drafts"]:
        for i, r in enumerate(d["per_k"]):
            p, m = r["vllm_predicted"], r["vllm_measured"]
            per_pos = " ".join(f"{x:.2f}" for x in p["per_position"])
            if m is not None:
                per_pos += " / " + " ".join(f"{x:.2f}" for x in m["per_position"])
            vllm.add_row(
                d["name"] if i == 0 else "",
                str(r["k"]),
                _pm(p["mean_acceptance_length"], m and m["mean_acceptance_length"]),
                _pm(p["acceptance_rate"], m and m["acceptance_rate"]),
                per_pos,
            )
        vllm.add_section()
    console.print()
    console.print(vllm)

    if measured:
        for d in report["drafts"]:
            r = next(r for r in d["per_k"] if r["k"] == d["best_k"])
            total = sum(r["accepted_hist"]) or 1
            console.print(f"\naccepted drafted tokens per target pass: {d['name']} at k={r['k']} ({total} passes)")
            peak = max(r["accepted_hist"]) or 1
            for n, count in enumerate(r["accepted_hist"]):
                bar = "█" * round(40 * count / peak)
                console.print(f"  {n:>2} | [cyan]{bar}[/] {count} ({100 * count / total:.1f}%)", highlight=False)

    if any(d["per_category"] for d in report["drafts"]):
        cats = Table(title=f"per category (best k by {report['basis']} speedup)")
        for col in ("draft", "category", "prompts", "alpha", "best k", "speedup"):
            cats.add_column(col, justify="left" if col in ("draft", "category") else "right")
        for d in report["drafts"]:
            for i, c in enumerate(d["per_category"]):
                cats.add_row(
                    d["name"] if i == 0 else "",
                    c["category"],
                    str(c["prompts"]),
                    f"{c['alpha']:.3f}",
                    str(c["best_k"]),
                    f"{c['speedup']:.2f}",
                )
            cats.add_section()
        console.print()
        console.print(cats)


def _loop_table(t: dict[str, Any]) -> None:
    """Our loop batched at each batch size: speedup per (draft, batch size, k), the best k per
    size and the table, labelled as our loop's."""
    console = out()
    table = Table(title="measured by OUR LOOP batched (transformers here, not vLLM): speedup per batch size")
    for col in ("draft", "batch", *(f"k={k}" for k in t["ks"]), "best k", "as alone"):
        table.add_column(col, justify="left" if col == "draft" else "right")
    for name, by_size in t["best_k"].items():
        best = {int(b): k for b, k in by_size.items()}  # int keys, or str once through JSON
        for i, b in enumerate(t["batch_sizes"]):
            cells = {c["k"]: c for c in t["cells"] if c["draft"] == name and c["batch"] == b}
            alone = {c["as_alone"] for c in cells.values()}
            table.add_row(
                name if i == 0 else "",
                str(b),
                *(f"{cells[k]['speedup']:.2f}{_pred(cells[k])}{' *' if best[b] == k else ''}" for k in t["ks"]),
                "none" if best[b] == 0 else str(best[b]),
                "-" if None in alone else ("yes" if alone == {True} else "NO"),
            )
        table.add_section()
    console.print()
    console.print(table)
    console.print(
        "speedup: plain decoding / speculative decoding of the same chunks of B prompts, decode phase (prefill "
        "excluded), measured / predicted: our loop's prediction from a cost model fitted to its own passes "
        "without speculation (the target's over 1 and k + 1 tokens a row, a model draft's alone) and the "
        "acceptance along each continuation; * the fastest k measured, none: no speculation wins; as alone "
        "(T=0): every sequence emitted the target's greedy tokens and accepted what it accepts decoding alone",
        highlight=False,
    )
    for name, rows in t["schedule"].items():
        console.print(
            f"{name}: num_speculative_tokens_per_batch_size measured by our loop: {json.dumps(rows)}",
            highlight=False,
            markup=False,
        )


def _speedup(c: dict[str, Any], cpu: bool) -> str:
    x, r = (c.get("speedup_cpu"), c.get("speedup_cpu_range")) if cpu else (c["speedup"], c["speedup_range"])
    return "-" if x is None else f"{x:.2f}{_rng(r)}"


def _pred(cell: dict[str, Any]) -> str:
    p = cell.get("predicted_speedup")
    return "" if p is None else f"/{p:.2f}"


def _rng(lo_hi: list[float] | None, fmt: str = ".2f") -> str:
    return "" if lo_hi is None else f" ({lo_hi[0]:{fmt}}-{lo_hi[1]:{fmt}})"


def _vllm(v: dict[str, Any]) -> None:
    """vLLM's measurements per draft, batch size and k; the best k per batch size, the table
    and the config to paste."""
    console = out()
    host = v["host"]
    base = {c["batch"]: c for c in v["baseline"]}
    table = Table(
        title=f"measured by vLLM {host.get('vllm', '?')} (its counters and throughput; {v['repeats']} repeats, "
        f"range in brackets): target {v['target']}"
    )
    cpu = v.get("clock") == "cpu"
    for col in ("draft", "batch", "k", "tokens/s", "speedup (cpu)" if cpu else "speedup", "mean acc. len",
                "per-position: uncond. / cond."):  # fmt: skip
        table.add_column(col, justify="left" if col in ("draft", "per-position: uncond. / cond.") else "right")
    for b in v["batch_sizes"]:
        if b in base:
            c = base[b]
            table.add_row(
                "no speculation",
                str(b),
                "0",
                f"{c['tokens_per_s']:.1f}{_rng(c['tokens_per_s_range'], '.1f')}",
                "1",
                "",
                "",
            )
    table.add_section()
    for d in v["drafts"]:
        first = True
        for b in v["batch_sizes"]:
            for c in (c for c in d["cells"] if c["batch"] == b):
                best = d["best_k"].get(b) == c["k"]
                table.add_row(
                    d["name"] if first else "",
                    str(b),
                    f"{c['k']}{' *' if best else ''}",
                    f"{c['tokens_per_s']:.1f}{_rng(c['tokens_per_s_range'], '.1f')}",
                    _speedup(c, cpu),
                    "-" if c["mean_acceptance_length"] is None else f"{c['mean_acceptance_length']:.2f}",
                    " ".join(f"{x:.2f}" for x in c["per_position"])
                    + " / "
                    + " ".join(f"{x:.2f}" for x in c["per_position_conditional"]),
                )
                first = False
        table.add_section()
    console.print()
    console.print(table)
    console.print(
        "speedup: tokens/s over no speculation's at the same batch size (cpu: tokens per second of the worker's "
        "CPU time, robust to other processes' load with --threads 1; tokens/s stays wall time); * the measured "
        "fastest k at that size, by the same clock (best k 0 means no speculation wins)",
        highlight=False,
    )
    for d in v["drafts"]:
        console.print(
            f"\n{d['name']}: best k per batch size (measured by vLLM): "
            + ", ".join(f"{b}: {'none' if k == 0 else k}" for b, k in d["best_k"].items()),
            highlight=False,
            markup=False,
        )
        if d["schedule"]:
            console.print(
                f"  num_speculative_tokens_per_batch_size: {json.dumps(d['schedule'])}", highlight=False, markup=False
            )
        if d["speculative_config"] is not None:
            console.print(
                f"  --speculative-config '{json.dumps(d['speculative_config'])}'", highlight=False, markup=False
            )
        cells = [c for c in d["cells"] if c["accepted_hist"]]
        if cells:
            c = max(cells, key=lambda c: (-c["batch"], c["k"] == d["best_k"].get(c["batch"]), c["k"]))
            total = sum(c["accepted_hist"]) or 1
            peak = max(c["accepted_hist"]) or 1
            console.print(f"  accepted tokens per draft at batch {c['batch']}, k={c['k']} ({total} drafts, vLLM):")
            for n, count in enumerate(c["accepted_hist"]):
                bar = "█" * round(30 * count / peak)
                console.print(f"    {n:>2} | [cyan]{bar}[/] {count} ({100 * count / total:.1f}%)", highlight=False)
        for e in d["errors"]:
            console.print(f"  error: {e}", style="red", highlight=False, markup=False)
    for e in v["errors"]:
        if e.startswith("no speculation"):
            console.print(f"error: {e}", style="red", highlight=False, markup=False)


def _cross_check(rows: list[dict[str, Any]], settings: dict[str, Any]) -> None:
    from infer_tool.spec.crosscheck import TOLERANCE

    console = out()
    table = Table(
        title=f"cross-check at T={settings['temperature']}: per-position acceptance, our loop (batch 1) vs vLLM "
        f"(tolerance {TOLERANCE:.0%} absolute per position)"
    )
    for col in ("draft", "k", "vLLM batch", "ours", "vLLM", "max diff", "agree"):
        table.add_column(col, justify="left" if col in ("draft", "ours", "vLLM") else "right")
    for r in rows:
        table.add_row(
            r["draft"],
            str(r["k"]),
            str(r["batch"]),
            " ".join(
                f"{a:.3f}" if r["ours_max"] is None or a == b else f"{a:.3f}..{b:.3f}"
                for a, b in zip(r["ours"], r["ours_max"] or r["ours"])
            ),
            " ".join(f"{x:.3f}" for x in r["vllm"]),
            f"{r['max_diff']:.3f}",
            "yes" if r["agree"] else "NO",
        )
    console.print()
    console.print(table)
    console.print(
        "ours at T=0: the rounds vLLM's rule makes (whole proposals, even past the requested tokens) replayed "
        "along our target's continuations from the teacher-forced acceptance; a..b: rounds that ran past the "
        "last token may have accepted more",
        highlight=False,
    )
    for r in rows:
        if r["reason"]:
            console.print(f"  {r['draft']} k={r['k']}: {r['reason']}", highlight=False, markup=False)


def predicted_vs_vllm(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Our predicted speedup (batch 1, our loop's costs) next to vLLM's measured one at batch 1."""
    rows = []
    cells = {(d["name"], c["k"]): c for d in report["vllm"]["drafts"] for c in d["cells"] if c["batch"] == 1}
    for d in report["drafts"]:
        for r in d["per_k"]:
            c = cells.get((d["name"], r["k"]))
            if c is not None and c["speedup"]:
                rows.append(
                    {
                        "draft": d["name"],
                        "k": r["k"],
                        "ours_predicted": r["predicted_speedup"],
                        "vllm_measured": c["speedup"],
                        "vllm_range": c["speedup_range"],
                        "error": r["predicted_speedup"] / c["speedup"] - 1.0,
                    }
                )
    return rows


def _predicted_vs_vllm(report: dict[str, Any]) -> None:
    """Our acceptance priced per (draft, batch size, k) two ways, next to vLLM's measured
    speedup: with the cost model fitted from vLLM runs without speculation (the prediction),
    and with the step costs timed inside the same speculative runs (a consistency check); at
    batch 1 also our loop's own prediction (its transformers costs)."""
    ours = {(r["draft"], r["k"]): r["ours_predicted"] for r in predicted_vs_vllm(report)}
    rows = report.get("priced") or []
    if not rows and not ours:
        return
    cpu = any(r.get("clock") == "cpu" for r in rows)
    table = Table(title="speedup predicted for our acceptance / measured by vLLM (prefill included)")
    vcols = ("vLLM wall", "vLLM cpu") if cpu else ("vLLM",)
    for col in ("draft", "B", "k", *vcols, "model", "err", "p/v/d", "check", "err", "p/v/d", "ours"):
        table.add_column(col, justify="left" if col == "draft" else "right")

    def rng(x: float | None, lo_hi: list[float] | None) -> str:
        """'0.65 .62-.68': the value and its range over repeats, short enough for one line."""
        if x is None:
            return "-"
        short = [f"{v:.2f}".removeprefix("0") for v in lo_hi] if lo_hi is not None else None
        return f"{x:.2f}" + ("" if short is None else f" {short[0]}-{short[1]}")

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f}"

    def num(x: float | None, fmt: str = "{:.2f}") -> str:
        return "-" if x is None else fmt.format(x)

    last = None
    for r in sorted(rows, key=lambda r: (r["draft"], r["batch"], r["k"])):
        if last is not None and last != r["draft"]:
            table.add_section()
        mine = ours.get((r["draft"], r["k"])) if r["batch"] == 1 else None
        table.add_row(
            r["draft"] if r["draft"] != last else "",
            str(r["batch"]),
            str(r["k"]),
            rng(r["vllm_speedup"], r["vllm_speedup_range"]),
            *((rng(r.get("vllm_speedup_cpu"), r.get("vllm_speedup_cpu_range")),) if cpu else ()),
            num(r.get("model_speedup")),
            num(r.get("model_error_cpu") if cpu else r.get("model_error"), "{:+.0%}"),
            "/".join(ms(r.get(f)) for f in ("model_plain_step_ms", "model_verify_step_ms", "model_draft_ms")),
            f"{r['predicted_speedup']:.2f}",
            num(r.get("error_cpu") if cpu else r["error"], "{:+.0%}"),
            "/".join(ms(r[f]) for f in ("plain_step_ms", "verify_step_ms", "draft_ms")),
            num(mine),
        )
        last = r["draft"]
    console = out()
    console.print()
    console.print(table)
    console.print(
        "vLLM: its measured speedup (wall: tokens/s; cpu: tokens per second of its worker's CPU time, robust to "
        "other processes' load with --threads 1, the clock the costs were timed in), range over repeats "
        "(.62-.68). model: the prediction, our loop's acceptance along "
        "each continuation priced by the cost model fitted from vLLM runs without speculation (the target "
        "alone: plain decode steps and cached-prefix steps of k + 1 tokens a request; a draft model alone: "
        "one pass over k + 1 tokens and k - 1 one-token passes), none of the speculative runs' timings; "
        "check: the same acceptance priced with the steps timed inside the speculative runs themselves "
        "(a consistency check of the accounting, not a prediction); err: / vLLM - 1 (vLLM cpu when timed so); "
        "p/v/d: plain step, "
        "verify step (drafting excluded) and drafting at B, ms, as the model prices them and as timed in the "
        "runs; ours (B = 1): our loop's prediction with its own transformers costs (prefill excluded)",
        highlight=False,
    )


def _model_text(m: dict[str, Any]) -> str:
    if m.get("free"):
        return f"{m['name']} free (prompt lookup on the CPU)"
    weights = m["weights"] + (f" g{m['group_size']}" if m["group_size"] not in (None, 128) else "")
    shared = ", the target's weights" if m["shares_target_weights"] else ""
    n, layers = m["params"], m["layers"]
    params = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"
    return (
        f"{m['name']} {weights} ({layers} layer{'s' if layers != 1 else ''}, hidden {m['hidden_size']}, "
        f"{params} params{shared})"
    )


def _projection(p: dict[str, Any]) -> None:
    """The projection's tables: the target's side per concurrency, each draft's projected
    speedup per k and concurrency, then its inputs."""
    console = out()
    i = p["inputs"]
    ks = list(p["target"][0]["verify_costs"])
    target = Table(title=f"PROJECTION to {i['gpu']} serving (roofline from datasheet peaks; not measured): target side")
    for col in ("concurrency", "target step", "bound", *(f"v({k})" for k in ks)):
        target.add_column(col, justify="right")
    for r in p["target"]:
        target.add_row(
            str(r["concurrency"]),
            f"{r['step_ms']:.3g} ms",
            r["bound"],
            *(f"{r['verify_costs'][k]:.2f}" + ("c" if r["verify_bound"][k] == "compute" else "") for k in ks),
        )
    console.print()
    console.print(target)
    speed = Table(title=f"PROJECTED speedup on {i['gpu']} per concurrency (* best k; alpha measured here)")
    for col in ("draft", "alpha", "k", *(f"conc {r['concurrency']}" for r in p["target"])):
        speed.add_column(col, justify="left" if col == "draft" else "right")
    for d in p["drafts"]:
        for n, k in enumerate(ks):
            cells = []
            for row in d["rows"]:
                r = row["per_k"][n]
                cells.append(
                    f"{r['predicted_speedup']:.2f}{' *' if k == row['best_k'] else ''}" + ("" if row["fits"] else " !")
                )
            speed.add_row(d["name"] if n == 0 else "", f"{d['alpha']:.3f}" if n == 0 else "", str(k), *cells)
        speed.add_section()
    console.print()
    console.print(speed)
    eff = i["efficiency"]
    lines = [
        "v(k): target pass over concurrency x (k+1) tokens / a plain step of the batch (c: compute-bound); "
        "speedup from the acceptance along each continuation with these costs (alpha-only figures in the JSON)"
        + (
            "; !: does not fit in the GPU's memory (see notes)"
            if any(not r["fits"] for d in p["drafts"] for r in d["rows"])
            else ""
        ),
        f"inputs: {i['gpu_name']} ({i['hbm_bytes_per_s'] / 1e12:g} TB/s HBM, "
        f"{i['bf16_flops'] / 1e12:g} TFLOP/s dense BF16"
        + (f", {i['fp8_flops'] / 1e12:g} FP8" if i["fp8_flops"] else "")
        + f") at HBM efficiency {eff['hbm']:g} and MFU {eff['mfu']:g}; KV cache {i['kv_dtype']}; context: prompt "
        f"{i['prompt_len']} + output {i['output_len']} tokens (mean {i['mean_context']:g})",
        "models: " + "; ".join(_model_text(m) for m in i["models"]),
        "assumes: " + "; ".join(i["assumptions"]),
    ]
    for line in lines + [f"note: {n}" for n in p["notes"]]:
        console.print(
            line,
            style="dim" if line.startswith(("inputs", "models", "assumes", "note")) else None,
            highlight=False,
            markup=False,
        )
