"""`infer-tool spec-profile`: choose a draft model (and lookahead k) for speculative decoding."""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict
from typing import Annotated, Any, Optional

import typer

from infer_tool.cli.options import AllowPickle, Device, Json, NoProgress, TrustRemoteCode
from infer_tool.cli.output import cli_command, emit_json, out, progress_bar, quiet_libraries
from infer_tool.common.errors import BadInput

K_MAX = 64
MAX_NEW_TOKENS = 65536
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
SEED_MAX = 2**62  # per-prompt seeds seed + i stay inside torch's 64-bit seed range
ALPHA_NOTE = (
    "alpha is the conditional per-token acceptance rate E[sum_x min(p(x), q(x))] measured "
    "teacher-forced on the target's own continuations; vLLM's acceptance rate (accepted / "
    "drafted tokens) falls with k at a fixed alpha: compare drafts by alpha"
)
NGRAM_NOTE = (
    "prompt-lookup drafts are deterministic: q is a one-hot on the proposal, so beta = p(proposal); "
    "positions with no n-gram match count as rejections (beta = 0) and their rounds are plain steps"
)
PREDICTION_NOTE = (
    "predicted speedup = expected tokens per target pass over the expected round cost "
    "(draft + v(k) target steps), from the acceptance along each continuation and the timed "
    "round costs; alpha_speedup in the JSON is the independence model "
    "(1 - a^(k+1)) / ((1 - a)(k c + v(k))). Speedups exclude the prefill"
)


def register(app: typer.Typer) -> None:
    app.command("spec-profile")(spec_profile)


def parse_ks(text: str) -> list[int]:
    """'1-8', '1,2,4' or '3' -> sorted distinct ks, each in 1..K_MAX (checked before a
    range is expanded)."""
    ks: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise BadInput(f"bad --k {text!r}: expected a range 1-8, a list 1,2,4 or one k") from None
        if not 1 <= a <= b <= K_MAX:
            raise BadInput(f"bad --k {text!r}: every k must be between 1 and {K_MAX} (ranges low-high)")
        ks.update(range(a, b + 1))
    return sorted(ks)


def check_numbers(
    num_prompts: int, prompt_len: int, max_new_tokens: int, temperature: float, top_p: float,
    cost_ratio: float | None, seed: int, threads: int | None,
) -> None:
    """The numeric options, refused before anything is loaded."""
    if num_prompts < 1:
        raise BadInput(f"--num-prompts must be >= 1 (got {num_prompts})")
    if prompt_len < 1:
        raise BadInput(f"--prompt-len must be >= 1 (got {prompt_len})")
    if not 2 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise BadInput(f"--max-new-tokens must be between 2 and {MAX_NEW_TOKENS} (got {max_new_tokens})")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise BadInput(f"--temperature must be a finite number >= 0 (got {temperature})")
    if not 0 < top_p <= 1:
        raise BadInput(f"--top-p must be in (0, 1] (got {top_p})")
    if cost_ratio is not None and not (math.isfinite(cost_ratio) and cost_ratio >= 0):
        raise BadInput(f"--cost-ratio must be a finite number >= 0 (got {cost_ratio})")
    if not 0 <= seed < SEED_MAX:
        raise BadInput(f"--seed must be between 0 and 2**62 - 1 (got {seed})")
    cores = os.cpu_count() or 1
    if threads is not None and not 1 <= threads <= 4 * cores:
        raise BadInput(f"--threads must be between 1 and {4 * cores} (got {threads})")


def pick_clock(name: str, device: str, threads: int | None) -> str:
    """'auto' -> 'cpu' on a CPU with --threads 1, else 'wall'; 'cpu' elsewhere is refused
    (the thread's CPU time misses other threads' work and a GPU's)."""
    if name not in (*CLOCKS, "auto"):
        raise BadInput(f"unknown --clock {name!r}: expected auto, wall or cpu")
    one_cpu_thread = device == "cpu" and threads == 1
    if name == "cpu" and not one_cpu_thread:
        raise BadInput("--clock cpu needs --device cpu and --threads 1 (it reads this thread's CPU time)")
    if name == "auto":
        return "cpu" if one_cpu_thread else "wall"
    return name


