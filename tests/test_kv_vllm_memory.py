"""kv-budget's model of vLLM's start-up memory (sizing/vllm_memory.py) and the release
policies that change it (sizing/vllm_versions.py). Every expected number is worked out
below by hand from the config numbers and vLLM's rules (cited in vllm_memory's
docstring), never taken from our code; the logged numbers quoted come from the vLLM
start-up logs in benchmarks/kv_vllm_logs.json."""

from __future__ import annotations

import dataclasses
import math

import pytest

from infer_tool.common.errors import BadInput
from infer_tool.jobs.kv_budget import PlanRequest, plan
from infer_tool.sizing import vllm_memory as vm
from infer_tool.sizing.hf_config import shape_from_config
from infer_tool.sizing.vllm_versions import modelled, policy

GiB, MiB, KiB = 2**30, 2**20, 2**10

# A tiny Llama: h 256, MLP 1024 (gated), 8 query heads and 2 KV heads of 32, vocab 1000.
TINY = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
}
# A tiny Mixtral: 4 experts, top 2, expert width 512.
TINY_MOE = {
    **TINY,
    "model_type": "mixtral",
    "intermediate_size": 512,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
}
# A tiny Qwen3.5 hybrid (3 Gated DeltaNet layers then 1 attention layer, float32 SSM state).
TINY_HYBRID = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "text_config": {
        "model_type": "qwen3_5_text",
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "full_attention_interval": 4,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "mamba_ssm_dtype": "float32",
        "vocab_size": 1000,
        "max_position_embeddings": 65536,
    },
}
NEW, OLD = policy("0.32.0"), policy("0.16")


def tiny(cfg=TINY):
    return shape_from_config(cfg, name="tiny")


def engine(mnbt=512, seqs=16, **kw):
    return vm.ProfileEngine(mnbt, seqs, **kw)


# --- activation peak -------------------------------------------------------------------
def test_forward_peak_dense_by_hand():
    s = tiny()
    # mixer: q 8x32 + k,v 2x(32+32) + attention output 8x32 = 640; MLP: gate_up 2x1024 + act 1024 = 3072
    assert vm.layer_elements(s, range(4), 1) == 2 * 256 + 3072
    assert vm.forward_bytes(s, 512, range(4), 1) == 512 * (2 * 256 + 3072) * 2
    # TP 2: the MLP shards to 3 x 512; the residual streams do not shard
    assert vm.layer_elements(s, range(4), 2) == 2 * 256 + 3 * 512


def test_moe_peak_by_hand():
    s = tiny(TINY_MOE)
    # the two Triton MoE workspaces (tokens, top_k, max(I, h)) and (tokens, top_k, max(2I, h)),
    # the expert output h and the normed input h
    routed = 2 * max(512, 256) + 2 * max(1024, 256) + 256
    assert vm.mlp_elements(s, True, 1) == 256 + routed == 3584
    assert vm.layer_elements(s, range(4), 1) == 2 * 256 + 3584


def test_sampler_both_eras_by_hand():
    s = tiny()
    rows, tokens = 16, 512
    held = tokens * 256 * 2 + rows * 256 * 2  # the forward's hidden states + the rows gathered for logits
    logits = rows * 1000 * 2 + rows * 1000 * 4  # model dtype + its float32 copy
    assert vm.sampler_bytes(s, rows, tokens, 1, NEW) == held + logits + rows * 1000 * 8
    assert vm.sampler_bytes(s, rows, tokens, 1, OLD) == held + logits + rows * 1000 * 32  # the sort
    # TP 2 gathers the vocab shards: one more model-dtype copy of half the vocab
    assert vm.sampler_bytes(s, rows, tokens, 2, NEW) == held + logits + rows * 500 * 2 + rows * 1000 * 8


