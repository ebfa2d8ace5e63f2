"""vLLM 0.32.0 KV-cache accounting, each expected number worked out by hand from
vLLM's rules (vllm/v1/kv_cache_interface.py, vllm/v1/core/kv_cache_utils.py,
vllm/platforms/interface.py `_align_hybrid_block_size`, vllm/config/vllm.py
`max_in_flight_tokens`), written out below as arithmetic on the config numbers, never
taken from our code. A fixed KV cache (vLLM's --kv-cache-memory-bytes, 12 GiB) keeps the
hand numbers free of weight estimates."""

from __future__ import annotations

from math import ceil

import pytest

from infer_tool.jobs.kv_budget import PlanRequest, plan

GiB = 2**30
KV12 = 12 * GiB


def cap(model: str, context: int, **kw):
    r = plan(
        PlanRequest(
            model, contexts=(context,), concurrencies=(1,), kv_cache_memory_bytes=KV12, gpu_mem_bytes=4096 * GiB, **kw
        )
    )
    return r.fit.vllm(context), r


def test_dense_llama_8b():
    # page = 16 tokens x 8 KV heads x (128 + 128) x 2 B = 65,536 B; 32 layers in one group
    c, _ = cap("llama-3.1-8b", 8192)
    assert c.num_blocks == KV12 // (32 * 65536) == 6144
    assert c.blocks_per_request == 8192 // 16 == 512
    assert c.max_concurrency_log == pytest.approx(6144 / 512)  # "12.00x"
    assert c.kv_cache_tokens == 98304  # int(12.0 x 8192)
    # the scheduler hands out num_blocks - 1 (one null block): 11 requests, not 12
    assert c.max_concurrency == (6144 - 1) // 512 == 11 and c.fits(11) and not c.fits(12)


def test_mla_deepseek_v2_lite_latent_no_factor_two():
    # page = 16 x (512 + 64) x 2 B = 18,432 B; 27 layers
    c, _ = cap("deepseek-v2-lite", 32768)
    blocks = KV12 // (27 * 18432)
    assert c.num_blocks == blocks == 25890
    assert c.blocks_per_request == 2048
    assert c.kv_cache_tokens == int(blocks / 2048 * 32768)


@pytest.mark.parametrize(
    "flags, in_flight",
    [
        ({}, 2 * 8192),  # H100 (>= 70 GiB, not A100): vllm serve's 8192 batched tokens, 2 batches (async)
        ({"async_scheduling": False}, 8192),
        ({"async_scheduling": False, "max_num_batched_tokens": 2048}, 2048),
    ],
)
def test_sliding_window_mistral_reserves_window_plus_in_flight(flags, in_flight):
    # every layer slides (W 4096): one group; page 65,536 B x 32 layers
    c, _ = cap("mistral-7b-v0.1", 32768, gpu="H100-80GB", **flags)
    c_gpu = plan(
        PlanRequest("mistral-7b-v0.1", contexts=(32768,), concurrencies=(1,), kv_cache_memory_bytes=KV12, **flags)
    ).fit.vllm(32768)
    blocks = ceil(min(4096 - 1 + in_flight, 32768) / 16) + 1
    assert c_gpu.blocks_per_request == blocks
    assert c_gpu.num_blocks == 6144
    assert c_gpu.max_concurrency_log == pytest.approx(6144 / blocks)


def test_hybrid_gemma2_one_to_one_groups():
    # 21 sliding (W 4096) + 21 full; group_size 21 (21 < 1.5 x 21); page 16 x 8 x 512 x 2 = 131,072 B
    r = plan(PlanRequest("gemma-2-9b", contexts=(8192,), concurrencies=(1,), kv_cache_memory_bytes=KV12))
    c = r.fit.vllm(8192)
    assert len(r.fit.layout.groups) == 2
    assert c.num_blocks == KV12 // (21 * 131072) == 4681
    sliding = ceil(min(4095 + 2 * 8192, 8192) / 16) + 1  # 513: the window never drops below max_model_len here
    assert c.blocks_per_request == 8192 // 16 + sliding == 1025


