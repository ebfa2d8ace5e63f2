"""The spec-profile job: profile drafts for speculative decoding against one target as a
library function, `spec_profile(SpecProfileOptions) -> SpecProfileReport`.

Every option is checked before any model is loaded (`check`: numbers, lookaheads, clock,
projection, model and draft specs, the prompts); then the target and the model drafts are
loaded, the prompts tokenized, the projection sized from the models' config.json (with a
GPU preset) and `spec.profile.profile` runs the passes. The report holds the profile, the
settings it ran with and the notes that explain it.

Imports are light at module level (the CLI reads the defaults at start-up); torch and the
models come in when the job runs.

What this module does not know: how the report is printed (`cli/commands/spec_profile_render.py`).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infer_tool.common.errors import BadInput
from infer_tool.common.progress import Progress
from infer_tool.sizing.defaults import DEFAULT_CONCURRENCY

if TYPE_CHECKING:
    from infer_tool.calib.models import LoadedModel
    from infer_tool.sizing.presets import GpuPreset
    from infer_tool.sizing.roofline import Efficiency
    from infer_tool.spec.drafts import Draft
    from infer_tool.spec.inputs import DraftSpec, PromptText
    from infer_tool.spec.profile import SpecProfile
    from infer_tool.spec.projection import ProjectionRequest
    from infer_tool.spec.roofline import ServedModel

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


@dataclass(kw_only=True)
class SpecProfileOptions:
    """What `infer-tool spec-profile` takes, as the user gives it (the CLI's defaults are these)."""

    target: str
    drafts: list[str]
    prompts: str = "sotu:eval"
    text_field: str = "text"
    num_prompts: int = 32
    prompt_len: int = 128
    max_new_tokens: int = 128
    k: str = "1-8"  # a range 1-8, a list 1,2,4 or one k
    temperature: float = 0.0
    top_p: float = 1.0
    cost_ratio: float | None = None  # replaces the measured draft cost per drafted token
    loop: bool = True  # False: screening (acceptance and costs only, ranked by prediction)
    clock: str = "auto"  # wall, cpu or auto
    seed: int = 0
    dtype: str = "float32"
    device: str = "auto"
    threads: int | None = None
    gpu: str | None = None  # GPU preset of the roofline projection
    concurrency: list[str] | None = None  # with gpu: 1,8,32 or 1..128 (default DEFAULT_CONCURRENCY)
    hbm_efficiency: float | None = None
    mfu: float | None = None
    allow_pickle: bool = False
    trust_remote_code: bool = False


@dataclass
class SpecProfileReport:
    profile: SpecProfile
    settings: dict[str, Any]  # the settings the run used, as the JSON reports them
    notes: list[str]


@dataclass
class Projecting:
    """The projection's checked options: GPU preset, concurrencies, efficiencies."""

    preset: GpuPreset
    counts: tuple[int, ...]
    eff: Efficiency


@dataclass(kw_only=True)
class Checked:
    """Everything `check` resolved from the options, before any model is loaded."""

    ks: list[int]
    projecting: Projecting | None
    dtype: Any  # torch dtype
    device: str
    clock: str  # "wall" or "cpu"
    specs: list[DraftSpec]
    texts: list[PromptText]


def parse_ks(text: str) -> list[int]:
    """'1-8', '1,2,4' or '3' (ASCII digits) -> sorted distinct ks, each in 1..K_MAX (checked
    before a range is expanded)."""
    from infer_tool.spec.numbers import ascii_int

    ks: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        a = ascii_int(lo)
        b = ascii_int(hi) if sep else a
        if a is None or b is None:
            raise BadInput(f"bad --k {text!r}: expected a range 1-8, a list 1,2,4 or one k (ASCII digits)")
        if not 1 <= a <= b <= K_MAX:
            raise BadInput(f"bad --k {text!r}: every k must be between 1 and {K_MAX} (ranges low-high)")
        ks.update(range(a, b + 1))
    return sorted(ks)


def check_numbers(opts: SpecProfileOptions) -> None:
    """The numeric options, refused before anything is loaded."""
    if opts.num_prompts < 1:
        raise BadInput(f"--num-prompts must be >= 1 (got {opts.num_prompts})")
    if opts.prompt_len < 1:
        raise BadInput(f"--prompt-len must be >= 1 (got {opts.prompt_len})")
    if not 2 <= opts.max_new_tokens <= MAX_NEW_TOKENS:
        raise BadInput(f"--max-new-tokens must be between 2 and {MAX_NEW_TOKENS} (got {opts.max_new_tokens})")
    if not (math.isfinite(opts.temperature) and opts.temperature >= 0):
        raise BadInput(f"--temperature must be a finite number >= 0 (got {opts.temperature})")
    if not 0 < opts.top_p <= 1:
        raise BadInput(f"--top-p must be in (0, 1] (got {opts.top_p})")
    c = opts.cost_ratio
    if c is not None and not (math.isfinite(c) and c >= 0):
        raise BadInput(f"--cost-ratio must be a finite number >= 0 (got {c})")
    if not 0 <= opts.seed < SEED_MAX:
        raise BadInput(f"--seed must be between 0 and 2**62 - 1 (got {opts.seed})")
    cores = os.cpu_count() or 1
    if opts.threads is not None and not 1 <= opts.threads <= 4 * cores:
        raise BadInput(f"--threads must be between 1 and {4 * cores} (got {opts.threads})")


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


def check_projection(opts: SpecProfileOptions) -> Projecting | None:
    """The projection's options, or None without a GPU preset; refused before anything is loaded."""
    eff = {"hbm_efficiency": opts.hbm_efficiency, "mfu": opts.mfu}
    if opts.gpu is None:
        given = [
            f"--{n.replace('_', '-')}" for n, v in (("concurrency", opts.concurrency), *eff.items()) if v is not None
        ]
        if given:
            raise BadInput(
                f"{', '.join(given)}: used only by the projection; give --gpu PRESET too "
                "(see infer-tool kv-budget --list-gpus)"
            )
        return None
    from infer_tool.sizing.presets import gpu_preset, gpu_presets, suggest
    from infer_tool.sizing.roofline import Efficiency, Hardware
    from infer_tool.sizing.units import parse_counts

    try:
        preset = gpu_preset(opts.gpu)
    except BadInput:
        raise BadInput(
            f"--gpu {opts.gpu!r} is not a GPU preset; {suggest(opts.gpu, list(gpu_presets()))} "
            "(see infer-tool kv-budget --list-gpus)"
        ) from None
    Hardware.from_preset(preset)  # refuses a GPU without the datasheet figures
    counts = tuple(parse_counts(opts.concurrency, "--concurrency")) if opts.concurrency else DEFAULT_CONCURRENCY
    given = {f: v for f, v in (("hbm", opts.hbm_efficiency), ("mfu", opts.mfu)) if v is not None}
    return Projecting(preset, counts, Efficiency(**given))


def check(opts: SpecProfileOptions) -> Checked:
    """Every option checked, and the prompts read, before any model is loaded."""
    check_numbers(opts)
    ks = parse_ks(opts.k)
    if not opts.drafts:
        raise BadInput("give at least one --draft")
    projecting = check_projection(opts)
    from infer_tool.common.device import pick_device, torch_dtype
    from infer_tool.spec.inputs import check_model_spec, load_prompt_texts, parse_draft

    dtype = torch_dtype(opts.dtype)
    device = pick_device(opts.device)
    clock = pick_clock(opts.clock, device, opts.threads)
    check_model_spec(opts.target, "target", opts.allow_pickle)
    specs = [parse_draft(spec, opts.allow_pickle) for spec in opts.drafts]
    texts = load_prompt_texts(opts.prompts, opts.num_prompts, opts.text_field)
    return Checked(ks=ks, projecting=projecting, dtype=dtype, device=device, clock=clock, specs=specs, texts=texts)


def served_models(
    target: str, target_dir: Path, specs: list[DraftSpec], model_dirs: dict[str, Path]
) -> tuple[ServedModel, tuple[ServedModel | None, ...]]:
    """The target and each draft as the projection serves them, from their config.json
    (a truncated draft: the target's first N layers; prompt lookup: None, free)."""
    from infer_tool.sizing.hf_config import load_config
    from infer_tool.spec.roofline import served_model, truncated

    def read(name: str, directory: Path) -> ServedModel:
        return served_model(load_config(directory), name, str(directory / "config.json"))

    t = read(target, target_dir)
    by_kind = {
        "ngram": lambda s: None,
        "truncated": lambda s: truncated(t, s.n, s.spec),
        "model": lambda s: read(s.spec, model_dirs[s.spec]),
    }
    return t, tuple(by_kind[s.kind](s) for s in specs)


def projection_request(
    p: Projecting,
    target: ServedModel,
    drafts: tuple[ServedModel | None, ...],
    *,
    names: list[str],
    prompt_len: int,
    output_len: int,
    max_k: int,
) -> ProjectionRequest:
    """The roofline's pass times at each concurrency for a mean prompt of `prompt_len`
    tokens, and what they rest on."""
    from infer_tool.spec.projection import ProjectionRequest
    from infer_tool.spec.roofline import Serving, batch_times, describe

    serving = Serving(p.preset, p.eff, prompt_len, output_len)
    return ProjectionRequest(
        tuple(batch_times(serving, target, drafts, B, max_k) for B in p.counts),
        describe(serving, target, drafts, names, p.counts),
    )


def notes_for(opts: SpecProfileOptions, loaded: LoadedModel, drafts: list[Draft], n_prompts: int) -> list[str]:
    """What the report says about its own figures: the loader's notes, the definitions, and
    what is special about these drafts and prompts."""
    from infer_tool.spec.drafts import ModelDraft, NgramDraft
    from infer_tool.spec.inputs import same_weights

    notes = list(loaded.notes) + [ALPHA_NOTE, PREDICTION_NOTE]
    for d in drafts:
        if isinstance(d, ModelDraft) and same_weights(d.lm.model, loaded.model):
            notes.append(
                f"draft {d.name} has the target's own weights: it accepts every token "
                "(alpha = 1) at the target's cost, so it can only show the loop's overhead"
            )
    if any(isinstance(d, NgramDraft) for d in drafts):
        notes.append(NGRAM_NOTE)
    if n_prompts < opts.num_prompts:
        notes.append(f"only {n_prompts} prompts available in {opts.prompts}")
    notes.append("generation ignores end-of-sequence tokens so every run emits the same number of tokens")
    return notes


def spec_profile(
    opts: SpecProfileOptions, checked: Checked | None = None, *, progress: Progress | None = None
) -> SpecProfileReport:
    """Load the target and drafts and profile every draft at every k; `checked`: what
    `check(opts)` returned, if the caller checked first."""
    c = checked or check(opts)
    from infer_tool.evals import load_model
    from infer_tool.spec.inputs import make_draft, tokenize_prompts
    from infer_tool.spec.profile import profile

    if opts.threads is not None:
        import torch

        torch.set_num_threads(opts.threads)
    model_dirs: dict[str, Path] = {}

    def load(spec: str) -> LoadedModel:
        m = load_model.load_for_eval(
            spec,
            dtype=c.dtype,
            device=c.device,
            allow_pickle=opts.allow_pickle,
            trust_remote_code=opts.trust_remote_code,
        )
        model_dirs[spec] = m.path
        return m

    loaded = load(opts.target)
    made = [make_draft(spec, loaded.model, loaded.tokenizer, load) for spec in c.specs]
    vocab = min(v for _, v in made)
    drafts = [d for d, _ in made]
    for d in drafts:
        d.restrict_vocab(vocab)
    ids, categories = tokenize_prompts(c.texts, loaded.tokenizer, opts.prompt_len)
    ids = [p.to(c.device) for p in ids]
    projection = None
    if c.projecting is not None:  # sized now, so a config the roofline cannot read fails before the profile
        t, ds = served_models(opts.target, loaded.path, c.specs, model_dirs)
        mean_prompt = round(sum(x.numel() for x in ids) / len(ids))
        projection = projection_request(
            c.projecting,
            t,
            ds,
            names=[d.name for d in drafts],
            prompt_len=mean_prompt,
            output_len=opts.max_new_tokens,
            max_k=max(c.ks),
        )
    notes = notes_for(opts, loaded, drafts, len(ids))
    result = profile(
        opts.target,
        loaded.model,
        vocab,
        drafts,
        ids,
        ks=c.ks,
        max_new_tokens=opts.max_new_tokens,
        temperature=opts.temperature,
        top_p=opts.top_p,
        cost_ratio=opts.cost_ratio,
        seed=opts.seed,
        categories=categories,
        loop=opts.loop,
        clock=CLOCKS[c.clock],
        projection=projection,
        progress=progress,
    )
    settings = {
        "prompts": opts.prompts,
        "num_prompts": len(ids),
        "prompt_len": opts.prompt_len,
        "max_new_tokens": opts.max_new_tokens,
        "k": c.ks,
        "temperature": opts.temperature,
        "top_p": opts.top_p,
        "seed": opts.seed,
        "dtype": opts.dtype,
        "device": c.device,
        "batch_size": 1,
        "threads": opts.threads,
        "loop": opts.loop,
        "clock": c.clock,
    }
    return SpecProfileReport(result, settings, notes)