def test_activation_takes_the_larger_and_names_it():
    s = tiny()
    act = vm.activation(s, engine(mnbt=512, seqs=16), range(4), 1, True, NEW)
    assert act.bytes == act.forward_bytes == 512 * 3584 * 2 and act.where == "forward at 512 tokens"
    act = vm.activation(s, engine(mnbt=512, seqs=512), range(4), 1, True, OLD)
    assert act.bytes == act.sampler_bytes > act.forward_bytes and act.where.startswith("sampler: 512 x 1,000")
    # not the last pipeline stage: no sampler
    assert vm.activation(s, engine(mnbt=512, seqs=512), range(2), 1, False, OLD).sampler_bytes == 0


# --- non-torch memory ----------------------------------------------------------------
@pytest.mark.parametrize(
    "cc, workspace",
    [
        ("9.0", 32 * MiB),
        ("10.0", 32 * MiB),
        ("12.0", 32 * MiB),
        ("8.0", 4096 * KiB * 2 + 16 * KiB * 8),
        ("", 4096 * KiB * 2 + 16 * KiB * 8),
        ("gfx942", 128 * MiB),
        ("gfx90a", 32 * MiB),
    ],
)
def test_cublas_workspace_by_device(cc, workspace):
    assert vm.cublas_workspace_bytes(cc) == workspace


def test_non_torch_parts_by_release():
    s = tiny()
    parts, notes = vm.non_torch(s, engine(mnbt=512, seqs=256), "9.0", 1, True, NEW)
    assert parts == {
        "cuBLAS + cuBLASLt workspaces": 2 * 32 * MiB,
        "Triton top-k/top-p buffer": 132 * 1000 * 4,
    }
    assert notes == []
    parts, _ = vm.non_torch(s, engine(mnbt=512, seqs=16), "9.0", 1, True, NEW)
    assert parts["Triton top-k/top-p buffer"] == 16 * 1000 * 4  # one row per sequence when fewer than SMs
    parts, notes = vm.non_torch(s, engine(), "8.9", 2, True, policy("0.10"))
    assert parts == {"cuBLAS + cuBLASLt workspaces": 2 * (8 * MiB + 128 * KiB)}  # sort era: no Triton buffer
    assert len(notes) == 1 and "NCCL" in notes[0]  # before 0.11 NCCL sits inside the budget: not modelled


# --- CUDA graphs ----------------------------------------------------------------------
def test_capture_sizes_match_the_logged_counts():
    # vllm serve / LLM defaults with max_num_seqs 256: 1, 2, 4, 8..248 by 8, 256..512 by 16 -> 51
    # PIECEWISE up to 512 and 35 FULL up to 256, as vLLM logs "PIECEWISE=51 (largest=512), FULL=35
    # (largest=256)" (LMCache/LMCache#3430)
    sizes = vm.capture_sizes(engine(mnbt=8192, seqs=256), "8.6")
    assert sizes == (1, 2, 4, *range(8, 256, 8), *range(256, 513, 16))
    g = vm.cudagraphs(tiny(), engine(mnbt=8192, seqs=256), range(4), 1, "8.6", NEW)
    assert (g.piecewise, g.full, g.largest) == (51, 35, 512)


def test_capture_sizes_rules():
    assert vm.capture_sizes(engine(mnbt=8192, seqs=1024), "9.0")[-1] == 512  # min(2 x 1024, 512)
    assert vm.capture_sizes(engine(mnbt=8192, seqs=1024), "10.0")[-1] == 1024  # data-centre Blackwell
    assert vm.capture_sizes(engine(mnbt=8192, seqs=300), "9.0") == tuple(
        sorted({1, 2, 4, *range(8, 256, 8), *range(256, 513, 16), 300})
    )  # the decode size max_num_seqs
    assert vm.capture_sizes(engine(mnbt=64, seqs=256), "9.0") == (
        1,
        2,
        4,
        *range(8, 65, 8),
    )  # capped by mnbt
    assert vm.capture_sizes(engine(mnbt=8192, seqs=2), "9.0") == (
        1,
        2,
        4,
    )  # min(2 x 2, 512)
    assert vm.capture_sizes(engine(mnbt=100, seqs=16, cudagraph_capture_sizes=(200, 4, 1, 4)), "9.0") == (1, 4)
    assert vm.capture_sizes(engine(mnbt=8192, seqs=256, max_cudagraph_capture_size=64), "9.0")[-1] == 64
    assert vm.capture_sizes(engine(enforce_eager=True), "9.0") == ()


