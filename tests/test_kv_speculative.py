"""--speculative-config (issue 60): vLLM's JSON, and the memory it adds — the drafter's
weights, its KV layers (counted in max concurrency) and the lookahead slots — checked
against arithmetic on the published configs, and the CUDA-graph list of vLLM 0.32's
`_set_cudagraph_sizes` with (1 + k)-token decode steps counted by hand."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from infer_tool.cli.app import app
from infer_tool.common.errors import BadInput
from infer_tool.jobs.kv_budget import PlanRequest, plan
from infer_tool.sizing.presets import find_model_preset
from infer_tool.sizing.speculative import parse_speculative_config as parse
from infer_tool.sizing.vllm_memory import ProfileEngine, capture_sizes, uniform_decode_sizes

runner = CliRunner()
GiB = 2**30


@pytest.mark.parametrize(
    "text, method, k, lookahead",
    [
        ('{"model": "qwen3-0.6b", "num_speculative_tokens": 4}', "draft_model", 4, 4),
        (
            '{"method": "eagle3", "model": "x", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}',
            "eagle3",
            3,
            3,
        ),
        ('{"method": "mtp", "num_speculative_tokens": 1}', "mtp", 1, 1),
        ('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}', "ngram", 5, 0),
    ],
)
def test_parses_vllms_json(text, method, k, lookahead):
    sc = parse(text)
    assert (sc.method, sc.num_speculative_tokens, sc.lookahead_tokens, sc.decode_query_len) == (
        method,
        k,
        lookahead,
        k + 1,
    )


@pytest.mark.parametrize(
    "text, words",
    [
        ("{method: eagle}", "is not JSON"),
        ("[1]", "must be a JSON object"),
        ('{"method": "lookahead", "num_speculative_tokens": 2}', "method 'lookahead' is not modelled"),
        ('{"method": "mtp"}', "num_speculative_tokens None"),
        ('{"method": "mtp", "num_speculative_tokens": true}', "num_speculative_tokens True"),
        ('{"method": "mtp", "num_speculative_tokens": 0}', "num_speculative_tokens 0"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', 'needs "model"'),
        ('{"method": "mtp", "num_speculative_tokens": 2, "speed": 9}', "keys ['speed']"),
        (
            '{"model": "x", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 0}',
            "draft_tensor_parallel_size 0",
        ),
    ],
)
def test_refuses_what_vllm_would_not_take(text, words):
    with pytest.raises(BadInput, match=words.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        parse(text)


def _cfg(key: str) -> dict:
    return find_model_preset(key).config


def _per_token(c: dict) -> int:
    """Published config -> K and V bytes per token, bf16 (the oracle: no code of ours)."""
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head * 2


def test_draft_model_adds_weights_and_kv_and_lowers_concurrency():
    target, draft = _cfg("qwen3-8b"), _cfg("qwen3-0.6b")
    sc = parse('{"model": "qwen3-0.6b", "num_speculative_tokens": 4}')
    kv = 40 * GiB  # the same KV memory for both: concurrency scales with bytes per token
    base = plan(PlanRequest("qwen3-8b", contexts=(8192,), concurrencies=(1,), kv_cache_memory_bytes=kv))
    spec = plan(
        PlanRequest("qwen3-8b", contexts=(8192,), concurrencies=(1,), kv_cache_memory_bytes=kv, speculative_config=sc)
    )
    assert sum(base.fit.planner.bytes_per_token_by_kind().values()) == _per_token(target)
    assert sum(spec.fit.planner.bytes_per_token_by_kind().values()) == _per_token(target) + _per_token(draft)
    assert spec.drafter.kv_bytes_per_token == _per_token(draft) and spec.drafter.layers == draft["num_hidden_layers"]
    # Qwen3-0.6B: 0.6B parameters (Qwen's model card), in bf16
    assert spec.drafter.weight_bytes_per_gpu / 2 == pytest.approx(0.6e9, rel=0.02)
    assert spec.weights_total - base.weights_total == spec.drafter.weight_bytes_per_gpu
    ratio = _per_token(target) / (_per_token(target) + _per_token(draft))
    before, after = base.fit.vllm(8192).max_concurrency_log, spec.fit.vllm(8192).max_concurrency_log
    assert after == pytest.approx(before * ratio, rel=0.01)
    assert spec.max_concurrency[8192] <= int(after) and spec.max_concurrency[8192] < base.max_concurrency[8192]
    assert spec.drafter.lookahead_tokens == 4


def test_eagle_head_adds_its_layers(tmp_path):
    # an EAGLE-3 head for Llama-3.1-8B: one decoder layer with the target's attention shape
    head = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": 1,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
    }
    (tmp_path / "config.json").write_text(json.dumps(head))
    sc = parse(json.dumps({"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 3}))
    r = plan(PlanRequest("llama-3.1-8b", contexts=(8192,), concurrencies=(1,), speculative_config=sc))
    assert r.drafter.kv_bytes_per_token == 1 * 2 * 8 * 128 * 2
    assert sum(r.fit.planner.bytes_per_token_by_kind().values()) == 131072 + 4096
    assert r.drafter.lookahead_tokens == 3


def test_mtp_adds_the_targets_own_layers():
    c = _cfg("deepseek-v3")
    sc = parse('{"method": "mtp", "num_speculative_tokens": 1}')
    base = plan(PlanRequest("deepseek-v3", gpu="H200", tp=8, pp=2, contexts=(4096,), concurrencies=(1,)))
    r = plan(
        PlanRequest("deepseek-v3", gpu="H200", tp=8, pp=2, contexts=(4096,), concurrencies=(1,), speculative_config=sc)
    )
    latent = (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2  # one MLA latent per token, bf16, on every rank
    added = sum(r.fit.planner.bytes_per_token_by_kind().values()) - sum(
        base.fit.planner.bytes_per_token_by_kind().values()
    )
    assert added == c["num_nextn_predict_layers"] * latent * 8  # all 8 TP ranks hold it
    with pytest.raises(BadInput, match="no num_nextn_predict_layers"):
        plan(PlanRequest("qwen3-8b", speculative_config=sc))


def test_cudagraph_sizes_with_speculative_decode_steps():
    # max_num_seqs 8, k 3 (4 tokens per decode step), 2048 batched tokens: ceiling min(8 x 4 x 2, 512) = 64;
    # [1, 2, 4] + 8..64 step 8 (8 sizes) = 11; FULL at request counts [1, 2, 4, 8] x 4 = [4, 8, 16, 32]
    e = ProfileEngine(max_num_batched_tokens=2048, max_num_seqs=8, decode_query_len=4)
    assert capture_sizes(e, "9.0") == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert uniform_decode_sizes(e, "9.0") == [4, 8, 16, 32]
    # without speculation the same engine captures [1, 2, 4, 8, 16] and FULL up to 8
    plain = ProfileEngine(max_num_batched_tokens=2048, max_num_seqs=8)
    assert capture_sizes(plain, "9.0") == (1, 2, 4, 8, 16)


def test_methods_v2_does_not_support_fall_back_to_v1():
    for method, v2 in (("suffix", False), ("ngram", True)):
        sc = parse(json.dumps({"method": method, "num_speculative_tokens": 2}))
        r = plan(PlanRequest("qwen3-8b", contexts=(4096,), concurrencies=(1,), speculative_config=sc))
        assert r.fit.model_runner_v2() is v2


def test_cli_speculative_config():
    spec = '{"model": "qwen3-0.6b", "num_speculative_tokens": 4}'
    r = runner.invoke(app, ["kv-budget", "qwen3-8b", "--context", "8k", "--speculative-config", spec, "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["speculative_decoding"]["kv_layers_added"] == 28
    assert doc["speculative_decoding"]["lookahead_tokens_per_request"] == 4
    human = runner.invoke(app, ["kv-budget", "qwen3-8b", "--context", "8k", "--speculative-config", spec])
    assert human.exit_code == 0 and "drafter weights" in human.stdout
    bad = runner.invoke(app, ["kv-budget", "qwen3-8b", "--speculative-config", "{nope"])
    assert bad.exit_code == 2 and "--speculative-config" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
