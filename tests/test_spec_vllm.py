"""`spec-profile --engine both` on the demo model in vLLM's CPU build: prompt lookup and the
demo's truncated copy (`truncated:20`, written as a model directory for vLLM) at two batch
sizes and k = 1, 2, one worker process for every setting.

Checked against vLLM itself, not against our own formulas: the table passes vLLM's own
validation and its own expansion gives each measured batch size the chosen k
(`vllm/v1/spec_decode/dynamic/utils.py`); the chosen k is the fastest measured; at
temperature 0 every speculative run generated exactly no speculation's tokens (speculative
decoding is lossless there); vLLM's counters agree with one another; our per-position
acceptance equals vLLM's within the cross-check's tolerance; the engine steps our acceptance
predicts for vLLM are the steps vLLM took (its own step timings, `spec/vllm_costs.py`); and our
prompt lookup by vLLM's rule proposes what vLLM's own n-gram function proposes.

No skip: without the vLLM environment (`make vllm-env`) these tests fail and say how to build it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infer_tool.cli.app import app
from infer_tool.spec.crosscheck import TOLERANCE
from infer_tool.spec.drafts import NgramDraft

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("INFER_TOOL_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
BATCHES = [1, 2]
KS = [1, 2]
DRAFTS = ["ngram:3", "truncated:20"]


def vllm_python() -> Path:
    if not VLLM_PYTHON.exists():
        pytest.fail(
            f"vLLM environment missing: {VLLM_PYTHON} does not exist; `make vllm-env` builds it "
            "(`make test` does so first), or set INFER_TOOL_VLLM_PYTHON"
        )
    return VLLM_PYTHON


@pytest.fixture(scope="module")
def report() -> dict:
    python = vllm_python()
    args = [
        "spec-profile",
        "--target",
        "smollm2-135m",
        *("--draft", "ngram", "--draft", "truncated:20"),
        *("--k", ",".join(map(str, KS)), "--batch-sizes", ",".join(map(str, BATCHES))),
        *("--num-prompts", "2", "--max-new-tokens", "12", "--repeats", "1"),
        *("--threads", "1", "--device", "cpu", "--engine", "both", "--no-loop"),
        *("--vllm-python", str(python), "--vllm-timeout", "300", "--json", "--no-progress"),
    ]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output[-3000:]
    return json.loads(res.stdout)


def test_every_setting_ran(report: dict) -> None:
    v = report["vllm"]
    assert v["errors"] == []
    assert [c["batch"] for c in v["baseline"]] == BATCHES
    assert [d["name"] for d in v["drafts"]] == DRAFTS
    for d in v["drafts"]:
        assert sorted((c["batch"], c["k"]) for c in d["cells"]) == [(b, k) for b in BATCHES for k in KS]


def test_table_is_what_vllm_takes_and_gives_each_batch_its_best_k(report: dict) -> None:
    """vLLM's own validation accepts each table and its own expansion (the scheduler's lookup)
    gives every measured batch size the k chosen for it."""
    tables = {d["name"]: d["schedule"] for d in report["vllm"]["drafts"]}
    code = (
        "import json, sys\n"
        "from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule as v, "
        "build_dynamic_sd_schedule_lookup as b\n"
        "t = json.loads(sys.argv[1]); out = {}\n"
        "for name, rows in t.items():\n"
        "    v(rows); kmax = max(r[2] for r in rows)\n"
        f"    out[name] = b(rows, {max(BATCHES)}, kmax) if kmax > 0 else [0] * {max(BATCHES) + 1}\n"
        "print(json.dumps(out))\n"
    )
    r = subprocess.run(
        [str(vllm_python()), "-c", code, json.dumps(tables)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lookup = json.loads(r.stdout.strip().splitlines()[-1])
    for d in report["vllm"]["drafts"]:
        for b in BATCHES:
            assert lookup[d["name"]][b] == d["best_k"][str(b)], (d["name"], b)
        if d["speculative_config"] is not None:
            cfg = d["speculative_config"]
            assert cfg["num_speculative_tokens"] == max(k for _, _, k in d["schedule"])
            assert cfg["method"] == ("ngram" if d["name"].startswith("ngram") else "draft_model")


def test_chosen_k_is_the_measured_fastest(report: dict) -> None:
    v = report["vllm"]
    rate = "tokens_per_cpu_s" if v["clock"] == "cpu" else "tokens_per_s"  # --threads 1 on a CPU: its CPU time
    base = {c["batch"]: c[rate] for c in v["baseline"]}
    for d in v["drafts"]:
        for b in BATCHES:
            options = {0: base[b], **{c["k"]: c[rate] for c in d["cells"] if c["batch"] == b}}
            assert d["best_k"][str(b)] == max(options, key=options.get), (d["name"], b, options)


def test_lossless_at_temperature_0(report: dict) -> None:
    """Every speculative run generated exactly the tokens of no speculation at its batch size."""
    cells = [(d["name"], c) for d in report["vllm"]["drafts"] for c in d["cells"]]
    assert [(n, c["batch"], c["k"]) for n, c in cells if c["same_output"] is not True] == []


def test_counters_agree(report: dict) -> None:
    for d in report["vllm"]["drafts"]:
        for c in d["cells"]:
            assert c["num_drafts"] > 0, (d["name"], c["batch"], c["k"])
            assert sum(c["accepted_hist"]) == c["num_drafts"]
            accepted = sum(j * n for j, n in enumerate(c["accepted_hist"]))
            assert accepted == c["num_accepted_tokens"], (d["name"], c["batch"], c["k"])
            if d["name"].startswith("truncated"):  # a model draft proposes k tokens every time
                assert c["num_draft_tokens"] == c["k"] * c["num_drafts"]


def test_cross_check_agrees(report: dict) -> None:
    """At temperature 0 on the same prompts, our per-position acceptance (the loop's rounds
    replayed from teacher-forced acceptance) equals vLLM's within TOLERANCE."""
    rows = report["cross_check"]
    assert sorted((r["draft"], r["k"]) for r in rows) == [(d, k) for d in DRAFTS for k in KS]
    bad = [(r["draft"], r["k"], r["ours"], r["vllm"], r["reason"]) for r in rows if r["max_diff"] > TOLERANCE]
    assert bad == []