def test_hybrid_gemma3_five_to_one_groups():
    # 40 sliding (W 1024) + 8 full: group_size 8, 5 sliding groups + 1 full; head_dim 256 (family default)
    r = plan(PlanRequest("gemma-3-12b", contexts=(32768,), concurrencies=(1,), kv_cache_memory_bytes=KV12))
    c = r.fit.vllm(32768)
    assert sorted(len(g.layers) for g in r.fit.layout.groups) == [8] * 6
    assert c.num_blocks == KV12 // (8 * 131072) == 12288
    per_request = 32768 // 16 + 5 * (ceil(min(1023 + 2 * 8192, 32768) / 16) + 1)
    assert c.blocks_per_request == per_request == 2048 + 5 * 1089
    assert c.max_concurrency_log == pytest.approx(12288 / per_request)
    # the plain per-token arithmetic says something else: 48 layers x 8,192 B at 32K before windows
    assert r.fit.planner.max_concurrency(32768) != c.max_concurrency


@pytest.mark.parametrize("prefix_caching, state_blocks", [(True, 2), (False, 1)])
def test_hybrid_linear_attention_qwen3_next(prefix_caching, state_blocks):
    # attention page per token: 2 KV heads x (256 + 256) x 2 B = 2,048 B
    # GDN state: conv (2 x 16 x 128 + 32 x 128) x (4 - 1) + recurrent 32 x 128 x 128, x 2 B
    state = ((2 * 16 * 128 + 32 * 128) * 3 + 32 * 128 * 128) * 2
    assert state == 1_097_728
    block = 16 * ceil(state / (16 * 2048))  # 544 tokens: one attention page holds a state
    page = block * 2048
    r = plan(
        PlanRequest(
            "qwen3-next-80b-a3b",
            contexts=(32768,),
            concurrencies=(1,),
            kv_cache_memory_bytes=KV12,
            prefix_caching=prefix_caching,
            pp=2,
            gpu_mem_bytes=4096 * GiB,
        )
    )
    # pp 2: 24 layers a stage, 6 full + 18 state; each stage has 6 layers of the widest group
    c = r.fit.vllm(32768)
    assert r.fit.layout.block_size == block == 544
    # 12 full + 36 state layers: group_size 12 -> 1 full group + 3 state groups; on a stage
    # of 24 layers every group has 6 of its 12 layers
    assert len(r.fit.layout.groups) == 4
    assert c.num_blocks == KV12 // (6 * page) == 1927
    assert c.blocks_per_request == ceil(32768 / block) + 3 * state_blocks
    assert c.kv_cache_tokens == int(1927 / c.blocks_per_request * 32768)


def test_pipeline_stages_take_the_smallest_block_count():
    # pp 3 splits 32 layers 11 / 11 / 10: the 11-layer stages hold fewer blocks
    r = plan(
        PlanRequest(
            "llama-3.1-8b",
            contexts=(8192,),
            concurrencies=(1,),
            pp=3,
            kv_cache_memory_bytes=KV12,
            gpu_mem_bytes=4096 * GiB,
        )
    )
    assert r.fit.vllm(8192).num_blocks == KV12 // (11 * 65536) == 17873


def test_tp_splits_kv_heads_in_the_page():
    # tp 2: 4 KV heads per rank, page 16 x 4 x 256 x 2 = 32,768 B
    c, _ = cap("llama-3.1-8b", 8192, tp=2)
    assert c.num_blocks == KV12 // (32 * 32768) == 12288


def test_fp8_cache_halves_the_page():
    c, _ = cap("llama-3.1-8b", 8192, kv_dtype="fp8")
    assert c.num_blocks == KV12 // (32 * 32768)


def test_int8_cache_needs_plain_accounting():
    from infer_tool.common.errors import BadInput

    with pytest.raises(BadInput, match="--accounting plain"):
        cap("llama-3.1-8b", 8192, kv_dtype="int8")
    r = plan(PlanRequest("llama-3.1-8b", contexts=(8192,), concurrencies=(1,), kv_dtype="int8", accounting="plain"))
    assert r.fit.layout is None and r.rows[0].fit.fits
