"""vLLM's side of `spec-profile --engine vllm`: run a fixed prompt set through `vllm.LLM`
with and without speculative decoding and record vLLM's own counters and throughput.

Runs under the vLLM environment's Python and imports nothing of infer-tool (vLLM pins its
own transformers), so users can run it by path:

    VLLM_PYTHON spec/vllm_worker.py JOBS.json RESULTS.jsonl

JOBS.json: `{"target", "dtype", "max_model_len", "prompts": [[int, ...], ...],
"max_new_tokens", "temperature", "top_p", "seed", "batch_sizes": [int, ...], "repeats", "clock",
"settings": [{"name", "speculative_config": {...} | null} | {"name", "probe": true, "model",
"queries"}], "probe_repeats"}`. A probe setting measures a model's step costs without
speculation (`run_probe`). Every other setting is one `vllm.LLM`
(engine in this process, `max_num_seqs` = the largest batch size); for each batch size B the
prompts are generated in consecutive chunks of B (so B sequences decode together), `repeats`
times, after one warm-up chunk. Sampling: the job's temperature and top-p, `ignore_eos`, every
request exactly `max_new_tokens` tokens, seed `seed + prompt index` per request.

RESULTS.jsonl gets, written and flushed as they happen:
- `{"host": true, "vllm", "torch", "cpus"}` first;
- `{"setting", "event": "load"}` and `{"setting", "event": "run", "batch"}` as each stage starts;
- per (setting, batch size, repeat): `{"setting", "batch", "repeat", "seconds", "cpu_seconds", "tokens",
  "num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos": [...]}` (the
  counters' increase over that repeat, from `LLM.get_metrics()`; `cpu_seconds`: this process's CPU
  time, all threads, which with one compute thread is robust to other processes' load), and in
  repeat 0 `"outputs"`:
  the generated token ids per prompt, and `"steps"`: each engine step of the repeat as
  `[requests, tokens, spec_tokens, prefill, seconds, draft_seconds, forward_seconds,
  logits_seconds]` (`StepTimer`; timed with the job's `"clock"`: "wall" (default) or "cpu", this
  process's CPU time);
- per probe setting, batch size, repeat and kind: `{"setting", "probe", "batch", "probe_repeat",
  "steps"}`, then `{"setting", "probe_done": true}` (`run_probe`);
- per setting that vLLM refused: `{"setting", "stage", "error": "Type: message"}` on one line.
The caller (`spec/vllm_engine.py`) enforces the time limits: it kills this process when a stage
overruns and starts another for the settings left.
"""

from __future__ import annotations

import os
import sys

# Run by path, this file's folder (infer-tool's spec/) would come first on sys.path and its
# modules would shadow others (spec/profile.py the standard library's `profile`).
if sys.path and os.path.realpath(sys.path[0] or ".") == os.path.dirname(os.path.realpath(__file__)):
    sys.path.pop(0)

import gc  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Any  # noqa: E402

# Before vllm is imported: the engine in this process, torch on every core, a 1 GiB KV cache.
ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "OMP_NUM_THREADS": str(os.cpu_count() or 1),
}
COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: " + " ".join(str(exc).split())


def write(f: Any, rec: dict[str, Any]) -> None:
    f.write(json.dumps(rec) + "\n")
    f.flush()


def counters(llm: Any) -> dict[str, Any]:
    """vLLM's spec-decode counters now (zeros and [] without speculation)."""
    out: dict[str, Any] = {name: 0 for name in COUNTERS.values()}
    out["accepted_per_pos"] = []
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            out[COUNTERS[m.name]] += int(m.value)
        elif m.name == PER_POS:
            vals = [int(v) for v in m.values]
            prev = out["accepted_per_pos"]
            out["accepted_per_pos"] = [a + b for a, b in zip(vals, prev + [0] * len(vals))] if prev else vals
    return out


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    d = {k: after[k] - before[k] for k in COUNTERS.values()}
    b = before["accepted_per_pos"] + [0] * (len(after["accepted_per_pos"]) - len(before["accepted_per_pos"]))
    d["accepted_per_pos"] = [x - y for x, y in zip(after["accepted_per_pos"], b)]
    return d


