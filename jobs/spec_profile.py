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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infer_tool.common.device import cpu_threads
from infer_tool.common.errors import BadInput
from infer_tool.common.progress import Progress
from infer_tool.sizing.defaults import DEFAULT_CONCURRENCY

if TYPE_CHECKING:
    from infer_tool.calib.models import LoadedModel
    from infer_tool.sizing.presets import GpuPreset
    from infer_tool.sizing.roofline import Efficiency
    from infer_tool.spec.crosscheck import CrossRow
    from infer_tool.spec.drafts import Draft
    from infer_tool.spec.inputs import DraftSpec, PromptText
    from infer_tool.spec.profile import SpecProfile
    from infer_tool.spec.projection import ProjectionRequest
    from infer_tool.spec.roofline import ServedModel
    from infer_tool.spec.vllm_costs import PricedRow
    from infer_tool.spec.vllm_engine import VllmProfile

K_MAX = 64
ENGINES = ("ours", "vllm", "both")
VLLM_BATCH_SIZES = "1,4,16"  # --batch-sizes' default for vLLM; our loop runs batched only when it is given
BATCH_MAX = 4096
REPEATS_MAX = 100
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
    engine: str = "ours"  # ours (our transformers loop), vllm, or both (and the cross-check)
    batch_sizes: str | None = None  # concurrent sequences: vLLM's (default 1,4,16); given: our loop's too
    vllm_python: str | None = None  # default: $INFER_TOOL_VLLM_PYTHON, else this Python if it imports vllm
    repeats: int = 2  # vLLM runs per (draft, k, batch size), for the interval
    vllm_timeout: float = 600.0  # seconds per vLLM stage (a load, one batch size's runs)
    cost_model: bool = True  # --engine both: time the target and model drafts alone in vLLM, for the cost model


@dataclass
class SpecProfileReport:
    profile: SpecProfile | None  # our loop's (None with --engine vllm)
    settings: dict[str, Any]  # the settings the run used, as the JSON reports them
    notes: list[str]
    vllm: VllmProfile | None = None  # --engine vllm or both
    cross_check: list[CrossRow] | None = None  # --engine both
    priced: list[PricedRow] | None = None  # --engine both: our acceptance priced with vLLM's step costs
    warnings: list[str] = field(default_factory=list)


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
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    loop_batch_sizes: list[int] | None = None  # our loop batched at these sizes (--batch-sizes given, loop on)
    vllm_python: Path | None = None
    vllm_version: str | None = None
    engine: str = "ours"

    @property
    def ours(self) -> bool:
        return self.engine in ("ours", "both")

    @property
    def vllm(self) -> bool:
        return self.engine in ("vllm", "both")


def parse_ks(text: str) -> list[int]:
    """'1-8', '1,2,4' or '3' (ASCII digits) -> sorted distinct ks, each in 1..K_MAX (checked
    before a range is expanded)."""
    from infer_tool.spec.ascii_numbers import ascii_int

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


def parse_batch_sizes(text: str) -> list[int]:
    """'1,4,16' (ASCII digits) -> sorted distinct batch sizes, each in 1..BATCH_MAX."""
    from infer_tool.spec.ascii_numbers import ascii_int

    sizes = [ascii_int(part) for part in text.split(",")]
    if not sizes or any(b is None for b in sizes):
        raise BadInput(f"bad --batch-sizes {text!r}: expected a list such as 1,4,16 (ASCII digits)")
    if not all(1 <= b <= BATCH_MAX for b in sizes):  # type: ignore[operator]
        raise BadInput(f"bad --batch-sizes {text!r}: every batch size must be between 1 and {BATCH_MAX}")
    return sorted(set(sizes))  # type: ignore[arg-type]


