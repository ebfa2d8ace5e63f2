"""sizing/roofline: the step-time arithmetic by hand on a toy shape, speculative
decoding folded into TPOT, and predicted vs published decode throughput for real
deployments (sources named in benchmarks/published_speed.json, one per row below)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infer_tool.common.errors import BadInput
from infer_tool.sizing.hf_config import shape_from_config
from infer_tool.sizing.presets import gpu_preset
from infer_tool.sizing.resolve import resolve_model
from infer_tool.sizing.roofline import Efficiency, Hardware, Speculation, Workload, step_times

TOY = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size": 256,
    "intermediate_size": 512,
    "vocab_size": 1000,
    "tie_word_embeddings": False,
}
HW = Hardware("toy", hbm_bytes_per_s=1e12, flops={"bf16": 1e14}, link_bytes_per_s=1e11)
EFF = Efficiency(hbm=0.5, mfu=0.5, link=0.5, allreduce_latency_s=1e-6)


def test_decode_step_and_prefill_by_hand():
    shape = shape_from_config(TOY, "toy")
    p = shape.params
    t = step_times(shape, HW, Workload(prompt_len=100, output_len=50, batch=4), eff=EFF)
    weights = 2 * p.total  # bf16
    ctx = 100 + 50 / 2
    kv_seq = 2 * 2 * 2 * 64 * 2 * ctx  # layers x K,V x heads x head_dim x 2 B x tokens
    assert t.memory_s == pytest.approx((weights + 4 * kv_seq) / (1e12 * 0.5))
    linear = 2 * p.linear_params  # FLOPs per token
    attn = 2 * 2 * 4 * 128 * ctx  # layers x 2 x heads x (K + V width) x keys
    assert t.compute_s == pytest.approx(4 * (linear + attn) / (1e14 * 0.5))
    assert t.decode_step_s == pytest.approx(max(t.memory_s, t.compute_s)) and t.comm_s == 0
    prefill_flops = 100 * linear + 2 * 2 * 4 * 128 * (101 / 2) * 100
    assert t.prefill_s == pytest.approx(max(prefill_flops / 5e13, weights / 5e11))
    # continuous batching: 4 / 50 new prompts per step add their prefill
    assert t.tpot_s == pytest.approx(t.decode_step_s + 4 / 50 * t.prefill_s)
    assert t.output_tokens_per_s == pytest.approx(4 / t.tpot_s)


def test_tensor_parallel_all_reduce_by_hand():
    shape = shape_from_config(TOY, "toy")
    one = step_times(shape, HW, Workload(10, 10, batch=8), eff=EFF)
    two = step_times(shape, HW, Workload(10, 10, batch=8), eff=EFF, tp=2)
    msg = 8 * 256 * 2
    assert two.comm_s == pytest.approx(2 * 2 * ((2 - 1) / 2 * 2 * msg / 5e10 + 1e-6))  # 2 layers x 2 calls
    assert two.memory_s < one.memory_s


def test_speculation_folds_tokens_per_pass_into_tpot():
    s = Speculation(alpha=0.8, k=4, cost_ratio=0.05)
    assert s.tokens_per_pass == pytest.approx((1 - 0.8**5) / (1 - 0.8))
    shape = resolve_model("llama-3.1-8b").shape
    hw = Hardware.from_preset(gpu_preset("H100-80GB"))
    plain = step_times(shape, hw, Workload(1000, 1000, batch=1))
    spec = step_times(shape, hw, Workload(1000, 1000, batch=1, spec=s))
    verify = spec.terms["pass_s"] - 4 * 0.05 * plain.decode_step_s
    assert spec.tpot_s == pytest.approx(
        (verify + 4 * 0.05 * plain.decode_step_s) / s.tokens_per_pass + spec.terms["prefill_interference_s"]
    )
    assert spec.tpot_s < plain.tpot_s  # memory-bound: verifying 5 tokens costs about one step
    with pytest.raises(BadInput):
        Speculation(alpha=1.5, k=4, cost_ratio=0.1)


def test_moe_reads_every_expert_but_multiplies_the_active_ones():
    shape = resolve_model("mixtral-8x7b").shape
    hw = Hardware.from_preset(gpu_preset("H100-80GB"))
    t = step_times(shape, hw, Workload(100, 100, batch=256), tp=2)
    dense_flops = 2 * shape.params.linear_params / 2
    assert t.compute_s < 256 * dense_flops / (hw.flops["bf16"] * 0.5)  # active < all


def test_gpu_without_datasheet_speed_is_refused():
    with pytest.raises(BadInput, match="no speed model"):
        Hardware.from_preset(gpu_preset("A10G"))


PUBLISHED = json.loads((Path(__file__).parents[1] / "benchmarks" / "published_speed.json").read_text())["rows"]


@pytest.mark.parametrize(
    "row", PUBLISHED, ids=[f"{r['model']}-{r['gpu']}-c{r['concurrency']}-{r['prompt']}" for r in PUBLISHED]
)
def test_decode_throughput_within_25_percent_of_published(row):
    """Source of each row: row["source"] (NVIDIA NIM benchmarking docs for Llama-3.3-70B
    -- the Llama-3.1-70B architecture -- on 2 x H100 FP8 TP2; J. Musgrave's vLLM 0.23
    sweep of Llama-3.1-8B BF16 on an A100 40GB)."""
    shape = resolve_model(row["model"]).shape
    t = step_times(
        shape,
        Hardware.from_preset(gpu_preset(row["gpu"])),
        Workload(row["prompt"], row["output"], row["concurrency"]),
        weights=row["weights"],
        tp=row["tp"],
    )
    published = row.get("decode_tok_s") or row["concurrency"] * 1000 / row["itl_ms"]
    assert abs(t.output_tokens_per_s / published - 1) <= 0.25, (t.output_tokens_per_s, published)
    if "ttft_ms" in row:
        assert abs(t.ttft_s * 1e3 / row["ttft_ms"] - 1) <= 0.25


def test_tied_output_projection_costs_flops_not_memory():
    """A tied lm_head is stored once (in the embedding) but every token still multiplies by
    it: same FLOPs as the untied model, vocab x hidden fewer bytes."""
    untied = shape_from_config(TOY, "untied")
    tied = shape_from_config({**TOY, "tie_word_embeddings": True}, "tied")
    assert untied.params.total - tied.params.total == 1000 * 256
    assert tied.params.matmul_params == untied.params.matmul_params == untied.params.linear_params
    w = Workload(prompt_len=100, output_len=50, batch=512)
    t_untied, t_tied = step_times(untied, HW, w, eff=EFF), step_times(tied, HW, w, eff=EFF)
    assert t_tied.compute_s == pytest.approx(t_untied.compute_s)
    assert t_tied.memory_s < t_untied.memory_s
