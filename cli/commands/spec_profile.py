"""`infer-tool spec-profile`: choose a draft model (and lookahead k) for speculative decoding."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from infer_tool.cli.options import AllowPickle, Device, HbmEfficiency, Json, Mfu, NoProgress, TrustRemoteCode, efficiency
from infer_tool.cli.output import cli_command, emit_json, progress_bar, quiet_libraries
from infer_tool.common.errors import BadInput
from infer_tool.sizing.defaults import DEFAULT_CONCURRENCY

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


def check_projection(gpu: str | None, concurrency: list[str] | None, eff: dict[str, float | None]) -> Any:
    """(GPU preset, concurrencies, Efficiency) of the projection, or None without --gpu;
    refused before anything is loaded."""
    if gpu is None:
        given = [f"--{n.replace('_', '-')}" for n, v in (("concurrency", concurrency), *eff.items()) if v is not None]
        if given:
            raise BadInput(f"{', '.join(given)}: used only by the projection; give --gpu PRESET too "
                           "(see infer-tool kv-budget --list-gpus)")
        return None
    from infer_tool.sizing.presets import gpu_preset, gpu_presets, suggest
    from infer_tool.sizing.roofline import Hardware
    from infer_tool.sizing.units import parse_counts

    try:
        preset = gpu_preset(gpu)
    except BadInput:
        raise BadInput(f"--gpu {gpu!r} is not a GPU preset; {suggest(gpu, list(gpu_presets()))} "
                       "(see infer-tool kv-budget --list-gpus)") from None
    Hardware.from_preset(preset)  # refuses a GPU without the datasheet figures
    counts = tuple(parse_counts(concurrency, "--concurrency")) if concurrency else DEFAULT_CONCURRENCY
    return preset, counts, efficiency(dict(eff))


def served_models(target: str, target_dir: Path, specs: list[Any], model_dirs: dict[str, Path]) -> tuple[Any, tuple]:
    """The target and each draft as the projection serves them, from their config.json
    (a truncated draft: the target's first N layers; prompt lookup: None, free)."""
    from infer_tool.sizing.hf_config import load_config
    from infer_tool.spec.roofline import served_model, truncated

    def read(name: str, directory: Path) -> Any:
        return served_model(load_config(directory), name, str(directory / "config.json"))

    t = read(target, target_dir)
    by_kind = {"ngram": lambda s: None, "truncated": lambda s: truncated(t, s.n, s.spec),
               "model": lambda s: read(s.spec, model_dirs[s.spec])}
    return t, tuple(by_kind[s.kind](s) for s in specs)


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
    gpu: Annotated[Optional[str], typer.Option(help="Also project the speedups onto this GPU preset (kv-budget --list-gpus) with sizing's roofline: a projection, not a measurement.")] = None,
    concurrency: Annotated[Optional[list[str]], typer.Option(help=f"Concurrencies to project at with --gpu: 1,8,32 or 1..128 (default {','.join(map(str, DEFAULT_CONCURRENCY))}).")] = None,
    hbm_efficiency: HbmEfficiency = None,
    mfu: Mfu = None,
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
    projecting = check_projection(gpu, concurrency, {"hbm_efficiency": hbm_efficiency, "mfu": mfu})
    from infer_tool.common.device import pick_device, torch_dtype
    from infer_tool.spec.inputs import check_model_spec, load_prompt_texts, parse_draft

    dt = torch_dtype(dtype)
    dev = pick_device(device)
    clock_name = pick_clock(clock, dev, threads)
    check_model_spec(target, "target", allow_pickle)
    specs = [parse_draft(spec, allow_pickle) for spec in draft]
    texts = load_prompt_texts(prompts, num_prompts, text_field)

    from infer_tool.evals.load_model import load_for_eval
    from infer_tool.spec.drafts import ModelDraft, NgramDraft
    from infer_tool.spec.inputs import make_draft, same_weights, tokenize_prompts
    from infer_tool.spec.profile import profile

    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    quiet_libraries()

    model_dirs: dict[str, Path] = {}

    def load(spec: str) -> Any:
        m = load_for_eval(spec, dtype=dt, device=dev, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
        model_dirs[spec] = m.path
        return m

    loaded = load(target)
    made = [make_draft(spec, loaded.model, loaded.tokenizer, load) for spec in specs]
    vocab = min(v for _, v in made)
    drafts = [d for d, _ in made]
    for d in drafts:
        d.restrict_vocab(vocab)
    ids, categories = tokenize_prompts(texts, loaded.tokenizer, prompt_len)
    ids = [p.to(dev) for p in ids]
    projection = None
    if projecting is not None:  # sized now, so a config the roofline cannot read fails before the profile
        from infer_tool.spec.projection import ProjectionRequest
        from infer_tool.spec.roofline import Serving, batch_times, describe

        preset, counts, eff = projecting
        t, ds = served_models(target, loaded.path, specs, model_dirs)
        serving = Serving(preset, eff, round(sum(p.numel() for p in ids) / len(ids)), max_new_tokens)
        projection = ProjectionRequest(tuple(batch_times(serving, t, ds, B, max(ks)) for B in counts),
                                       describe(serving, t, ds, [d.name for d in drafts], counts))
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
            clock=CLOCKS[clock_name], projection=projection, progress=bar,
        )
    settings = {
        "prompts": prompts, "num_prompts": len(ids), "prompt_len": prompt_len,
        "max_new_tokens": max_new_tokens, "k": ks, "temperature": temperature, "top_p": top_p,
        "seed": seed, "dtype": dtype, "device": dev, "batch_size": 1, "threads": threads,
        "loop": not no_loop, "clock": clock_name,
    }
    from infer_tool.cli.commands import spec_profile_render as render

    report = render.document(result, settings, notes)
    if json_:
        emit_json(report)
    else:
        render.human(report)