def check_engine(opts: SpecProfileOptions) -> None:
    """--engine and the options only vLLM uses."""
    if opts.engine not in ENGINES:
        raise BadInput(f"unknown --engine {opts.engine!r}: expected ours, vllm or both")
    if not 1 <= opts.repeats <= REPEATS_MAX:
        raise BadInput(f"--repeats must be between 1 and {REPEATS_MAX} (got {opts.repeats})")
    if not (math.isfinite(opts.vllm_timeout) and opts.vllm_timeout > 0):
        raise BadInput(f"--vllm-timeout must be a finite number of seconds > 0 (got {opts.vllm_timeout})")
    if opts.engine == "ours" and opts.vllm_python is not None:
        raise BadInput("--vllm-python: used only by --engine vllm or both")


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
    check_engine(opts)
    ks = parse_ks(opts.k)
    batch_sizes = parse_batch_sizes(opts.batch_sizes if opts.batch_sizes is not None else VLLM_BATCH_SIZES)
    if opts.batch_sizes is not None and opts.engine == "ours" and not opts.loop:
        raise BadInput("--batch-sizes with --engine ours runs our loop batched: it needs the loop (drop --no-loop)")
    if not opts.drafts:
        raise BadInput("give at least one --draft")
    projecting = check_projection(opts)
    from infer_tool.common.device import pick_device, torch_dtype
    from infer_tool.spec.ascii_numbers import ascii_int
    from infer_tool.spec.inputs import check_model_spec, load_prompt_texts, parse_draft

    dtype = torch_dtype(opts.dtype)
    if opts.device.startswith("cuda:") and ascii_int(opts.device[5:]) is None:  # "cuda:²".isdigit() is True
        raise BadInput(f"unknown --device {opts.device!r}: expected auto, cpu, cuda or cuda:N (N in ASCII digits)")
    device = pick_device(opts.device)
    clock = pick_clock(opts.clock, device, opts.threads)
    check_model_spec(opts.target, "target", opts.allow_pickle)
    specs = [parse_draft(spec, opts.allow_pickle) for spec in opts.drafts]
    if opts.engine == "ours" and any(s.kind == "vllm" for s in specs):
        bad = next(s.spec for s in specs if s.kind == "vllm")
        raise BadInput(f"draft {bad!r} is a vLLM speculative_config: it needs --engine vllm or both")
    if opts.engine != "vllm" and any(s.kind == "suffix" for s in specs):
        from infer_tool.spec.drafts import suffix_cache_class

        suffix_cache_class()  # arctic-inference importable here, or one line saying how to install it
    texts = load_prompt_texts(opts.prompts, opts.num_prompts, opts.text_field)
    python = version = None
    if opts.engine != "ours":
        from infer_tool.spec.vllm_engine import check_python, find_python

        python = find_python(opts.vllm_python)
        version = check_python(python)
    return Checked(
        ks=ks,
        projecting=projecting,
        dtype=dtype,
        device=device,
        clock=clock,
        specs=specs,
        texts=texts,
        batch_sizes=batch_sizes,
        loop_batch_sizes=batch_sizes if opts.batch_sizes is not None and opts.engine != "vllm" and opts.loop else None,
        vllm_python=python,
        vllm_version=version,
        engine=opts.engine,
    )


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
        "suffix": lambda s: None,
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
    """Profile every draft at every k with the chosen engines: our loop (loads the target and
    drafts here), vLLM (in its own process), or both and the cross-check; `checked`: what
    `check(opts)` returned, if the caller checked first."""
    c = checked or check(opts)
    ours_specs = [s for s in c.specs if s.kind != "vllm"]
    result = None
    notes: list[str] = []
    ids: list[Any] | None = None
    target_dir: Path | None = None
    if c.ours and ours_specs:
        with cpu_threads(opts.threads):
            result, notes, ids, target_dir = _ours(opts, c, ours_specs, progress)
    settings = {
        "engine": opts.engine,
        "prompts": opts.prompts,
        "num_prompts": len(ids) if ids is not None else None,
        "prompt_len": opts.prompt_len,
        "max_new_tokens": opts.max_new_tokens,
        "k": c.ks,
        "temperature": opts.temperature,
        "top_p": opts.top_p,
        "seed": opts.seed,
        "dtype": opts.dtype,
        "device": c.device,
        "batch_size": 1,
        "loop_batch_sizes": c.loop_batch_sizes,
        "threads": opts.threads,
        "loop": opts.loop,
        "clock": c.clock,
    }
    report = SpecProfileReport(result, settings, notes)
    if not c.vllm:
        return report
    from infer_tool.spec.vllm_engine import VLLM_NOTES, vllm_warnings

    report.vllm, ids = _vllm(opts, c, ids, target_dir, progress)
    settings.update(
        num_prompts=len(ids),
        vllm_batch_sizes=c.batch_sizes,
        vllm_repeats=opts.repeats,
        vllm_python=str(c.vllm_python),
        vllm_version=c.vllm_version,
    )
    report.notes += VLLM_NOTES
    report.warnings = vllm_warnings(report.vllm, opts.temperature)
    if result is not None:
        report.cross_check = _cross_check(result, report.vllm, opts.temperature, opts.max_new_tokens, opts.seed)
        report.priced = _priced(
            result, report.vllm, [len(p) for p in ids], opts.max_new_tokens, opts.seed, opts.temperature
        )
        if opts.temperature > 0:
            report.notes.append(TEMPERATURE_NOTE)
    return report


