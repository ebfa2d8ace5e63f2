"""`quantize --model-free` checkpoints served: the demo model and a tiny Qwen3-MoE, loaded and
scored by vLLM's CPU build (one worker run for every row, tests/vllm_formats.py's harness) and
by transformers + compressed-tensors, against our `eval ppl` on the same tokens.

The demo model is a GGUF; `--model-free` reads it as every command does (`resolve_model_dir`:
transformers dequantizes the GGUF once into a cached safetensors directory), so no GGUF reader is
needed in the model-free path. The tiny Qwen3-MoE is test_moe_vllm.py's (hidden and expert width
256, 8 experts, routers spread), with the demo's vocabulary and tokenizer so that one token window
serves every row. transformers saves its experts per expert (`mlp.experts.E.gate_proj.weight`,
2-D: its loader fuses them into 3-D parameters, its saver splits them again): model-free
quantizes each as a linear and writes per-expert compressed-tensors, the layout vLLM and
transformers load (asserted below).

Rows: the demo as W4A16 (group 64: K = 576), which vLLM's CPU build runs: vLLM's ppl within 1% of
ours. The MoE as W4A16, FP8_DYNAMIC and FP8_BLOCK (experts only): refused by vLLM 0.32's CPU build
exactly as the pipeline's checkpoints are (test_moe_vllm.py, whose expectations are reused):
without AMX no INT4 and no FP8 MoE backend; with AMX INT4 experts load (run W4A8) and block FP8
experts load (W8A16), scored there within test_moe_vllm's 5% (its reason: vLLM's W4A8 experts,
which ours does not emulate). transformers + compressed-tensors scores both W4A16 rows within 1%
of ours.

The demo's FP8_DYNAMIC is not a row here: tests/test_vllm.py asserts that `--model-free --scheme
FP8_DYNAMIC` of the demo writes the very bytes of its ct-fp8-channel row, which vLLM scores within
1% of ours on 2048 tokens. On this test's 512 tokens FP8 came -0.87% (vLLM) and -0.67%
(transformers) from ours: too near 1% for a CPU-independent bound on so short a window.

TOKENS: the first 512 tokens of sotu:eval (not the harness's 2048) keep this test lean. Measured
here (AMD EPYC, no AMX): demo W4A16 ours 32.303, vLLM 32.265 (-0.12%), transformers 32.192
(-0.34%); Qwen3-MoE W4A16 ours 54609.7, transformers 54621.2 (+0.02%) (/work/notes/issue-63d.md).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import vllm_formats  # noqa: E402
from test_moe_vllm import FP8_BLOCK_MOE, FP8_CHANNEL_MOE, INT4_MOE, NO_FP8_MOE, NO_INT4_MOE, moe_problems  # noqa: E402
from vllm_formats import INT4_AVX2, Row  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

TOKENS = 512
PPL_TOL = 0.01
ROWS = (  # (source, row)
    (
        "demo",
        Row(
            "mf-demo-int4",
            "demo, model-free W4A16 (group 64)",
            ("--scheme", "W4A16", "--group-size", "64"),
            **INT4_AVX2,
        ),
    ),
    (
        "qwen3_moe",
        Row(
            "mf-qwen3-int4",
            "Qwen3-MoE, model-free W4A16 (group 64)",
            ("--scheme", "W4A16", "--group-size", "64"),
            NO_INT4_MOE,
            refusal_needs_no_amx=True,
            kernels=INT4_MOE[False],
            amx_kernels=INT4_MOE[True],
        ),
    ),
    (
        "qwen3_moe",
        Row(
            "mf-qwen3-fp8",
            "Qwen3-MoE, model-free FP8_DYNAMIC",
            ("--scheme", "FP8_DYNAMIC"),
            NO_FP8_MOE,
            kernels=FP8_CHANNEL_MOE,
            torch_scaled_mm=True,
        ),
    ),
    (
        "qwen3_moe",
        Row(
            "mf-qwen3-fp8-block",
            "Qwen3-MoE, model-free FP8_BLOCK, experts only",
            ("--scheme", "FP8_BLOCK", "--ignore", "re:.*self_attn.*"),
            NO_FP8_MOE,
            refusal_needs_no_amx=True,
            kernels=FP8_BLOCK_MOE[False],
            amx_kernels=FP8_BLOCK_MOE[True],
        ),
    ),
)
TRANSFORMERS = ("mf-demo-int4", "mf-qwen3-int4")  # rows transformers + compressed-tensors scores


def save_qwen3_moe(path: Path, demo: Path) -> Path:
    """test_moe_vllm.py's tiny Qwen3-MoE with the demo model's vocabulary and tokenizer."""
    import torch
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(demo)
    config = tf.Qwen3MoeConfig(
        vocab_size=tf.AutoConfig.from_pretrained(demo).vocab_size,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        intermediate_size=256,
        moe_intermediate_size=256,
        num_experts=8,
        head_dim=64,
    )
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.1)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _ppl(model, ids) -> float:  # noqa: ANN001
    from infer_tool.evals.ppl import evaluate_ppl

    return evaluate_ppl(model, ids, len(ids)).ppl


def test_model_free_checkpoints_in_vllm_and_transformers(tmp_path: Path) -> None:
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from infer_tool.calib.models import resolve_model_dir
    from infer_tool.evals.load_quantized import load_quantized

    laps, t0 = {}, time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal t0
        laps[stage], t0 = round(time.perf_counter() - t0, 1), time.perf_counter()

    try:
        python = vllm_formats.vllm_python()
    except vllm_formats.VllmEnvMissing as exc:
        pytest.fail(str(exc))
    demo, _ = resolve_model_dir(vllm_formats.MODEL)
    sources = {"demo": vllm_formats.MODEL, "qwen3_moe": save_qwen3_moe(tmp_path / "qwen3_moe", demo)}
    ckpts = {}
    for source, row in ROWS:
        ckpts[row.id] = tmp_path / row.id
        vllm_formats.cli(
            "quantize", sources[source], "--model-free", *row.args, "--out", ckpts[row.id], "--no-progress"
        )
    with safe_open(str(ckpts["mf-qwen3-int4"] / "model.safetensors"), "pt") as f:  # per-expert linears, as vLLM loads
        names = set(f.keys())
    assert {f"model.layers.1.mlp.experts.7.{p}.weight_packed" for p in ("gate_proj", "up_proj", "down_proj")} <= names
    assert not any(n.endswith(".weight") and ".experts." in n for n in names)
    lap("quantize")
    ids = vllm_formats.window_ids(ckpts["mf-demo-int4"])[:TOKENS]
    rows = tuple(row for _, row in ROWS)
    host, by_name = vllm_formats.run_vllm(python, tmp_path, ckpts, rows, ids)
    lap("vllm")
    window = torch.tensor(ids)
    bad, seen = [], {}
    for source, row in ROWS:
        rec = by_name[row.id]
        ours = None
        if rec.get("ppl") is not None or row.id in TRANSFORMERS:
            ours = _ppl(load_quantized(ckpts[row.id], dtype=torch.bfloat16)[0], window)
            lap(f"ours {row.id}")
        seen[row.id] = {"ours": ours, "vllm": rec.get("ppl"), "error": rec.get("error")}
        if source == "demo":
            res = vllm_formats.Result(row, ckpts[row.id], rec, ours=ours)
            bad += [
                m.replace("over 1%", f"over {PPL_TOL:.0%} ({TOKENS} tokens)") for m in vllm_formats.problems(res, host)
            ]
        else:
            bad += moe_problems(row, rec, host, ours)
        if row.id in TRANSFORMERS:
            hf = _ppl(AutoModelForCausalLM.from_pretrained(ckpts[row.id], dtype=torch.bfloat16).eval(), window)
            seen[row.id]["transformers"] = hf
            lap(f"transformers {row.id}")
            if abs(hf / ours - 1) > PPL_TOL:
                bad.append(f"{row.id}: transformers + compressed-tensors ppl {hf:.4f} vs ours {ours:.4f}, over 1%")
    print(f"host AMX {host.get('amx')}, AVX-512 {host.get('avx512')}: {seen}; seconds {laps}")
    assert not bad, f"host AMX {host.get('amx')}: " + "; ".join(bad) + f" ({seen})"