def report_dict(profile: Any, settings: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """The --json document: target, drafts[name, alpha, alpha_ci, per_k, best_k, ...],
    ranking, settings and notes."""
    drafts = []
    for d in profile.drafts:
        acc = d.acceptance
        drafts.append({
            "name": d.name,
            "alpha": acc.alpha,
            "alpha_ci": list(acc.alpha_ci),
            "cost_ratio": d.cost_ratio,
            "cost_source": d.cost_source,
            "draft_seconds": asdict(d.times),
            "per_k": [asdict(r) for r in d.per_k],
            "best_k": d.best_k,
            "best_k_basis": profile.basis,
            "slower_than_plain": d.slower_everywhere,
            "per_category": [asdict(c) for c in d.per_category],
            "positions_scored": acc.positions,
            "per_position": acc.per_position,
            "per_prompt": acc.per_prompt,
        })
    return {
        "target": profile.target,
        "target_step_ms": profile.target_step_ms,
        "verify_costs": profile.verify_costs,
        "basis": profile.basis,
        "baseline_seconds": profile.baseline_seconds,
        "tokens_decoded": profile.tokens,
        "drafts": drafts,
        "ranking": profile.ranking,
        "settings": settings,
        "notes": notes,
    }


def _pm(pred: float, meas: float | None, fmt: str = ".2f") -> str:
    return f"{pred:{fmt}} / " + ("-" if meas is None else f"{meas:{fmt}}")


def _print(report: dict[str, Any]) -> None:
    from rich.table import Table

    console = out()
    s = report["settings"]
    measured = report["basis"] == "measured"
    table = Table(
        title=f"spec-profile: target {report['target']}  (T={s['temperature']}, top-p={s['top_p']}, "
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

    vllm = Table(title="vLLM's metrics (vllm/v1/spec_decode/metrics.py): predicted from alpha / measured in the loop")
    for col in ("draft", "k", "mean acceptance length", "acceptance rate", "per-position acceptance"):
        vllm.add_column(col, justify="left" if col in ("draft", "per-position acceptance") else "right")
    for d in report["drafts"]:
        for i, r in enumerate(d["per_k"]):
            p, m = r["vllm_predicted"], r["vllm_measured"]
            per_pos = " ".join(f"{x:.2f}" for x in p["per_position"])
            if m is not None:
                per_pos += " / " + " ".join(f"{x:.2f}" for x in m["per_position"])
            vllm.add_row(
                d["name"] if i == 0 else "", str(r["k"]),
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
                cats.add_row(d["name"] if i == 0 else "", c["category"], str(c["prompts"]),
                             f"{c['alpha']:.3f}", str(c["best_k"]), f"{c['speedup']:.2f}")
            cats.add_section()
        console.print()
        console.print(cats)

    console.print(f"\nranking (by {report['basis']} speedup at each draft's best k):")
    for r in report["ranking"]:
        console.print(f"  {r['rank']}. {r['name']} (k={r['best_k']}): {r['reason']}", highlight=False, markup=False)
    for note in report["notes"]:
        console.print(f"note: {note}", style="dim", highlight=False, markup=False)


@cli_command
def spec_profile(
    target: Annotated[str, typer.Option("--target", help="Target model: directory, .gguf, demo name (smollm2-135m) or hub name.")],
    draft: Annotated[list[str], typer.Option("--draft", help="Draft (repeatable): a model or our quantized checkpoint, truncated:N, ngram, prompt-lookup[:N].")],
    prompts: Annotated[str, typer.Option("--prompts", help="sotu:eval (paragraphs), a .txt file (one prompt per line), .jsonl (one per record, optional 'category' field), .json/.parquet or a HF dataset.")] = "sotu:eval",
    text_field: Annotated[str, typer.Option(help="Text field of .jsonl/.json/.parquet/HF prompt files (a list of strings, e.g. Spec-Bench's turns, gives its first).")] = "text",
    num_prompts: Annotated[int, typer.Option(help="Prompts taken evenly spaced through the corpus.")] = 32,
    prompt_len: Annotated[int, typer.Option(help="Each prompt is cut to its first N tokens.")] = 128,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens generated per prompt (the first by the prefill).")] = 128,
    k: Annotated[str, typer.Option("--k", help="Lookaheads: a range 1-8, a list 1,2,4 or one k.")] = "1-8",
    temperature: Annotated[float, typer.Option(help="Sampling temperature for target and drafts (0 = greedy).")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus filtering applied to both target and draft.")] = 1.0,
    cost_ratio: Annotated[Optional[float], typer.Option(help="Draft cost per drafted token in target decode steps, replacing the measured draft cost (v(k) stays measured).")] = None,
    no_loop: Annotated[bool, typer.Option("--no-loop", help="Screening: acceptance and costs only, no speculative loop; rank by prediction.")] = False,
    clock: Annotated[str, typer.Option(help="Timer: wall, cpu (this thread's CPU time, which other processes' load does not inflate; needs --threads 1 on a CPU) or auto (cpu when it can, else wall).")] = "auto",
    seed: Annotated[int, typer.Option(help="Seed for sampling and the bootstrap.")] = 0,
    dtype: Annotated[str, typer.Option(help="Compute dtype: float32, bfloat16 or float16.")] = "float32",
    device: Device = "auto",
    threads: Annotated[Optional[int], typer.Option(help="CPU threads for torch (default: torch's choice); 1 gives steadier timings on a shared machine.")] = None,
    allow_pickle: AllowPickle = False,
    trust_remote_code: TrustRemoteCode = False,
    json_: Json = False,
    no_progress: NoProgress = False,
) -> None:
    """Acceptance rate, round costs and predicted and measured speedups of each draft against the target; best k and a ranking."""
    # Everything the user controls is checked before any model is loaded.
    check_numbers(num_prompts, prompt_len, max_new_tokens, temperature, top_p, cost_ratio, seed, threads)
    ks = parse_ks(k)
    if not draft:
        raise BadInput("give at least one --draft")
    from infer_tool.common.device import pick_device, torch_dtype
    from infer_tool.evals.spec_inputs import check_model_spec, load_prompt_texts, parse_draft

    dt = torch_dtype(dtype)
    dev = pick_device(device)
    clock_name = pick_clock(clock, dev, threads)
    check_model_spec(target, "target", allow_pickle)
    specs = [parse_draft(spec, allow_pickle) for spec in draft]
    texts = load_prompt_texts(prompts, num_prompts, text_field)

    from infer_tool.evals.loading import load_for_eval
    from infer_tool.evals.spec_drafts import ModelDraft, NgramDraft
    from infer_tool.evals.spec_inputs import make_draft, same_weights, tokenize_prompts
    from infer_tool.evals.spec_profile import profile

    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    quiet_libraries()

    def load(spec: str) -> Any:
        return load_for_eval(spec, dtype=dt, device=dev, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)

    loaded = load(target)
    made = [make_draft(spec, loaded.model, loaded.tokenizer, load) for spec in specs]
    vocab = min(v for _, v in made)
    drafts = [d for d, _ in made]
    for d in drafts:
        d.restrict_vocab(vocab)
    ids, categories = tokenize_prompts(texts, loaded.tokenizer, prompt_len)
    ids = [p.to(dev) for p in ids]
    notes = list(loaded.notes) + [ALPHA_NOTE, PREDICTION_NOTE]
    for d in drafts:
        if isinstance(d, ModelDraft) and same_weights(d.lm.model, loaded.model):
            notes.append(f"draft {d.name} has the target's own weights: it accepts every token "
                         "(alpha = 1) at the target's cost, so it can only show the loop's overhead")
    if any(isinstance(d, NgramDraft) for d in drafts):
        notes.append(NGRAM_NOTE)
    if len(ids) < num_prompts:
        notes.append(f"only {len(ids)} prompts available in {prompts}")
    notes.append("generation ignores end-of-sequence tokens so every run emits the same number of tokens")

    with progress_bar(not no_progress) as bar:
        result = profile(
            target, loaded.model, vocab, drafts, ids, ks, max_new_tokens, temperature, top_p,
            cost_ratio=cost_ratio, seed=seed, categories=categories, loop=not no_loop,
            clock=CLOCKS[clock_name], progress=bar,
        )
    settings = {
        "prompts": prompts, "num_prompts": len(ids), "prompt_len": prompt_len,
        "max_new_tokens": max_new_tokens, "k": ks, "temperature": temperature, "top_p": top_p,
        "seed": seed, "dtype": dtype, "device": dev, "batch_size": 1, "threads": threads,
        "loop": not no_loop, "clock": clock_name,
    }
    report = report_dict(result, settings, notes)
    if json_:
        emit_json(report)
    else:
        _print(report)
