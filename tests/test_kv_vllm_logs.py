"""The public vLLM start-up logs in benchmarks/kv_vllm_logs.json, used as data: every
case names its source and role, and the block accounting reproduces every logged KV cache
size within issue 31's 1% goal. The available-KV comparison (the default path) is the
benchmark's job (benchmarks/kv_vllm_memory.py), not a test: its misses are reported there."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from infer_tool.sizing.presets import gpu_presets
from infer_tool.sizing.resolve import resolve_model

ROOT = Path(__file__).resolve().parents[1]
CASES = json.loads((ROOT / "benchmarks" / "kv_vllm_logs.json").read_text())["cases"]
ROLES = {"calibration", "held-out", "kv-accounting"}


def _bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import kv_vllm_memory
    finally:
        sys.path.pop(0)
    return kv_vllm_memory


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_every_case_says_where_it_came_from(case):
    assert case["source"] and case["role"] in ROLES
    assert case["gpu"] is None or case["gpu"] in gpu_presets()
    resolve_model(case["model"])  # a preset this tool has
    if case["role"] == "calibration":
        assert case["calibrates"]


@pytest.mark.parametrize("case", [c for c in CASES if c["logged"].get("kv_tokens")], ids=lambda c: c["id"])
def test_block_accounting_reproduces_the_logged_kv_size(case):
    bench = _bench()
    r = bench.plan(bench._request(case, total_known=False))
    mml = case["engine"]["max_model_len"]
    cap = r.fit.vllm_at([round(g * 2**30) for g in case["logged"]["available_kv_gib"]], mml)
    assert cap.kv_cache_tokens == pytest.approx(case["logged"]["kv_tokens"], rel=0.01)
    if case["logged"].get("max_concurrency"):
        assert cap.max_concurrency_log == pytest.approx(case["logged"]["max_concurrency"], rel=0.01)


def test_sliding_window_request_matches_vllms_kv_needed_line():
    # gpt-oss-120b, 131,072 tokens, 1,024 batched tokens (vLLM 0.11, vllm-project/vllm#27508): 18 full layers
    # reserve cdiv(131072, 16) blocks, 18 sliding (window 128) cdiv(128 - 1 + 1024, 16) + 1; one block of a group
    # is 18 layers x 16 tokens x 8 KV heads x (64 + 64) x 2 B
    case = next(c for c in CASES if c["logged"].get("kv_needed_gib"))
    bench = _bench()
    r = bench.plan(bench._request(case, total_known=False))
    block = 18 * 16 * 8 * 128 * 2
    blocks = 131072 // 16 + (128 - 1 + 1024 + 15) // 16 + 1
    assert r.fit.vllm(131072).blocks_per_request == blocks and r.fit.bytes_per_block() == block
    assert round(blocks * block / 2**30, 2) == case["logged"]["kv_needed_gib"] == 4.54


def test_gpu_totals_cite_a_source_and_sit_under_the_driver_figure():
    for key, g in gpu_presets().items():
        if g.cuda_memory_bytes is not None:
            assert g.cuda_source, key
            assert g.cuda_memory_bytes <= g.memory_bytes, key


@pytest.mark.parametrize(
    "case_id, seqs, mnbt, counts",
    [
        # hand count: [1, 2, 4] + 8..248 step 8 (31) + 256..512 step 16 (17) = 51 PIECEWISE; <= 256: 35 FULL
        ("qwen3-8b-a5000", 256, 8192, (51, 35, 512)),
        # top = min(2 x 128, 512) = 256: [1, 2, 4] + 8..248 (31) + 256 = 35; <= 128: 3 + 16 = 19 FULL
        ("qwen2.5-7b-v1-0.22", 128, 2048, (35, 19, 256)),
        # top = 16: [1, 2, 4, 8, 16] = 5; <= 8: 4 FULL
        ("qwen3.6-27b-nvfp4-dgx-spark", 8, 65536, (5, 4, 16)),
    ],
)
def test_capture_sizes_give_the_logged_graph_counts(case_id, seqs, mnbt, counts):
    from infer_tool.sizing.vllm_memory import ProfileEngine, capture_sizes

    case = next(c for c in CASES if c["id"] == case_id)
    assert (case["engine"]["max_num_seqs"], case["engine"]["max_num_batched_tokens"]) == (seqs, mnbt)
    g = case["logged"]["cudagraphs"]
    assert (g["piecewise"], g["full"], g["largest"]) == counts
    sizes = capture_sizes(ProfileEngine(max_num_batched_tokens=mnbt, max_num_seqs=seqs), "8.9")
    assert (len(sizes), len([s for s in sizes if s <= seqs]), sizes[-1]) == counts


BREAKDOWNS = [c for c in CASES if "weights_gib" in (c["logged"].get("breakdown") or {}) and c.get("gpu_memory_gib")]


@pytest.mark.parametrize("case", BREAKDOWNS, ids=lambda c: c["id"])
def test_vllm_subtracts_the_terms_profile_subtracts(case):
    """vLLM's own logged numbers are the oracle of `vllm_memory.profile`'s decomposition:
    available = requested (total x mem_util) - weights - peak activation - non-torch, within the
    logs' rounding (0.01 GiB per term printed). The vLLM versions of these logs (0.11, one 0.26) log
    no CUDA-graph estimate subtracted before the KV cache, so that term is not checked here."""
    b = case["logged"]["breakdown"]
    requested = case["gpu_memory_gib"] * case["engine"]["mem_util"]
    left = requested - b["weights_gib"] - b["peak_activation_gib"] - b["non_torch_gib"]
    assert abs(left - case["logged"]["available_kv_gib"][0]) <= 0.02