DRAFT_SECONDS = [0.0]  # the drafter's time inside the current engine step (`time_drafting`)
FORWARD_SECONDS = [0.0]  # the model runner's forward of the served model in the step (`time_model`)
LOGITS_SECONDS = [0.0]  # the served model's logits in the step, the drafter's excluded
DRAFTING = [False]
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
CLOCK = [time.perf_counter]  # the step timers' clock: the job's "clock", wall by default


def time_drafting() -> None:
    """Add the time of every draft proposal (`GPUModelRunner.propose_draft_token_ids`, which
    the CPU model runner inherits: the drafter's whole work in a step, for every method) to
    `DRAFT_SECONDS`. Once per process, before any engine starts."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.propose_draft_token_ids

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        t = CLOCK[0]()
        DRAFTING[0] = True
        try:
            return original(self, *args, **kwargs)
        finally:
            DRAFTING[0] = False
            DRAFT_SECONDS[0] += CLOCK[0]() - t

    GPUModelRunner.propose_draft_token_ids = timed  # type: ignore[method-assign]


def time_model() -> None:
    """Add the served model's forward (`GPUModelRunner._model_forward`: the decoder layers, no
    head) to `FORWARD_SECONDS` and its logits (`LogitsProcessor.forward`: the head over the rows
    sampled, outside drafting) to `LOGITS_SECONDS`. Once per process, before any engine starts;
    a vLLM without these leaves them at 0."""
    try:
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return

    def wrap(cls: Any, name: str, into: list[float], skip_drafting: bool) -> None:
        original = getattr(cls, name)

        def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
            if skip_drafting and DRAFTING[0]:
                return original(self, *args, **kwargs)
            t = CLOCK[0]()
            try:
                return original(self, *args, **kwargs)
            finally:
                into[0] += CLOCK[0]() - t

        setattr(cls, name, timed)

    wrap(GPUModelRunner, "_model_forward", FORWARD_SECONDS, False)
    wrap(LogitsProcessor, "forward", LOGITS_SECONDS, True)


class StepTimer:
    """Times each engine step of one `vllm.LLM` (`LLMEngine.step`, which `LLM.generate` calls
    until its requests finish: schedule, forward, sampling, drafting, output processing) and
    keeps, per step with scheduled tokens, `[requests, tokens, spec_tokens, prefill, seconds,
    draft_seconds, forward_seconds, logits_seconds]`: the requests in the batch, the tokens
    scheduled for them (spec_tokens of them drafted tokens to verify), prefill 1 when a request
    fed more than its last token and drafts (a prompt), the step's wall seconds, the drafter's
    share of them, and the served model's forward and logits (`time_model`)."""

    def __init__(self, llm: Any):
        self.steps: list[list[float]] = []
        self._scheduled: Any = None
        engine = llm.llm_engine
        scheduler = engine.engine_core.engine_core.scheduler  # in-process engine core
        schedule, step = scheduler.schedule, engine.step

        def scheduled(*args: Any, **kwargs: Any) -> Any:
            self._scheduled = out = schedule(*args, **kwargs)
            return out

        def timed_step() -> Any:
            self._scheduled, DRAFT_SECONDS[0], FORWARD_SECONDS[0], LOGITS_SECONDS[0] = None, 0.0, 0.0, 0.0
            t = CLOCK[0]()
            result = step()
            seconds = CLOCK[0]() - t
            so = self._scheduled
            if so is not None and so.total_num_scheduled_tokens > 0:
                spec = {r: len(v) for r, v in so.scheduled_spec_decode_tokens.items()}
                prefill = any(n > 1 + spec.get(r, 0) for r, n in so.num_scheduled_tokens.items())
                self.steps.append(
                    [
                        len(so.num_scheduled_tokens),
                        so.total_num_scheduled_tokens,
                        sum(spec.values()),
                        int(prefill),
                        seconds,
                        DRAFT_SECONDS[0],
                        FORWARD_SECONDS[0],
                        LOGITS_SECONDS[0],
                    ]
                )
            return result

        scheduler.schedule = scheduled
        engine.step = timed_step
        self._patched = [(engine, "step"), (scheduler, "schedule")]

    def close(self) -> None:
        """Remove the patches. They make reference cycles through objects vLLM's start-up has frozen
        (`gc.freeze()`), which the collector never frees: left in place, every engine would stay
        in memory (about 2 GiB each here) after its setting."""
        for obj, name in self._patched:
            obj.__dict__.pop(name, None)
        self._patched, self._scheduled = [], None

    def take(self) -> list[list[float]]:
        out, self.steps = self.steps, []
        return out


