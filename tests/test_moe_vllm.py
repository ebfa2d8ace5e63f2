"""Quantized MoE checkpoints in the real serving engine (vLLM's CPU build, `.venv-vllm`),
with tests/vllm_worker.py as tests/test_vllm.py runs it.

vLLM 0.32's CPU fused-MoE kernels, INT4 (`CPUExpertsInt4`) and FP8 (`CPUExpertsFp8`), both
need AMX tiles (Sapphire Rapids or newer); AMD's zentorch path needs its ops. On a CPU
without them every quantized MoE checkpoint is refused while vLLM builds its fused-MoE
layer, with the message each row names: the test asserts exactly that, so that a vLLM that
starts accepting them fails here until the README is updated. On a CPU with AMX each must
load and score within 5% of our `eval ppl` (tiny random models, bf16 in vLLM).

The tiny Mixtral / Qwen3-MoE models are sized for vLLM's Marlin MoE checks (hidden and
expert width 256, group 64), so the refusal is the backend's, not a shape's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import vllm_formats  # noqa: E402
from tiny import TEXT, make_tokenizer  # noqa: E402
from vllm_formats import Row  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

NO_INT4_MOE = "NotImplementedError: No WNA16 MoE backend supports the deployment configuration."
NO_FP8_MOE = "ValueError: Unsupported FP8 MoE backend: NONE"
ROWS = (  # (family, row): every format we write for MoE
    ("mixtral", Row("mixtral-ct-int4", "compressed-tensors INT4", ("--method", "rtn", "--group-size", "64"), NO_INT4_MOE)),
    ("qwen3_moe", Row("qwen3-awq", "AWQ GEMM", ("--method", "rtn", "--asym", "--group-size", "64", "--format", "awq"), NO_INT4_MOE)),
    ("qwen3_moe", Row("qwen3-gptq", "GPTQ v1", ("--method", "rtn", "--sym", "--group-size", "64", "--format", "gptq"), NO_INT4_MOE)),
    ("qwen3_moe", Row("qwen3-ct-fp8", "compressed-tensors FP8", ("--method", "fp8"), NO_FP8_MOE)),
    # native FP8 experts only: per-tensor FP8 attention is refused by itself (tests/vllm_formats.py)
    ("mixtral", Row("mixtral-fp8", "native FP8 block 128x128, experts", ("--method", "fp8", "--fp8-granularity", "block",
                                                                         "--format", "fp8", "--ignore", "*.self_attn.*"),
                    NO_FP8_MOE)),
)


def save_family(path: Path, family: str) -> Path:
    import torch
    import transformers as tf

    tok = make_tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2, max_position_embeddings=512, tie_word_embeddings=False)
    if family == "mixtral":
        config = tf.MixtralConfig(**common, intermediate_size=256, num_local_experts=8)
    else:
        config = tf.Qwen3MoeConfig(**common, intermediate_size=256, moe_intermediate_size=256, num_experts=8, head_dim=64)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.1)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_quantized_moe_in_vllm(tmp_path: Path) -> None:
    try:
        python = vllm_formats.vllm_python()
    except vllm_formats.VllmEnvMissing as exc:
        pytest.fail(str(exc))
    (tmp_path / "calib.txt").write_text(TEXT * 8)
    sources = {f: save_family(tmp_path / f, f) for f in {f for f, _ in ROWS}}
    ckpts = {}
    for family, row in ROWS:
        ckpts[row.id] = tmp_path / row.id
        vllm_formats.cli("quantize", sources[family], *row.args, "--calib", tmp_path / "calib.txt", "--num-samples", "4",
                         "--seq-len", "64", "--out", ckpts[row.id], "--no-progress", "--device", "cpu")
    ids = list(range(1, 129))
    rows = tuple(row for _, row in ROWS)
    host, by_name = vllm_formats.run_vllm(python, tmp_path, ckpts, rows, ids)
    for row in rows:
        rec = by_name[row.id]
        if host.get("amx"):  # the CPU kernels exist: it must run as ours does, on the same tokens
            import torch

            from infer_tool.evals.ppl import evaluate_ppl
            from infer_tool.evals.load_quantized import load_quantized

            assert rec.get("loaded"), (row.id, rec)
            ours = evaluate_ppl(load_quantized(ckpts[row.id], dtype=torch.bfloat16)[0], torch.tensor(ids), len(ids)).ppl
            assert abs(rec["ppl"] / ours - 1) < 0.05, (row.id, rec["ppl"], ours)
        else:
            assert not rec["loaded"] and rec["stage"] == "load", (row.id, rec)
            assert rec["error"] == row.refusal, (row.id, rec["error"])
