"""vLLM 0.32.0 accounting vs the plain per-token arithmetic for a dense, an MLA, a
sliding-window and two hybrid models, with a fixed 12 GiB KV cache per GPU (vLLM's
--kv-cache-memory-bytes) at 32K tokens per request, on a GPU large enough for any
weights, with --max-num-batched-tokens 8192 (vllm serve's default on an H100/H200), async
scheduling and prefix caching (vLLM's defaults). Prints a markdown table.

    python benchmarks/kv_vllm_parity.py
"""

from __future__ import annotations

from infer_tool.jobs.kv_budget import PlanRequest, plan

MODELS = ("llama-3.1-8b", "deepseek-v2-lite", "mistral-7b-v0.1", "gemma-3-12b", "qwen3-next-80b-a3b")
CONTEXT = 32768


def main() -> None:
    print(
        "| model | layers | plain B/token | vLLM block (tokens) | groups | blocks / request | GPU blocks | "
        "vLLM KV tokens | vLLM max concurrency (log) | plain max concurrency | vLLM / plain |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for m in MODELS:
        r = plan(
            PlanRequest(
                m,
                gpu_mem_bytes=4096 * 2**30,
                contexts=(CONTEXT,),
                concurrencies=(1,),
                kv_cache_memory_bytes=12 * 2**30,
                max_num_batched_tokens=8192,
            )
        )
        c = r.fit.vllm(CONTEXT)
        plain = r.fit.planner.max_concurrency(CONTEXT)
        kinds = ", ".join(
            f"{n} {k}"
            for k in ("full_attention", "sliding_attention", "mla", "linear_state")
            if (n := r.shape.count(k))
        )
        per_token = sum(r.fit.planner.bytes_per_token_by_kind().values())
        ratio = c.max_concurrency_log / plain if plain else float("inf")
        print(
            f"| {m} | {kinds} | {per_token:,} | {r.fit.layout.block_size} | {len(r.fit.layout.groups)} | "
            f"{c.blocks_per_request:,} | {c.num_blocks:,} | {c.kv_cache_tokens:,} | {c.max_concurrency_log:.2f}x | "
            f"{plain:,} | {ratio:.2f} |"
        )


if __name__ == "__main__":
    main()
