"""Speculative decoding's KV cache against a real vLLM 0.32 CPU engine: one engine start
(tests/kv_spec_vllm_worker.py, about 35 s here) with a draft model and a fixed KV cache.
vLLM's own log lines ("CPU KV cache size: N tokens, Maximum concurrency for L tokens per
request: X") and its KV cache config (blocks) are the oracle; kv-budget's prediction for
the same target, draft and settings must match them within 1% (the block count exactly),
and the prediction without the draft must not.

Needs the vLLM environment (`make vllm-env`, which `make test` runs first), or
INFER_TOOL_VLLM_PYTHON pointing at its Python."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from infer_tool.jobs.kv_budget import PlanRequest, plan
from infer_tool.sizing.speculative import parse_speculative_config
from infer_tool.sizing.vllm_log import parse_log

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("INFER_TOOL_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
TIMEOUT_S = 300
KV_BYTES = 64 * 2**20
MML, K = 1024, 2
BASE = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
TARGET = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
DRAFT = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


def test_draft_model_kv_matches_a_vllm_cpu_engine(tmp_path):
    assert VLLM_PYTHON.exists(), (
        f"{VLLM_PYTHON} not found: build the vLLM environment (`make vllm-env`, which `make test` does first), "
        "or set INFER_TOOL_VLLM_PYTHON"
    )
    dirs = {}
    for name, cfg in (("target", TARGET), ("draft", DRAFT)):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**BASE, **cfg}))
        dirs[name] = d
    r = subprocess.run(
        [
            str(VLLM_PYTHON),
            str(ROOT / "tests" / "kv_spec_vllm_worker.py"),
            str(dirs["target"]),
            str(dirs["draft"]),
            str(K),
            str(KV_BYTES),
            str(MML),
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    engine = json.loads(next(line for line in reversed(r.stdout.splitlines()) if line.startswith('{"num_blocks"')))
    log = parse_log(r.stdout + r.stderr)  # vLLM 0.32's own lines (it logs to stdout), read by kv-budget's reader
    assert log.version is None or log.version.startswith("0.32")
    assert log.kv_tokens and log.concurrency and log.concurrency[0] == MML
    assert sum(g["layers"] for g in engine["groups"]) == TARGET["num_hidden_layers"] + DRAFT["num_hidden_layers"]

    def predict(spec: bool):
        sc = parse_speculative_config(json.dumps({"model": str(dirs["draft"]), "num_speculative_tokens": K}))
        req = PlanRequest(
            str(dirs["target"]),
            gpu_mem_bytes=64 * 2**30,
            kv_cache_memory_bytes=KV_BYTES,
            block_size=engine["groups"][0]["block_size"],  # the CPU backend's 128
            contexts=(MML,),
            concurrencies=(1,),
            max_num_seqs=4,
            max_num_batched_tokens=MML,
            enforce_eager=True,
            speculative_config=sc if spec else None,
        )
        return plan(req, fixes=False).fit.vllm(MML)

    with_draft, without = predict(True), predict(False)
    assert with_draft.num_blocks == engine["num_blocks"]
    assert with_draft.kv_cache_tokens == pytest.approx(log.kv_tokens, rel=0.01)
    assert with_draft.max_concurrency_log == pytest.approx(log.concurrency[1], rel=0.01)
    # the draft's layers are what the engine measured: without them the prediction is 25% off
    assert without.max_concurrency_log > log.concurrency[1] * 1.2