def test_graph_estimate_by_hand():
    s = tiny()
    g = vm.graph_estimate(s, range(4), 1, 51, 35, 512)
    per_graph = 4 * vm.GRAPH_BYTES_PER_LAYER["attention"]
    first = 512 * 3584 * 2 + per_graph  # the largest capture's activations and its graph
    assert (g.per_graph_bytes, g.first_bytes) == (per_graph, first)
    assert g.estimate_bytes == first + 85 * per_graph == g.subtracted_bytes
    h = tiny(TINY_HYBRID)
    assert vm.graph_estimate(h, range(8), 1, 2, 0, 1).per_graph_bytes == (
        6 * vm.GRAPH_BYTES_PER_LAYER["state"] + 2 * vm.GRAPH_BYTES_PER_LAYER["attention"]
    )
    assert vm.graph_estimate(s, range(4), 1, 0, 0, 0).estimate_bytes == 0


def test_graphs_subtracted_only_since_0_21_and_never_eager():
    s = tiny()
    before = vm.cudagraphs(s, engine(), range(4), 1, "9.0", policy("0.20"))
    since = vm.cudagraphs(s, engine(), range(4), 1, "9.0", policy("0.21"))
    assert before.estimate_bytes == since.estimate_bytes > 0
    assert before.subtracted_bytes == 0 and since.subtracted_bytes == since.estimate_bytes
    assert vm.cudagraphs(s, engine(enforce_eager=True), range(4), 1, "9.0", NEW).estimate_bytes == 0


# --- one worker, whole ---------------------------------------------------------------
def test_profile_sums_each_term():
    s, e = tiny(), engine(mnbt=512, seqs=16)
    total, weights = 24 * GiB + 123, 3 * GiB
    p = vm.profile(
        s,
        e,
        NEW,
        total=total,
        mem_util=0.9,
        weights=weights,
        compute_capability="9.0",
        tp=1,
        layers=range(4),
        last_stage=True,
    )
    requested = math.ceil(total * 0.9)  # request_memory rounds up
    act = 512 * 3584 * 2  # the forward beats 16 rows of logits
    non_torch = 2 * 32 * MiB + 16 * 1000 * 4
    sizes = vm.capture_sizes(e, "9.0")  # 1, 2, 4, 8, 16, 24, 32 (max 2 x 16)
    assert sizes == (1, 2, 4, 8, 16, 24, 32)
    per_graph = 4 * vm.GRAPH_BYTES_PER_LAYER["attention"]
    graphs = 32 * 3584 * 2 + per_graph + (7 + 5 - 1) * per_graph  # 7 PIECEWISE + 5 FULL (<= 16)
    assert p.requested == requested and p.activation.bytes == act and p.non_torch_bytes == non_torch
    assert p.cudagraphs.subtracted_bytes == graphs
    assert p.overhead == act + non_torch + graphs
    # that available = requested - weights - overhead is vLLM's own subtraction is checked against its
    # logged numbers (tests/test_kv_vllm_logs.py::test_vllm_subtracts_the_terms_profile_subtracts)
    assert p.available == p.requested - weights - p.overhead


def test_profile_with_unknown_widths_leaves_the_activation_unknown():
    s = dataclasses.replace(tiny(), forward=None, unknown=(("activation peak", "intermediate_size"),))
    p = vm.profile(
        s,
        engine(),
        NEW,
        total=GiB,
        mem_util=0.9,
        weights=0,
        compute_capability="",
        tp=1,
        layers=range(4),
        last_stage=True,
    )
    assert not p.activation.known and p.activation.bytes == 0 and "intermediate_size" in p.activation.where
    assert any("upper bound" in n for n in p.notes)
    assert p.available == p.requested - p.non_torch_bytes - p.cudagraphs.subtracted_bytes