def _ours(
    opts: SpecProfileOptions, c: Checked, specs: list[DraftSpec], progress: Progress | None
) -> tuple[SpecProfile, list[str], list[Any], Path]:
    """Our loop: load the target and drafts, profile; (profile, notes, prompt ids, target dir)."""
    from infer_tool.evals import load_model
    from infer_tool.spec.inputs import make_draft, tokenize_prompts
    from infer_tool.spec.profile import profile

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
    made = [make_draft(spec, loaded.model, loaded.tokenizer, load, vllm_ngram=c.vllm) for spec in specs]
    vocab = min(v for _, v in made)
    drafts = [d for d, _ in made]
    for d in drafts:
        d.restrict_vocab(vocab)
    ids, categories = tokenize_prompts(c.texts, loaded.tokenizer, opts.prompt_len)
    ids = [p.to(c.device) for p in ids]
    projection = None
    if c.projecting is not None:  # sized now, so a config the roofline cannot read fails before the profile
        t, ds = served_models(opts.target, loaded.path, specs, model_dirs)
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
    if c.vllm and any(s.kind == "ngram" for s in specs):
        notes.append(
            "prompt lookup in our loop follows vLLM's rule here (the earliest occurrence of the longest "
            "matching suffix n-gram), so the cross-check compares the same proposals"
        )
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
        batch_sizes=c.loop_batch_sizes,
        progress=progress,
    )
    return result, notes, [p.cpu() for p in ids], loaded.path


def _vllm(
    opts: SpecProfileOptions, c: Checked, ids: list[Any] | None, target_dir: Path | None, progress: Progress | None
) -> tuple[VllmProfile, list[Any]]:
    """vLLM's measurements on the same prompt ids (tokenized here when our loop did not run)."""
    import shutil
    import tempfile

    from infer_tool.calib.models import cache_dir, load_tokenizer, resolve_model_dir
    from infer_tool.spec.vllm_engine import profile_vllm, vllm_draft

    if target_dir is None:
        target_dir, _ = resolve_model_dir(opts.target, opts.allow_pickle)
    if ids is None:
        from infer_tool.spec.inputs import tokenize_prompts

        tok = load_tokenizer(target_dir, opts.trust_remote_code)
        ids, _ = tokenize_prompts(c.texts, tok, opts.prompt_len)
    drafts = [
        vllm_draft(s, target_dir, cache_dir(), lambda spec: resolve_model_dir(spec, opts.allow_pickle)[0])
        for s in c.specs
    ]
    probes = None
    if c.engine == "both" and opts.cost_model:
        probes = [(PROBE_TARGET, str(target_dir))]
        probes += [(probe_name(d.name), d.config["model"]) for d in drafts if d.config.get("method") == "draft_model"]
    work = Path(tempfile.mkdtemp(prefix="infer-tool-vllm-"))
    result = profile_vllm(
        python=c.vllm_python,
        target=opts.target,
        target_dir=target_dir,
        drafts=drafts,
        prompts=[p.tolist() for p in ids],
        ks=c.ks,
        batch_sizes=c.batch_sizes,
        max_new_tokens=opts.max_new_tokens,
        temperature=opts.temperature,
        top_p=opts.top_p,
        seed=opts.seed,
        dtype=opts.dtype,
        threads=opts.threads,
        repeats=opts.repeats,
        work=work,
        load_timeout=opts.vllm_timeout,
        run_timeout=opts.vllm_timeout,
        progress=progress,
        probes=probes,
        probe_repeats=PROBE_REPEATS,
        clock=c.clock,
    )
    if not result.errors:
        shutil.rmtree(work, ignore_errors=True)
    return result, ids


