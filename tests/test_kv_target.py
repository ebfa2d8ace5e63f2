"""--target-concurrency / --target-context (issue 60): the flags suggested for a target,
fed back into the planner, serve the target; one step less does not (the smallest)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infer_tool.cli.app import app
from infer_tool.common.errors import BadInput
from infer_tool.jobs.kv_budget import PlanRequest, plan, reach_target, replay_log

runner = CliRunner()
LOGS = Path(__file__).resolve().parent / "fixtures" / "kv_logs"


def _serves(req: PlanRequest, s, **override) -> bool:
    r = plan(
        replace(
            req,
            contexts=(s.max_model_len,),
            concurrencies=(s.concurrency,),
            max_num_seqs=s.max_num_seqs,
            **override,
        ),
        fixes=False,
    )
    return r.rows[0].fit.fits and r.fit.max_concurrency(s.max_model_len) >= s.concurrency


@pytest.mark.parametrize(
    "req, conc, ctx",
    [
        (PlanRequest("llama-3.1-8b", contexts=(8192,)), 32, None),  # a concurrency target
        (PlanRequest("qwen3-8b", gpu="L40S"), None, 32768),  # a context target
        (PlanRequest("gemma-2-9b", gpu="A100-80GB"), 16, 8192),  # both, a sliding-window model
        (PlanRequest("qwen3-next-80b-a3b", gpu="H200", tp=2), 60, 65536),  # both, hybrid, TP 2
        (PlanRequest("qwen3-0.6b", gpu="L40S"), 300, 512),  # above vllm serve's 256 sequences on an L40S
    ],
    ids=["concurrency", "context", "both-sliding", "both-hybrid-tp2", "above-seq-default"],
)
def test_suggestion_fed_back_meets_the_target(req, conc, ctx):
    s = reach_target(req, conc, ctx)
    assert s.feasible, s.limit
    assert s.concurrency == (conc or 1) and s.max_model_len == (ctx or req.contexts[-1])
    assert s.max_num_seqs >= s.concurrency
    assert _serves(req, s, mem_util=s.mem_util)
    assert _serves(req, s, kv_cache_memory_bytes=s.kv_cache_memory_bytes)
    # the smallest: one percent less utilization, or one block less of KV, misses it
    assert not _serves(req, s, mem_util=round(s.mem_util - 0.01, 2))
    block = plan(replace(req, contexts=(s.max_model_len,), concurrencies=(1,))).fit.bytes_per_block()
    assert not _serves(req, s, kv_cache_memory_bytes=s.kv_cache_memory_bytes - block)
    line = s.serve_flags()
    assert f"--max-model-len {s.max_model_len}" in line and f"--gpu-memory-utilization {s.mem_util:.2f}" in line
    assert f"--kv-cache-memory-bytes {s.kv_cache_memory_bytes}" in s.serve_flags_fixed_kv()
    assert s.costs


def test_an_unreachable_target_says_what_fits():
    req = PlanRequest("llama-3.1-8b", contexts=(8192,))
    s = reach_target(req, 2000, 8192)
    assert not s.feasible and s.mem_util is None
    r = plan(replace(req, contexts=(8192,), concurrencies=(2000,), max_num_seqs=2000, mem_util=0.95))
    assert f"serves {r.fit.max_concurrency(8192):,} sequences of 8,192 tokens" in s.limit


def test_target_on_a_logged_server():
    rep = replay_log((LOGS / "qwen3-8b-a100-40gb-0.19.1.log").read_text())
    s = reach_target(rep.report.request, 2, 40960)
    assert s.feasible and _serves(rep.report.request, s, mem_util=s.mem_util)
    assert s.mem_util <= 0.9  # the logged server holds 3.44 of them at 0.9


def test_cli_target_json_and_refusals():
    r = runner.invoke(
        app, ["kv-budget", "llama-3.1-8b", "--target-concurrency", "16", "--target-context", "16k", "--json"]
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["feasible"] and doc["max_model_len"] == 16384 and "--max-model-len 16384" in doc["vllm_serve_flags"]
    r = runner.invoke(app, ["kv-budget", "llama-3.1-8b", "--target-context", "²k"])
    assert r.exit_code == 2 and "--target-context" in r.stderr
    r = runner.invoke(app, ["kv-budget", "llama-3.1-8b", "--target-concurrency", "0"])
    assert r.exit_code == 2 and "--target-concurrency 0" in r.stderr
    with pytest.raises(BadInput, match="accounting vllm"):
        reach_target(PlanRequest("llama-3.1-8b", accounting="plain"), 4, 4096)