def register_kernel_overrides_once() -> None:
    """vLLM 0.32's CPU platform registers its Triton kernel overrides at every engine start
    (`CpuPlatform.register_triton_kernel_overrides`), scanning every loaded module; once the
    n-gram proposer has loaded numba, that scan fails on a numba object
    ("AttributeError: '_lib_fn_wrapper' object has no attribute 'get'") and no second engine
    starts in the process. The first registration rebinds the kernels for the whole process,
    so later ones are skipped."""
    from vllm.platforms import current_platform

    cls = type(current_platform)
    original = cls.register_triton_kernel_overrides
    done: list[bool] = []

    def once(klass: Any) -> None:
        if not done:
            original()
            done.append(True)

    cls.register_triton_kernel_overrides = classmethod(once)  # type: ignore[method-assign]


def run_setting(job: dict[str, Any], setting: dict[str, Any], f: Any) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    name = setting["name"]
    write(f, {"setting": name, "event": "load"})
    t0 = time.perf_counter()
    try:
        llm = LLM(
            model=job["target"],
            dtype=job["dtype"],
            max_model_len=job["max_model_len"],
            max_num_seqs=max(job["batch_sizes"]),
            enforce_eager=True,
            enable_prefix_caching=False,
            seed=job["seed"],
            speculative_config=setting["speculative_config"],
            disable_log_stats=False,
        )
    except Exception as exc:  # vLLM's refusal is the result being recorded
        traceback.print_exc()
        write(f, {"setting": name, "stage": "load", "error": one_line(exc)})
        return
    write(f, {"setting": name, "event": "loaded", "load_s": time.perf_counter() - t0})
    try:
        timer: StepTimer | None = StepTimer(llm)
    except Exception:  # another vLLM's internals: run untimed, the predictions priced by its steps are left out
        traceback.print_exc()
        timer = None
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    n = job["max_new_tokens"]

    def params(i: int, tokens: int = n) -> Any:
        return SamplingParams(
            max_tokens=tokens,
            temperature=job["temperature"],
            top_p=job["top_p"],
            ignore_eos=True,
            seed=job["seed"] + i,
        )

    try:
        for j, B in enumerate(job["batch_sizes"]):
            write(f, {"setting": name, "event": "run", "batch": B})
            # Warm-up: the first time, one prompt whole (the n-gram proposer's numba functions compile at
            # first use); then the first chunk, a few tokens.
            warm = [prompts[0]] if j == 0 else prompts[:B]
            llm.generate(warm, [params(i, n if j == 0 else 4) for i in range(len(warm))], use_tqdm=False)
            for r in range(job["repeats"]):
                if timer is not None:
                    timer.take()
                before = counters(llm)
                outputs: list[list[int]] = []
                t, cpu = time.perf_counter(), time.process_time()
                for s in range(0, len(prompts), B):
                    chunk = prompts[s : s + B]
                    outs = llm.generate(chunk, [params(s + i) for i in range(len(chunk))], use_tqdm=False)
                    outputs += [list(o.outputs[0].token_ids) for o in outs]
                seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
                rec = {"setting": name, "batch": B, "repeat": r, "seconds": seconds, "cpu_seconds": cpu}
                rec["tokens"] = sum(len(o) for o in outputs)
                if timer is not None:
                    rec["steps"] = timer.take()
                rec.update(delta(counters(llm), before))
                if r == 0:
                    rec["outputs"] = outputs
                write(f, rec)
    except Exception as exc:  # refused while running: recorded with its stage
        traceback.print_exc()
        write(f, {"setting": name, "stage": "run", "error": one_line(exc)})
    finally:
        if timer is not None:
            timer.close()
        del llm
        release()