TEMPERATURE_NOTE = (
    "temperature > 0: our acceptance along each continuation is an expectation (sum min(p, q) per position, "
    "or p(argmax q) where vLLM drafts a model's argmax: its default draft_sample_method 'greedy'), the rounds "
    "vLLM's rule makes are sampled from it (64 runs), and the cross-check allows 2 binomial standard errors "
    "of vLLM's count beside 2%; vLLM's and our continuations are different random draws, so only the "
    "expectations can agree"
)


def vllm_acceptance(d: Any, config: dict[str, Any] | None, k: int, temperature: float) -> Any:
    """Our acceptance along each continuation as vLLM's drafting sees it: at temperature > 0 a model
    draft vLLM drafts by argmax (its default draft_sample_method 'greedy') is accepted with p(argmax q)
    (`DraftProfile.round_acceptance_argmax`), otherwise sum min(p, q) (or p(proposal), one-hot)."""
    greedy = (config or {}).get("draft_sample_method", "greedy") == "greedy"
    if temperature > 0 and greedy and k in d.round_acceptance_argmax:
        return d.round_acceptance_argmax[k]
    return d.round_acceptance[k]


def _cross_check(ours: SpecProfile, vllm: VllmProfile, temperature: float, n_tokens: int, seed: int) -> list[CrossRow]:
    """Our per-position acceptance against vLLM's at its smallest batch size. At temperature 0
    ours are the rounds vLLM's rule makes along our continuations, replayed from the
    teacher-forced acceptance (`predict.vllm_rule_rounds`: exact, but for the rounds that run
    past the requested tokens); at temperature > 0 their expectation, the rounds sampled from
    the acceptance as vLLM's drafting sees it (`vllm_acceptance`, `crosscheck.sampled_per_position`)."""
    from infer_tool.spec.crosscheck import cross_check, identical_share, per_position_bounds, sampled_per_position
    from infer_tool.spec.predict import vllm_rule_rounds

    configs = {v.name: v.config for v in vllm.drafts}

    def bounds(d: Any, r: Any) -> tuple[list[float], list[float]] | None:
        if temperature != 0:
            acc = vllm_acceptance(d, configs.get(d.name), r.k, temperature)
            v = sampled_per_position(acc, d.round_drafted[r.k], n_tokens, r.k, seed=seed)
            return None if v is None else (v, v)
        rounds = []
        for acc, drafted in zip(d.round_acceptance[r.k], d.round_drafted[r.k]):
            rounds += vllm_rule_rounds(acc, drafted)
        return per_position_bounds(rounds, r.k)

    mine = {d.name: {r.k: bounds(d, r) for r in d.per_k} for d in ours.drafts}
    batch = min(vllm.batch_sizes)
    theirs = {d.name: {c.k: c.per_position for c in d.cells if c.batch == batch} for d in vllm.drafts}
    counts = {d.name: {c.k: c.num_drafts for c in d.cells if c.batch == batch} for d in vllm.drafts}
    same = identical_share(ours.continuations, vllm.outputs.get("no speculation", []))
    return cross_check(mine, theirs, batch, temperature, same, drafts=counts)


PROBE_TARGET = "cost probe: target"
PROBE_REPEATS = 5  # chunks per batch size timed by each cost probe


def probe_name(draft: str) -> str:
    return f"cost probe: {draft}"


