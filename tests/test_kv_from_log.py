"""`kv-budget --from-log` on raw public vLLM start-up logs (tests/fixtures/kv_logs, each with
its source in SOURCES.json): the settings read from each log equal the ones recorded by hand
for the same log in benchmarks/kv_vllm_logs.json (an independent record); the block
accounting at the logged KV memory gives the logged concurrency within 1%; the predicted
available KV is within 5% (vLLM >= 0.21) or 10% (before) where the log states the GPU; a
difference above 2% is attributed to a named term. Unknown lines are ignored, missing ones
said, and a 1 MB log is answered in under a second without importing torch."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infer_tool.cli.app import app
from infer_tool.common.errors import BadInput
from infer_tool.jobs.kv_budget import replay_log
from infer_tool.sizing.vllm_log import parse_log

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "tests" / "fixtures" / "kv_logs"
SOURCES = json.loads((LOGS / "SOURCES.json").read_text())["logs"]
CASES = {c["id"]: c for c in json.loads((ROOT / "benchmarks" / "kv_vllm_logs.json").read_text())["cases"]}
GiB = 2**30
runner = CliRunner()


def _replay(name: str):
    meta = SOURCES[name]
    return replay_log((LOGS / name).read_text(), model=meta["model"], vllm_version=meta.get("vllm_version"))


def test_every_fixture_has_a_source_and_a_case():
    assert sorted(SOURCES) == sorted(p.name for p in LOGS.glob("*.log"))
    for name, meta in SOURCES.items():
        assert meta["source"] and meta["case"] in CASES, name
    bands = {m["band"] for m in SOURCES.values()}
    families = {m["family"].split(" ")[0] for m in SOURCES.values()}
    assert bands == {"0.10-0.20", "0.21+"} and {"dense", "MoE", "hybrid"} <= families


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_settings_read_from_the_log_equal_the_recorded_ones(name):
    rep = _replay(name)
    case = CASES[SOURCES[name]["case"]]
    e = case["engine"]
    want = {
        "tp": e.get("tp"),
        "pp": e.get("pp"),
        "max_model_len": e.get("max_model_len"),
        "gpu_memory_utilization": e.get("mem_util"),
        "max_num_batched_tokens": e.get("max_num_batched_tokens"),
        "max_num_seqs": e.get("max_num_seqs"),
        "enforce_eager": e.get("enforce_eager"),
        "kv_cache_dtype": e.get("kv_dtype"),
    }
    compared = 0
    for key, expected in want.items():
        value, where = rep.settings[key]
        if where.startswith("log") and expected is not None:
            assert value == expected, (key, value, expected)
            compared += 1
    assert compared >= (4 if rep.log.engine else 2), rep.settings  # a log with its engine line states most
    version, where = rep.settings["vllm_version"]
    assert version.split(".")[:2] == str(case["vllm_version"]).split(".")[:2]
    if case.get("weights_gib") is not None and rep.log.weights_gib is not None:
        assert rep.log.weights_gib == pytest.approx(case["weights_gib"], abs=0.005)
    logged = case["logged"]
    assert rep.log.kv_tokens == logged["kv_tokens"]
    assert [round(g, 2) for g in rep.log.stage_available_gib(want["pp"] or 1, want["tp"] or 1)] == [
        round(g, 2) for g in logged["available_kv_gib"]
    ]


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_concurrency_at_the_logged_kv_within_1_percent(name):
    rep = _replay(name)
    assert rep.log.concurrency is not None
    assert rep.concurrency_at_logged == pytest.approx(rep.log.concurrency[1], rel=0.01)
    assert rep.kv_tokens_at_logged == pytest.approx(rep.log.kv_tokens, rel=0.01)


@pytest.mark.parametrize("name", sorted(n for n, m in SOURCES.items() if "available" in m["checks"]))
def test_available_kv_within_the_goal_and_explained(name):
    rep = _replay(name)
    avail = next(t for t in rep.terms if t.term == "available KV")
    minor = int(rep.settings["vllm_version"][0].split(".")[1])
    goal = 0.05 if minor >= 21 else 0.10
    share = (avail.predicted - avail.logged) / avail.logged
    assert abs(share) <= goal, (name, share)
    if abs(share) > 0.02:
        carried = [line for line in rep.explanation if line.startswith("carried by ")]
        assert carried, rep.explanation
        # the named term is one of the rows printed, or the overhead the log does not break down
        named = carried[0][len("carried by ") :].split(":")[0]
        assert (
            named in {t.term for t in rep.terms}
            or named.startswith("overhead not broken down")
            or named.startswith("requested")
        ), named


def test_named_term_is_the_one_that_differs():
    # Qwen3-Next on 2 x H200, vLLM 0.10.2: the log's non-torch memory is 1.38 GiB (NCCL's buffers, counted
    # before 0.11), the model's 64 MiB; every other logged term agrees within 0.15 GiB
    rep = _replay("qwen3-next-80b-2xh200-0.10.2.log")
    assert rep.explanation[1].startswith("carried by non-torch")
    assert any("NCCL" in line for line in rep.explanation)


def test_unknown_lines_are_ignored_and_missing_ones_said():
    name = "qwen3-8b-a100-40gb-0.19.1.log"
    text = (LOGS / name).read_text()
    noisy = "\n".join(
        f"{line}\nGARBAGE {i} Available KV cache memory is a phrase\n[W] 0.5 GiB"
        for i, line in enumerate(text.splitlines())
    )
    a, b = _replay(name), replay_log(noisy, model=None)
    assert [(t.term, t.logged, t.predicted) for t in a.terms] == [(t.term, t.logged, t.predicted) for t in b.terms]
    bare = _replay("llama-3.1-8b-0.31.log")
    missing = next(n for n in bare.notes if n.startswith("not in the log"))
    assert "vLLM version" in missing and "model" in missing


@pytest.mark.parametrize(
    "logged, used, said",
    [
        ("0.9.2", "0.10", "nearest modelled release, 0.10"),
        ("0.40.1", "0.32", "nearest modelled release, 0.32"),
        ("0.23.1rc1.dev5+g1", "0.23", "development build"),
        ("0.1.dev7548", "0.32.0", "not a release"),
    ],
)
def test_unmodelled_release_answered_with_the_nearest(logged, used, said):
    text = (LOGS / "qwen3-next-80b-2xh200-0.10.2.log").read_text().replace("0.10.2", logged)
    rep = replay_log(text)
    assert rep.settings["vllm_version"][0] == used
    assert any(said in n for n in rep.notes), rep.notes


def test_refusals(monkeypatch, tmp_path):
    with pytest.raises(BadInput, match="no vLLM start-up line"):
        replay_log("hello\nworld\n")
    text = (LOGS / "qwen3-235b-fp8-8xl40s-0.10.2.log").read_text()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(BadInput, match="HF_HUB_OFFLINE is set: give MODEL"):
        replay_log(text)  # an FP8 hub name with no preset, offline and not in the hub cache
    r = runner.invoke(app, ["kv-budget", "--from-log", str(LOGS / "nope.log")])
    assert r.exit_code == 2 and "no such file" in r.stderr
    r = runner.invoke(app, ["kv-budget", "--from-log", str(LOGS / "qwen2.5-7b-0.22.0.log"), "--tp", "2"])
    assert r.exit_code == 2 and "drop --tp" in r.stderr


def test_cli_json_and_stdin():
    text = (LOGS / "qwen3-8b-a100-40gb-0.19.1.log").read_text()
    r = runner.invoke(app, ["kv-budget", "--from-log", "-", "--json"], input=text)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["model"] == "qwen3-8b" and doc["log"]["kv_cache_tokens"] == 140960
    assert doc["at_logged_kv"]["kv_cache_tokens"] == 140960
    terms = {t["term"]: t for t in doc["terms"]}
    assert terms["available KV"]["logged_bytes"] == round(19.36 * GiB)
    human = runner.invoke(app, ["kv-budget", "--from-log", "-"], input=text)
    assert human.exit_code == 0 and "logged against predicted" in human.stdout


def test_a_1mb_log_in_under_a_second_without_torch(tmp_path):
    base = (LOGS / "qwen3-next-80b-2xh200-0.10.2.log").read_text()
    filler = "(APIServer pid=1) INFO 10-23 15:14:57 [launcher.py:44] Route: /v1/chat/completions, Methods: POST\n"
    big = tmp_path / "big.log"
    big.write_text(base + filler * (1_100_000 // len(filler)) + base)
    assert big.stat().st_size > 2**20
    code = (
        "import sys, time; t = time.process_time(); from infer_tool.cli.app import app\n"
        "try:\n    app(['kv-budget', '--from-log', sys.argv[1], '--json'])\n"
        "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
        "sys.stderr.write(f'ELAPSED {time.process_time() - t:.3f}\\n')\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code, str(big)], capture_output=True, text=True, timeout=60)
    wall = time.perf_counter() - start
    assert r.returncode == 0, r.stderr[-2000:]
    elapsed = float(r.stderr.split("ELAPSED ")[1].split()[0])
    # CPU seconds of import + parse + replay + print after the interpreter is up (CPU time, so that the two
    # shared cores' load does not decide it)
    assert elapsed < 1.0, elapsed
    assert wall < 5.0
    assert json.loads(r.stdout)["log"]["kv_cache_tokens"] == 973760


def test_pipeline_stages_from_worker_ranks():
    # vllm-project/vllm#20665 (DeepSeek-V2-Lite, TP 2 x PP 2 on L4s): ranks 0-1 are the first stage
    text = (
        "(VllmWorker rank=3 pid=19834) INFO 07-09 09:47:45 [gpu_worker.py:233] Available KV cache memory: 11.33 GiB\n"
        "(VllmWorker rank=2 pid=19833) INFO 07-09 09:47:45 [gpu_worker.py:233] Available KV cache memory: 11.33 GiB\n"
        "(VllmWorker rank=1 pid=19832) INFO 07-09 09:47:45 [gpu_worker.py:233] Available KV cache memory: 12.13 GiB\n"
        "(VllmWorker rank=0 pid=19831) INFO 07-09 09:47:45 [gpu_worker.py:233] Available KV cache memory: 12.13 GiB\n"
        "INFO 07-09 09:47:46 [kv_cache_utils.py:716] GPU KV cache size: 807,792 tokens\n"
        "INFO 07-09 09:47:46 [kv_cache_utils.py:720] Maximum concurrency for 1,024 tokens per request: 788.86x\n"
    )
    log = parse_log(text)
    assert log.stage_available_gib(2, 2) == [12.13, 11.33]
    assert log.stage_available_gib(1, 4) == [11.33]
    assert log.kv_tokens == 807792 and log.concurrency == (1024, 788.86)


def test_speculative_config_read_from_the_log(tmp_path):
    # vLLM 0.32's engine line with a draft model (from the CPU engine run of tests/kv_spec_vllm_worker.py)
    line = (
        "(MainProcess pid=18120) INFO 12-07 04:09:44 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with "
        "config: model='/tmp/kvspec/target', speculative_config=SpeculativeConfig(method='draft_model', "
        "model='{draft}', num_spec_tokens=2), tokenizer='/tmp/kvspec/target', max_seq_len=1024, "
        "tensor_parallel_size=1, pipeline_parallel_size=1, enforce_eager=True, kv_cache_dtype=auto\n"
        "INFO [kv_cache_utils.py:2327] CPU KV cache size: 26,112 tokens, Maximum concurrency for 1,024 tokens per "
        "request: 25.50x\n"
    )
    log = parse_log(line.format(draft="/x/draft"))
    assert log.engine["speculative_config"] == {
        "method": "draft_model",
        "model": "/x/draft",
        "num_speculative_tokens": 2,
    }
    assert log.version == "0.32.0" and log.kv_tokens == 26112
    rep = replay_log(line.format(draft="qwen3-0.6b"), model="qwen3-8b", gpu="H100-80GB")
    assert rep.report.drafter is not None and rep.report.drafter.k == 2
    rep = replay_log(line.format(draft="/nowhere/draft"), model="qwen3-8b", gpu="H100-80GB")
    assert rep.report.drafter is None and any("replayed without speculative decoding" in n for n in rep.notes)


def test_hostile_logs_are_bounded():
    huge_args = "INFO non-default args: {'model': '" + "x" * 300_000 + "'}\n"
    nested = "INFO non-default args: {'a': " + "[" * 5000 + "]" * 5000 + "}\n"
    line = "INFO [kv_cache_utils.py:1] GPU KV cache size: 1,000 tokens\n"
    for text in (huge_args + line, nested + line, "\x00\xff binary \x00\n" + line):
        log = parse_log(text)
        assert log.kv_tokens == 1000 and "model" not in log.args
    r = runner.invoke(app, ["kv-budget", "--from-log", "-"], input="nothing vLLM about this\n")
    assert r.exit_code == 2 and "no vLLM start-up line" in r.stderr