# --- release policies -------------------------------------------------------------------
def test_versions_accepted_and_refused():
    assert policy("0.32.0").version == "0.32.0" and policy("v0.21").minor == 21 and policy("0.10.1").minor == 10
    assert modelled() == "0.10 to 0.32 (X.Y or X.Y.Z)"
    for bad in ("0.9", "0.33", "1.0", "abc", "0.2x"):
        with pytest.raises(BadInput, match="accepted: 0.10 to 0.32"):
            policy(bad)


def test_policies_flip_where_the_releases_differ():
    assert not policy("0.13").async_scheduling and policy("0.14").async_scheduling
    assert policy("0.16").sampler_sort and not policy("0.17").sampler_sort
    assert not policy("0.19").kv_tokens_per_concurrency and policy("0.20").kv_tokens_per_concurrency
    assert not policy("0.20").cudagraph_in_budget and policy("0.21").cudagraph_in_budget
    assert policy("0.20").default_mem_util == 0.9 and policy("0.21").default_mem_util == 0.92
    assert not policy("0.25").sliding_in_flight_batches and policy("0.26").sliding_in_flight_batches
    assert policy("0.10").nccl_in_budget and not policy("0.11").nccl_in_budget


def _plan(model="llama-3.1-8b", **kw):
    kw.setdefault("contexts", (8192,))
    return plan(PlanRequest(model, concurrencies=(1,), **kw))


def test_graph_policy_moves_available_by_the_estimate():
    a, b = (
        _plan(vllm_version="0.20", mem_util=0.9),
        _plan(vllm_version="0.21", mem_util=0.9),
    )
    pa, pb = a.profiles[0], b.profiles[0]
    assert pa.available - pb.available == pb.cudagraphs.estimate_bytes > 0
    assert any("vLLM 0.20 does not estimate its CUDA graphs (from 0.21 it does)" in n for n in pa.notes)
    assert not any("CUDA graphs" in n for n in pb.notes)


def test_default_mem_util_follows_the_release():
    total = _plan().gpu.total_bytes
    assert _plan(vllm_version="0.20").profiles[0].requested == math.ceil(total * 0.9)
    assert _plan(vllm_version="0.21").profiles[0].requested == math.ceil(total * 0.92)


def test_sort_sampler_before_0_17():
    a, b = (
        _plan(vllm_version="0.16", mem_util=0.9),
        _plan(vllm_version="0.17", mem_util=0.9),
    )
    rows, vocab = (
        1024,
        128256,
    )  # H100: vllm serve's 1024 sequences; Llama 3's vocabulary
    assert a.profiles[0].activation.sampler_bytes - b.profiles[0].activation.sampler_bytes == rows * vocab * (32 - 8)


@pytest.mark.parametrize(
    "version, in_flight",
    [("0.13", 8192), ("0.14", 8192), ("0.25", 8192), ("0.26", 16384)],
)
def test_sliding_window_in_flight_by_release(version, in_flight):
    # mistral-7b-v0.1 slides every layer (window 4096); 8192 batched tokens on an H100;
    # async scheduling (0.14+) holds two batches, but the window reservation counts both only since 0.26
    r = _plan(
        "mistral-7b-v0.1",
        contexts=(32768,),
        vllm_version=version,
        kv_cache_memory_bytes=12 * GiB,
    )
    assert r.fit.vllm(32768).blocks_per_request == math.ceil((4096 - 1 + in_flight) / 16) + 1


# Qwen3.5-27B, TP 2, fp8 KV cache at 4.99 GiB per GPU, max_model_len 131,072 and 8192 batched
# tokens: the run of mitchross/talos-argocd-proxmox#1995.
QWEN35_LOG = {
    "contexts": (131072,),
    "tp": 2,
    "kv_dtype": "fp8",
    "kv_cache_memory_bytes": round(4.99 * GiB),
    "gpu_mem_bytes": 4096 * GiB,
    "max_num_batched_tokens": 8192,
}