def _priced(
    ours: SpecProfile, vllm: VllmProfile, prompt_lens: list[int], n_tokens: int, seed: int, temperature: float = 0.0
) -> list[PricedRow]:
    """Per (draft, batch size, k) vLLM measured: the speedup predicted for our acceptance along
    each prompt's continuation, priced twice: with vLLM's own step costs timed in the same runs
    (`spec.vllm_costs`, a consistency check) and with the cost model fitted from runs without
    speculation (`spec.vllm_cost_model`); next to vLLM's measured one."""
    from infer_tool.spec.vllm_cost_model import ModelCosts
    from infer_tool.spec.vllm_costs import PricedRow, Sequence, predict
    from infer_tool.spec.vllm_engine import setting_name

    plain = vllm.step_costs.get(setting_name(None, 0))
    if plain is None:
        return []
    rows = []
    for d in ours.drafts:
        theirs = next((v for v in vllm.drafts if v.name == d.name), None)
        for c in theirs.cells if theirs is not None else []:
            costs = vllm.step_costs.get(setting_name(d.name, c.k))
            if costs is None or c.k not in d.round_acceptance:
                continue
            acceptance = vllm_acceptance(d, theirs.config, c.k, temperature)
            seqs = [Sequence(n, acc, drafted) for n, acc, drafted in zip(prompt_lens, acceptance, d.round_drafted[c.k])]
            base = predict(plain, [Sequence(n) for n in prompt_lens], c.batch, n_tokens).seconds
            spec = predict(costs, seqs, c.batch, n_tokens, seed=seed)
            plain_row, spec_row = plain.typical(c.batch), costs.typical(c.batch)
            speedup = base / spec.seconds
            model = _model_prices(vllm, d.name, c.k)
            m_speedup = None
            if model is not None:
                plain_seqs = [Sequence(n) for n in prompt_lens]
                m_base = predict(ModelCosts(model.target, None, 0), plain_seqs, c.batch, n_tokens)
                m_spec = predict(model, seqs, c.batch, n_tokens, seed=seed)
                m_speedup = m_base.seconds / m_spec.seconds
            rows.append(
                PricedRow(
                    draft=d.name,
                    batch=c.batch,
                    k=c.k,
                    plain_step_ms=None if plain_row is None else 1000 * plain_row[2],
                    verify_step_ms=None if spec_row is None else 1000 * (spec_row[2] - spec_row[4]),
                    draft_ms=None if spec_row is None else 1000 * spec_row[4],
                    predicted_seconds=spec.seconds,
                    plain_predicted_seconds=base,
                    predicted_steps=spec.decode_steps,
                    vllm_steps=c.decode_steps,
                    predicted_speedup=speedup,
                    vllm_speedup=c.speedup,
                    vllm_speedup_range=c.speedup_range,
                    error=None if not c.speedup else speedup / c.speedup - 1.0,
                    model_speedup=m_speedup,
                    model_error=None if not c.speedup or m_speedup is None else m_speedup / c.speedup - 1.0,
                    model_plain_step_ms=None if model is None else 1000 * model.target.verify(c.batch, 1),
                    model_verify_step_ms=None if model is None else 1000 * model.target.verify(c.batch, c.k + 1),
                    model_draft_ms=None if model is None else 1000 * model.draft_seconds(c.batch, c.k + 1),
                    vllm_speedup_cpu=c.speedup_cpu,
                    vllm_speedup_cpu_range=c.speedup_cpu_range,
                    error_cpu=None if not c.speedup_cpu else speedup / c.speedup_cpu - 1.0,
                    model_error_cpu=None if not c.speedup_cpu or m_speedup is None else m_speedup / c.speedup_cpu - 1.0,
                    clock=vllm.clock,
                )
            )
    return rows


def _model_prices(vllm: VllmProfile, draft: str, k: int) -> Any:
    """The cost model's prices (`vllm_cost_model.ModelCosts`) for one draft at k: the target's fit,
    and the draft's when it is a model vLLM drafts with (its own probe); None when a fit is missing
    (no probes ran, or a draft vLLM runs as a head or layer of the target, which cannot run alone)."""
    from infer_tool.spec.vllm_cost_model import ModelCosts

    target = vllm.cost_fits.get(PROBE_TARGET)
    theirs = next((v for v in vllm.drafts if v.name == draft), None)
    if target is None or theirs is None:
        return None
    method = theirs.config.get("method")
    if method in ("ngram", "suffix"):
        return ModelCosts(target, None, k)
    fitted = vllm.cost_fits.get(probe_name(draft))
    return None if fitted is None or method != "draft_model" else ModelCosts(target, fitted, k)