def test_priced_steps_are_vllms(report: dict) -> None:
    """At temperature 0, the decode steps predicted from our acceptance (vLLM's rounds, chunks of
    the batch size, each chunk until its slowest sequence ends) are exactly the engine steps
    vLLM's worker timed, for every draft, batch size and k; each row is priced."""
    rows = report["priced"]
    assert sorted((r["draft"], r["batch"], r["k"]) for r in rows) == [
        (d, b, k) for d in DRAFTS for b in BATCHES for k in KS
    ]
    assert [(r["draft"], r["batch"], r["k"]) for r in rows if r["predicted_steps"] != r["vllm_steps"]] == []
    for r in rows:
        assert r["predicted_speedup"] > 0 and r["plain_step_ms"] > 0 and r["verify_step_ms"] > 0
        assert r["error"] == pytest.approx(r["predicted_speedup"] / r["vllm_speedup"] - 1)


def test_cost_model_probes_are_the_steps_it_prices(report: dict) -> None:
    """The cost model's probes ran in vLLM without speculation (the target, and the draft model
    alone): every cached-prefix probe step scheduled exactly q tokens a request (vLLM's prefix
    cache served the rest), a plain decode step was timed at each batch size, and every row got
    the model's prediction. (How close it lands is measured on the results page, not here: these
    runs are too short to time.)"""
    fits = report["vllm"]["cost_fits"]
    assert set(fits) == {"cost probe: target", "cost probe: truncated:20"}
    for name, f in fits.items():
        assert f["misses"] == [], name
        assert sorted(map(int, f["decode"])) == BATCHES, name
        for b in BATCHES:
            assert sorted(map(int, f["query"][str(b)])) == list(range(1, max(KS) + 2)), (name, b)
    for r in report["priced"]:
        assert r["model_speedup"] > 0, r
        assert r["model_draft_ms"] == 0 if r["draft"] == "ngram:3" else r["model_draft_ms"] > 0


def test_ngram_rule_is_vllms() -> None:
    """Our prompt lookup by vLLM's rule proposes what vLLM's own n-gram function proposes, on
    random sequences over a small alphabet (so that matches of every length occur)."""
    import random

    rng = random.Random(0)
    cases = [[rng.randrange(4) for _ in range(rng.randrange(2, 40))] for _ in range(300)]
    code = (
        "import json, sys, numpy as np\n"
        "from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as f\n"
        "cases = json.loads(sys.stdin.read())\n"
        "print(json.dumps([f(np.array(c, dtype=np.int32), 1, 3, 10**6, 3).tolist() for c in cases]))\n"
    )
    r = subprocess.run(
        [str(vllm_python()), "-c", code], input=json.dumps(cases), capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    theirs = json.loads(r.stdout.strip().splitlines()[-1])
    ours = [NgramDraft(4, 3, earliest=True).lookup(c, 3) for c in cases]
    assert sum(1 for t in theirs if t) > 100  # most cases propose something
    assert ours == theirs


def test_eagle3_head_runs_in_vllm(tmp_path: Path) -> None:
    """EAGLE-3 through vLLM, plumbing only: a tiny random EAGLE-3 head for a tiny Llama, given
    as vLLM's speculative_config. Every setting runs, vLLM drafts, and at temperature 0 the
    output equals no speculation's (lossless whatever the head proposes)."""
    from spec_eagle3_tiny import save_eagle3_head, save_tiny_target

    target = save_tiny_target(tmp_path / "target")
    head = save_eagle3_head(target, tmp_path / "head")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The state of the union is strong. We the people\nin order to form a more perfect union\n")
    config = json.dumps({"method": "eagle3", "model": str(head)})
    args = [
        "spec-profile",
        *("--target", str(target), "--draft", config, "--prompts", str(prompts)),
        *("--k", "1", "--batch-sizes", "1,2", "--num-prompts", "2", "--max-new-tokens", "8", "--repeats", "1"),
        *("--threads", "1", "--engine", "vllm", "--vllm-python", str(vllm_python()), "--vllm-timeout", "300"),
        *("--json", "--no-progress"),
    ]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output[-3000:]
    v = json.loads(res.stdout)["vllm"]
    assert v["errors"] == []
    (d,) = v["drafts"]
    assert d["config"] == {"method": "eagle3", "model": str(head)}
    assert [(c["batch"], c["k"]) for c in d["cells"]] == [(1, 1), (2, 1)]
    for c in d["cells"]:
        assert c["num_drafts"] > 0 and c["num_draft_tokens"] == c["num_drafts"]  # one token per draft at k=1
        assert c["same_output"] is True