def test_hybrid_token_report_before_and_since_0_20():
    new = _plan("qwen3.5-27b", vllm_version="0.27", **QWEN35_LOG)
    old = _plan("qwen3.5-27b", vllm_version="0.19", **QWEN35_LOG)
    blocks = new.fit.num_blocks()
    assert new.fit.vllm(131072).kv_cache_tokens == int(blocks / 90 * 131072)  # max_concurrency x L
    assert old.fit.vllm(131072).kv_cache_tokens == blocks // 4 * 1568  # num_blocks // groups x block size


# --- a float32-state hybrid, by hand ----------------------------------------------------
def test_float32_state_hybrid_qwen35_27b_matches_the_log():
    """vLLM logs block 1568, 302,921 tokens and 2.31x at 131,072 for QWEN35_LOG."""
    r = _plan("qwen3.5-27b", vllm_version="0.27", **QWEN35_LOG)
    key, value, heads = 16 * 128, 48 * 128, 48
    conv = (2 * key + value) * (4 - 1) // 2 * 2  # conv state, split over 2 ranks, bf16
    ssm = heads * 128 * 128 // 2 * 4  # the recurrent state in float32 (mamba_ssm_dtype)
    attn_per_token = 4 // 2 * 256 * 2 * 1  # 2 KV heads per rank x 256 x (K, V) x 1 B fp8
    block = math.ceil((conv + ssm) / attn_per_token / 16) * 16
    assert block == 1568 == r.fit.layout.block_size
    blocks = round(4.99 * GiB) // (16 * block * attn_per_token)  # 16 layers per group share each block
    assert blocks == r.fit.num_blocks() == 208
    per_request = math.ceil(131072 / block) + 3 * 2  # attention blocks + 2 per state group (prefix caching)
    c = r.fit.vllm(131072)
    assert c.blocks_per_request == per_request == 90
    assert c.kv_cache_tokens == int(blocks / per_request * 131072) == 302921
    assert round(c.max_concurrency_log, 2) == 2.31
    # counted as bf16 (2 bytes, the bug issue 31 names) the block halves and the pool grows ~4%
    bf16 = _plan("qwen3.5-27b", vllm_version="0.27", mamba_ssm_cache_dtype="bfloat16", **QWEN35_LOG)
    assert bf16.fit.layout.block_size == math.ceil((conv + ssm // 2) / attn_per_token / 16) * 16 == 800


def test_tiny_float32_hybrid_state_bytes():
    h = tiny(TINY_HYBRID)
    state = next(l for l in h.layers if l.kind == "linear_state")
    assert state.ssm_dtype_bytes == 4 and state.conv_dtype_bytes == 2
    assert state.ssm_state_elements == 8 * 32 * 32  # value heads x key dim x value dim


def test_pipeline_stages_profile_apart():
    r = _plan("llama-3.1-8b", pp=2, num_gpus=2, vllm_version="0.32", model_runner="v1")
    first, last = r.profiles
    assert first.activation.sampler_bytes == 0 and last.activation.sampler_bytes > 0
    assert "Triton top-k/top-p buffer" not in first.non_torch and "Triton top-k/top-p buffer" in last.non_torch
    v2 = _plan("llama-3.1-8b", pp=2, num_gpus=2, vllm_version="0.32").profiles  # Model Runner V2, 0.32's default
    assert PENALTY not in v2[0].non_torch and v2[1].non_torch[PENALTY] == 1024 * (128256 + 128256 // 32) * 4
    # the embedding sits on the first stage, the LM head on the last: 128,256 x 4096 x 2 B each
    assert abs(first.weights - last.weights) < 2**20
    assert r.fit.num_blocks() == min(vm_blocks(r, i) for i in range(2))


def vm_blocks(r, stage):
    p = r.profiles[stage]
    return p.available // (16 * 16 * 8 * 256 * 2)  # 16 layers x 16 tokens x 8 KV heads x (K 128 + V 128) x 2 B


# --- Model Runner V2 -------------------------------------------------------------------
PENALTY = "penalty state, Model Runner V2"


@pytest.mark.parametrize(
    "version, qwen3, llama, qwen2, qwen2_moe, gpt_oss, hybrid",
    [
        ("0.21", False, False, False, False, False, False),
        ("0.22", True, False, False, False, False, False),  # Qwen3 dense first (#39337)
        ("0.23", True, True, False, False, False, False),  # + Llama, Mistral (#43458)
        ("0.24", True, True, False, True, False, False),  # + Qwen2-MoE / DeepSeek-V2 / Granite MoE (assumed)
        ("0.25", True, True, True, True, False, False),  # every dense model (#44443)
        ("0.28", True, True, True, True, False, False),
        ("0.29", True, True, True, True, True, True),  # every family (#53183)
    ],
)
def test_model_runner_v2_default_by_release(version, qwen3, llama, qwen2, qwen2_moe, gpt_oss, hybrid):
    p = policy(version)
    dense = {"moe": False, "hybrid": False, "attention_free": False}
    assert p.model_runner_v2("qwen3", **dense) is qwen3
    assert p.model_runner_v2("llama", **dense) is llama
    assert p.model_runner_v2("qwen2", **dense) is qwen2
    assert p.model_runner_v2("qwen2_moe", moe=True, hybrid=False, attention_free=False) is qwen2_moe
    assert p.model_runner_v2("gpt_oss", moe=True, hybrid=False, attention_free=False) is gpt_oss
    assert p.model_runner_v2("qwen3_5_text", moe=False, hybrid=True, attention_free=False) is hybrid
    assert p.model_runner_v2("mamba", moe=False, hybrid=False, attention_free=True) is (version == "0.29")


def test_v2_sampler_samples_the_logits_as_they_are():
    s = tiny()
    rows, tokens = 16, 512
    held = tokens * 256 * 2 + rows * 256 * 2
    # no float32 copy, no top-k / top-p pass: the bf16 logits (and at TP 2 the gathered shard)
    assert vm.sampler_bytes(s, rows, tokens, 1, NEW, runner_v2=True) == held + rows * 1000 * 2
    assert vm.sampler_bytes(s, rows, tokens, 2, NEW, runner_v2=True) == held + rows * 1000 * 2 + rows * 500 * 2
    act = vm.activation(s, engine(mnbt=16, seqs=16, model_runner_v2=True), range(4), 1, True, NEW)
    assert act.sampler_bytes == 16 * 256 * 2 * 2 + 16 * 1000 * 2 and act.forward_bytes == 16 * 3584 * 2


def test_v2_penalty_state_is_charged_since_0_27():
    s = tiny()
    e = engine(mnbt=512, seqs=256, model_runner_v2=True)
    parts, _ = vm.non_torch(s, e, "9.0", 1, True, NEW)
    # int32 output_bin_counts (256, 1000) and prompt_bin_mask (256, cdiv(1000, 32) = 32); no Triton buffer
    assert parts == {"cuBLAS + cuBLASLt workspaces": 2 * 32 * MiB, PENALTY: 256 * (1000 + 32) * 4}
    assert vm.non_torch(s, e, "9.0", 1, True, policy("0.27"))[0][PENALTY] == 256 * 1032 * 4
    # 0.26: allocated, but the profile charged weights + torch peak increase + non-torch increase only
    assert vm.non_torch(s, e, "9.0", 1, True, policy("0.26"))[0] == {"cuBLAS + cuBLASLt workspaces": 2 * 32 * MiB}
    assert PENALTY not in vm.non_torch(s, e, "9.0", 1, False, NEW)[0]  # the sampler lives on the last stage
    assert not policy("0.26").persistent_buffers_counted and policy("0.27").persistent_buffers_counted


def test_v2_graphs_estimated_only_since_0_29():
    # V2's profile_cudagraph_memory returns 0 in 0.21-0.28: the same graphs, nothing subtracted
    s = tiny()
    e = engine(model_runner_v2=True)
    before = vm.cudagraphs(s, e, range(4), 1, "9.0", policy("0.28"))
    since = vm.cudagraphs(s, e, range(4), 1, "9.0", policy("0.29"))
    per_graph = 4 * vm.GRAPH_BYTES_PER_LAYER["attention"]
    estimate = 32 * 3584 * 2 + per_graph + (7 + 5 - 1) * per_graph  # as test_profile_sums_each_term
    assert before.estimate_bytes == since.estimate_bytes == estimate
    assert before.subtracted_bytes == 0 and since.subtracted_bytes == estimate
    v1 = vm.cudagraphs(s, engine(), range(4), 1, "9.0", policy("0.28"))
    assert v1.subtracted_bytes == estimate  # V1 subtracts since 0.21
    assert not policy("0.28").v2_cudagraph_estimate and policy("0.29").v2_cudagraph_estimate


def test_v2_graph_policy_moves_available_by_the_estimate():
    # Llama-3.1-8B runs on V2 from 0.23; 0.28 and 0.29 differ (for it) only in V2's graph estimate
    a, b = _plan(vllm_version="0.28", mem_util=0.9), _plan(vllm_version="0.29", mem_util=0.9)
    assert a.fit.model_runner_v2() and b.fit.model_runner_v2()
    pa, pb = a.profiles[0], b.profiles[0]
    assert pa.cudagraphs.subtracted_bytes == 0 and pb.cudagraphs.subtracted_bytes == pb.cudagraphs.estimate_bytes > 0
    assert pa.available - pb.available == pb.cudagraphs.estimate_bytes
    assert any("does not estimate its CUDA graphs" in n for n in pa.notes)
    assert not any("CUDA graphs" in n for n in pb.notes)


def test_plan_picks_the_runner_and_honours_the_override():
    assert _plan("llama-3.1-8b", vllm_version="0.32").fit.model_runner_v2()
    assert not _plan("llama-3.1-8b", vllm_version="0.22").fit.model_runner_v2()
    assert _plan("qwen3-8b", vllm_version="0.22").fit.model_runner_v2()
    assert not _plan("gpt-oss-20b", vllm_version="0.28").fit.model_runner_v2()  # MoE, not in 0.28's list
    assert _plan("gpt-oss-20b", vllm_version="0.29").fit.model_runner_v2()
    assert not _plan("qwen3.5-27b", vllm_version="0.27").fit.model_runner_v2()  # hybrid
    assert not _plan("llama-3.1-8b", vllm_version="0.32", model_runner="v1").fit.model_runner_v2()
    assert _plan("llama-3.1-8b", vllm_version="0.21", model_runner="v2").fit.model_runner_v2()
    with pytest.raises(BadInput, match="--model-runner 'v3' not known; accepted: v1, v2"):
        _plan(model_runner="v3")


def test_v1_and_v2_profiles_differ_by_the_sampler_and_the_penalty_state():
    # Llama-3.1-8B on the H100 preset (vllm serve: 8192 tokens, 1024 sequences), vLLM 0.32
    v1 = _plan("llama-3.1-8b", vllm_version="0.32", model_runner="v1").profiles[0]
    v2 = _plan("llama-3.1-8b", vllm_version="0.32").profiles[0]
    rows, vocab, h = 1024, 128256, 4096
    assert v1.activation.sampler_bytes - v2.activation.sampler_bytes == rows * vocab * (4 + 8)  # f32 + probs/noise
    assert v2.activation.bytes == v2.activation.forward_bytes == 8192 * (2 * h + 3 * 14336) * 2
    assert v2.non_torch[PENALTY] == rows * (vocab + vocab // 32) * 4
    assert v1.non_torch["Triton top-k/top-p buffer"] == 132 * vocab * 4
