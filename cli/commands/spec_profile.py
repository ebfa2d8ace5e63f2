"""`infer-tool spec-profile`: choose a draft model (and lookahead k) for speculative decoding."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any, Optional

import typer

from infer_tool.cli.output import cli_command, emit_json, out, progress_bar, quiet_libraries
from infer_tool.common.errors import BadInput

K_MAX = 64
ALPHA_NOTE = (
    "alpha is the conditional per-token acceptance rate E[sum_x min(p(x), q(x))] measured "
    "teacher-forced on the target's own continuations; vLLM's accepted/drafted equals "
    "(alpha - alpha^(k+1)) / ((1 - alpha) k) under independence (vllm_rate fields)"
)
NGRAM_NOTE = (
    "prompt-lookup drafts are deterministic: q is a one-hot on the proposal, so beta = p(proposal); "
    "positions with no n-gram match count as rejections (beta = 0)"
)


def register(app: typer.Typer) -> None:
    app.command("spec-profile")(spec_profile)


def parse_ks(text: str) -> list[int]:
    """'1-8', '1,2,4' or '3' -> sorted distinct ks, each in 1..K_MAX."""
    ks: set[int] = set()
    try:
        for part in text.split(","):
            lo, sep, hi = part.strip().partition("-")
            a, b = int(lo), int(hi) if sep else int(lo)
            ks.update(range(a, b + 1))
    except ValueError:
        raise BadInput(f"bad --k {text!r}: expected a range 1-8, a list 1,2,4 or one k") from None
    if not ks or min(ks) < 1 or max(ks) > K_MAX:
        raise BadInput(f"bad --k {text!r}: every k must be between 1 and {K_MAX}")
    return sorted(ks)


def report_dict(profile: Any, settings: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """The --json document: the issue's contract (target, drafts[name, alpha, alpha_ci,
    cost_ratio, per_k, best_k], ranking) plus breakdowns and settings."""
    drafts = []
    for d in profile.drafts:
        acc = d.acceptance
        drafts.append({
            "name": d.name,
            "alpha": acc.alpha,
            "alpha_ci": list(acc.alpha_ci),
            "cost_ratio": d.cost_ratio,
            "cost_ratio_source": d.cost_ratio_source,
            "draft_step_ms": d.draft_step_ms,
            "per_k": [asdict(r) for r in d.per_k],
            "best_k": d.best_k,
            "best_k_measured": d.best_k_measured,
            "positions_scored": acc.positions,
            "per_position": acc.per_position,
            "per_prompt": acc.per_prompt,
        })
    return {
        "target": profile.target,
        "target_step_ms": profile.target_step_ms,
        "baseline_seconds": profile.baseline_seconds,
        "tokens_per_run": profile.tokens,
        "drafts": drafts,
        "ranking": profile.ranking,
        "settings": settings,
        "notes": notes,
    }


def _print(report: dict[str, Any]) -> None:
    from rich.table import Table

    console = out()
    s = report["settings"]
    table = Table(
        title=f"spec-profile: target {report['target']}  (T={s['temperature']}, top-p={s['top_p']}, "
        f"{s['num_prompts']} prompts x {s['max_new_tokens']} tokens, target step "
        f"{report['target_step_ms']:.2f} ms)",
    )
    for col in ("draft", "k", "alpha (95% CI)", "c", "tok/pass", "acc/drafted", "speedup"):
        table.add_column(col, justify="left" if col == "draft" else "right")
    for d in report["drafts"]:
        lo, hi = d["alpha_ci"]
        c = f"{d['cost_ratio']:.3g}" + ("" if d["cost_ratio_source"] == "measured" else " given")
        for i, r in enumerate(d["per_k"]):
            table.add_row(
                d["name"] if i == 0 else "",
                f"{r['k']}{' *' if r['k'] == d['best_k'] else ''}",
                f"{d['alpha']:.3f} ({lo:.2f}-{hi:.2f})" if i == 0 else "",
                c if i == 0 else "",
                f"{r['expected_tokens']:.2f} / {r['measured_tokens']:.2f}",
                f"{r['predicted_vllm_rate']:.2f} / {r['measured_vllm_rate']:.2f}",
                f"{r['predicted_speedup']:.2f} / {r['measured_speedup']:.2f}",
            )
        table.add_section()
    console.print(table)
    console.print("columns with a / read predicted / measured;  * best k by predicted speedup", highlight=False)
    for d in report["drafts"]:
        r = next(r for r in d["per_k"] if r["k"] == d["best_k"])
        total = sum(r["accepted_hist"]) or 1
        console.print(f"\naccepted drafted tokens per target pass: {d['name']} at k={r['k']} ({total} passes)")
        width = 40
        peak = max(r["accepted_hist"]) or 1
        for n, count in enumerate(r["accepted_hist"]):
            bar = "█" * round(width * count / peak)
            console.print(f"  {n:>2} | [cyan]{bar}[/] {count} ({100 * count / total:.1f}%)", highlight=False)
    console.print("\nranking:")
    for r in report["ranking"]:
        console.print(f"  {r['rank']}. {r['name']} (k={r['best_k']}): {r['reason']}", highlight=False, markup=False)
    for note in report["notes"]:
        console.print(f"note: {note}", style="dim", highlight=False, markup=False)


@cli_command
def spec_profile(
    target: Annotated[str, typer.Option("--target", help="Target model: directory, .gguf, demo name (smollm2-135m) or hub name.")],
    draft: Annotated[list[str], typer.Option("--draft", help="Draft (repeatable): a model or our quantized checkpoint, truncated:N, ngram, prompt-lookup[:N].")],
    prompts: Annotated[str, typer.Option("--prompts", help="sotu:eval (paragraphs), a .txt file (one prompt per line), .jsonl/.json/.parquet or a HF dataset.")] = "sotu:eval",
    text_field: Annotated[str, typer.Option(help="Text field of .jsonl/.json/.parquet/HF prompt files.")] = "text",
    num_prompts: Annotated[int, typer.Option(help="Prompts taken evenly spaced through the corpus.")] = 32,
    prompt_len: Annotated[int, typer.Option(help="Each prompt is cut to its first N tokens.")] = 128,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens generated per prompt.")] = 128,
    k: Annotated[str, typer.Option("--k", help="Lookaheads: a range 1-8, a list 1,2,4 or one k.")] = "1-8",
    temperature: Annotated[float, typer.Option(help="Sampling temperature for target and drafts (0 = greedy).")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus filtering applied to both target and draft.")] = 1.0,
    cost_ratio: Annotated[Optional[float], typer.Option(help="Draft/target decode-step cost c, overriding the measurement (plan for other hardware).")] = None,
    seed: Annotated[int, typer.Option(help="Seed for sampling and the bootstrap.")] = 0,
    dtype: Annotated[str, typer.Option(help="Compute dtype: float32, bfloat16 or float16.")] = "float32",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")] = "auto",
    threads: Annotated[Optional[int], typer.Option(help="CPU threads for torch (default: torch's choice); 1 gives steadier timings on a shared machine.")] = None,
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="Allow pickle-based weight files (.bin/.pt); they can run code.")] = False,
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code", help="Run the model repository's own Python code.")] = False,
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")] = False,
    no_progress: Annotated[bool, typer.Option("--no-progress", help="No progress bars.")] = False,
) -> None:
    """Acceptance rate, cost ratio and speedup of each draft against the target; best k and a ranking."""
    ks = parse_ks(k)
    if not draft:
        raise BadInput("give at least one --draft")
    if max_new_tokens < 1:
        raise BadInput(f"--max-new-tokens must be >= 1 (got {max_new_tokens})")
    if temperature < 0:
        raise BadInput(f"--temperature must be >= 0 (got {temperature})")
    if not 0 < top_p <= 1:
        raise BadInput(f"--top-p must be in (0, 1] (got {top_p})")
    if cost_ratio is not None and cost_ratio < 0:
        raise BadInput(f"--cost-ratio must be >= 0 (got {cost_ratio})")

    from infer_tool.common.device import pick_device, torch_dtype

    if threads is not None:
        if threads < 1:
            raise BadInput(f"--threads must be >= 1 (got {threads})")
        import torch

        torch.set_num_threads(threads)
    dt = torch_dtype(dtype)
    dev = pick_device(device)
    quiet_libraries()

    from infer_tool.evals.loading import load_for_eval
    from infer_tool.evals.spec_drafts import NgramDraft
    from infer_tool.evals.spec_inputs import load_prompts, make_draft
    from infer_tool.evals.spec_profile import profile

    def load(spec: str) -> Any:
        return load_for_eval(spec, dtype=dt, device=dev, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)

    loaded = load(target)
    made = [make_draft(spec, loaded.model, loaded.tokenizer, load) for spec in draft]
    vocab = min(v for _, v in made)
    drafts = [d for d, _ in made]
    for d in drafts:
        d.restrict_vocab(vocab)
    ids = load_prompts(prompts, loaded.tokenizer, num_prompts, prompt_len, text_field)
    ids = [p.to(dev) for p in ids]
    notes = list(loaded.notes) + [ALPHA_NOTE]
    if any(isinstance(d, NgramDraft) for d in drafts):
        notes.append(NGRAM_NOTE)
    if len(ids) < num_prompts:
        notes.append(f"only {len(ids)} prompts available in {prompts}")
    notes.append("generation ignores end-of-sequence tokens so every run emits the same number of tokens")

    with progress_bar(not no_progress) as bar:
        result = profile(
            target, loaded.model, vocab, drafts, ids, ks, max_new_tokens, temperature, top_p,
            cost_ratio=cost_ratio, seed=seed, progress=bar,
        )
    settings = {
        "prompts": prompts, "num_prompts": len(ids), "prompt_len": prompt_len,
        "max_new_tokens": max_new_tokens, "k": ks, "temperature": temperature, "top_p": top_p,
        "seed": seed, "dtype": dtype, "device": dev, "batch_size": 1, "threads": threads,
    }
    report = report_dict(result, settings, notes)
    if json_:
        emit_json(report)
    else:
        _print(report)