def run_probe(job: dict[str, Any], setting: dict[str, Any], f: Any) -> None:
    """A model's step costs without speculation, for the cost model (`spec/vllm_cost_model.py`):
    one `vllm.LLM` of `setting["model"]` with prefix caching; per batch size B, `probe_repeats`
    times (consecutive chunks of B prompts, rotating):
    - "decode": B prompts generate `max_new_tokens` tokens (every decode step feeds 1 token a
      request);
    - q in `setting["queries"]`: B prompts' prefixes (a whole number of KV blocks) are cached by a
      one-token request, then the same prefixes plus q more tokens are submitted for one token:
      that step computes q query tokens per request over a cached context, as a verify step of
      q - 1 drafted tokens does, with the head over one row a request (the verify step's over q).
    Records `{"setting", "probe": "decode" | q, "batch", "probe_repeat", "steps"}` and at the
    end `{"setting", "probe_done": true}`; a refusal as in `run_setting`."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    name = setting["name"]
    write(f, {"setting": name, "event": "load"})
    t0 = time.perf_counter()
    try:
        llm = LLM(
            model=setting["model"],
            dtype=job["dtype"],
            max_model_len=job["max_model_len"] + 256,
            max_num_seqs=max(job["batch_sizes"]),
            enforce_eager=True,
            enable_prefix_caching=True,
            seed=job["seed"],
            disable_log_stats=False,
        )
        timer = StepTimer(llm)
        block = int(llm.llm_engine.vllm_config.cache_config.block_size)
    except Exception as exc:
        traceback.print_exc()
        write(f, {"setting": name, "stage": "load", "error": one_line(exc)})
        return
    write(f, {"setting": name, "event": "loaded", "load_s": time.perf_counter() - t0})
    prompts = job["prompts"]
    n = job["max_new_tokens"]
    queries = setting["queries"]

    def tokens(i: int, length: int) -> list[int]:
        p = prompts[i % len(prompts)]
        return (p * (length // len(p) + 1))[:length]

    def prefix_len(i: int) -> int:
        return block * max(1, len(prompts[i % len(prompts)]) // block)

    def params(tokens: int, seed: int) -> Any:
        return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, seed=seed)

    def run(batch: list[list[int]], max_tokens: int) -> list[list[float]]:
        timer.take()
        llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in batch],
            [params(max_tokens, job["seed"] + i) for i in range(len(batch))],
            use_tqdm=False,
        )
        return timer.take()

    try:
        for B in job["batch_sizes"]:
            write(f, {"setting": name, "event": "run", "batch": B})
            run([prompts[i % len(prompts)] for i in range(B)], 4)  # warm-up
            for r in range(job["probe_repeats"]):
                idx = [(r * B + i) % len(prompts) for i in range(B)]
                steps = run([prompts[i] for i in idx], n)
                write(f, {"setting": name, "probe": "decode", "batch": B, "probe_repeat": r, "steps": steps})
                for q in queries:
                    heads = [tokens(i, prefix_len(i)) for i in idx]
                    run(heads, 1)  # caches the prefixes
                    tails = [h + tokens(i + 1, q) for h, i in zip(heads, idx)]
                    write(f, {"setting": name, "probe": q, "batch": B, "probe_repeat": r, "steps": run(tails, 1)})
        write(f, {"setting": name, "probe_done": True})
    except Exception as exc:
        traceback.print_exc()
        write(f, {"setting": name, "stage": "run", "error": one_line(exc)})
    finally:
        timer.close()
        llm = None  # noqa: F841 (the engine goes before the next one starts)
        release()


def release() -> None:
    """Tear down what a finished or failed LLM left, so the next one starts clean."""
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()
    gc.collect()


def host() -> dict[str, Any]:
    import torch
    import vllm

    return {"host": True, "vllm": vllm.__version__, "torch": torch.__version__, "cpus": os.cpu_count()}


def main(argv: list[str]) -> int:
    jobs_path, results_path = argv
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    with open(jobs_path) as f:
        job = json.load(f)
    if job.get("threads"):
        os.environ["OMP_NUM_THREADS"] = str(job["threads"])
    CLOCK[0] = CLOCKS[job.get("clock") or "wall"]
    with open(results_path, "a") as f:
        write(f, host())
        register_kernel_overrides_once()
        time_drafting()
        time_model()
        for setting in job["settings"]:
            if setting.get("probe"):
                run_probe(job, setting, f)
            else:
                run_setting(job, setting, f)
        write(f, {"done": True})
    return 0


if __name__ == "__main__":
    rc = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM's atexit teardown of the in-process engine can abort the interpreter; the results are written.
    os._exit(rc)
