"""The pieces of `spec-profile --engine vllm` that need no vLLM: the table from measured best
ks (checked against vLLM's own validation in tests/test_spec_vllm.py), vLLM's counters turned
into per-position acceptance and the accepted-length histogram, the loop's rounds replayed
from teacher-forced acceptance at temperature 0, and the truncated copy written for vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from spec_tiny import V, one_thread, tiny  # noqa: F401 - one_thread applies to this module
from transformers import LlamaForCausalLM

from infer_tool.common.errors import BadInput
from infer_tool.spec.cached_lm import CachedLM
from infer_tool.spec.crosscheck import cross_check
from infer_tool.spec.decode import speculative_decode, target_decode
from infer_tool.spec.drafts import ModelDraft, NgramDraft, truncated_copy
from infer_tool.spec.predict import greedy_rounds, vllm_rule_rounds
from infer_tool.spec.sampling import warp
from infer_tool.spec.vllm_engine import analyse, cell, parse_config, recommended_config, schedule, truncated_dir

NEW = 24


def test_schedule_ranges() -> None:
    # each measured size governs up to the next one; equal neighbours merge; first starts at 1
    assert schedule({1: 3, 4: 3, 16: 1, 64: 0}) == [[1, 15, 3], [16, 63, 1], [64, 64, 0]]
    assert schedule({2: 2}) == [[1, 2, 2]]
    assert schedule({1: 0, 8: 0}) == [[1, 8, 0]]


def test_recommended_config() -> None:
    base = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    rows = [[1, 15, 3], [16, 63, 1], [64, 64, 0]]
    assert recommended_config(base, rows) == {
        **base,
        "num_speculative_tokens": 3,
        "num_speculative_tokens_per_batch_size": rows,
    }
    assert recommended_config(base, [[1, 8, 2]]) == {**base, "num_speculative_tokens": 2}  # one k: static
    assert recommended_config(base, [[1, 8, 0]]) is None  # no speculation wins everywhere


def _rec(setting: str, batch: int, seconds: float, tokens: int = 100, **counters) -> dict:
    return {"setting": setting, "batch": batch, "repeat": 0, "seconds": seconds, "tokens": tokens, **counters}


def test_cell_from_counters() -> None:
    """10 drafts at k=3 that accepted 0,0,1,1,1,2,3,3,3,3 tokens (by hand): per position
    (drafts accepting at least i) 8, 5, 4; histogram 2, 3, 1, 4."""
    accepted = [0, 0, 1, 1, 1, 2, 3, 3, 3, 3]
    per_pos = [sum(a >= i for a in accepted) for i in (1, 2, 3)]
    rec = _rec(
        "d k=3",
        1,
        2.0,
        num_drafts=10,
        num_draft_tokens=30,
        num_accepted_tokens=sum(accepted),
        accepted_per_pos=per_pos,
    )
    c = cell(1, 3, [rec, {**rec, "repeat": 1, "seconds": 4.0}])
    assert c.accepted_hist == [4, 6, 2, 8]  # two repeats of 2, 3, 1, 4
    assert c.per_position == pytest.approx([0.8, 0.5, 0.4])
    assert c.per_position_conditional == pytest.approx([0.8, 5 / 8, 4 / 5])
    assert c.mean_acceptance_length == pytest.approx(1 + 17 / 10)
    assert c.acceptance_rate == pytest.approx(17 / 30)
    assert c.tokens_per_s == pytest.approx((50 + 25) / 2) and c.tokens_per_s_range == (25, 50)


def test_best_k_is_the_fastest_measured() -> None:
    """no speculation wins at batch 8, k=2 at batch 1."""
    records = [
        _rec("no speculation", 1, 2.0),
        _rec("no speculation", 8, 1.0),
        *(
            _rec(f"d k={k}", b, s, num_drafts=1, num_draft_tokens=k, num_accepted_tokens=0, accepted_per_pos=[0] * k)
            for k, b, s in ((1, 1, 1.5), (2, 1, 1.2), (1, 8, 1.1), (2, 8, 1.3))
        ),
        {"setting": "e k=1", "stage": "load", "error": "ValueError: no"},
    ]
    from infer_tool.spec.vllm_engine import VllmDraftSpec

    base, profiles, errors = analyse(
        records, [VllmDraftSpec("d", {"method": "x"}), VllmDraftSpec("e", {})], [1, 2], [1, 8]
    )
    d = profiles[0]
    assert d.best_k == {1: 2, 8: 0}
    assert d.schedule == [[1, 7, 2], [8, 8, 0]]
    assert d.speculative_config == {
        "method": "x",
        "num_speculative_tokens": 2,
        "num_speculative_tokens_per_batch_size": d.schedule,
    }
    assert errors == ["draft e at k=1: ValueError: no"]  # names the draft and the setting


def test_best_k_in_cpu_time_when_timed_so() -> None:
    """Under other processes' load wall time can rank k wrongly: with the CPU-time basis the
    worker's CPU seconds decide (here k=1 is faster by the wall clock, slower by CPU time)."""
    records = [
        {**_rec("no speculation", 1, 2.0), "cpu_seconds": 1.0},
        {
            **_rec("d k=1", 1, 1.0, num_drafts=1, num_draft_tokens=1, num_accepted_tokens=0, accepted_per_pos=[0]),
            "cpu_seconds": 1.5,
        },
    ]
    from infer_tool.spec.vllm_engine import VllmDraftSpec

    spec = [VllmDraftSpec("d", {"method": "x"})]
    assert analyse(records, spec, [1], [1])[1][0].best_k == {1: 1}
    _, (d,), _ = analyse(records, spec, [1], [1], basis="cpu")
    assert d.best_k == {1: 0}
    assert d.cells[0].speedup_cpu == pytest.approx(1.0 / 1.5)
    assert d.cells[0].speedup == pytest.approx(2.0)


def test_parse_config() -> None:
    assert parse_config('{"method": "eagle3", "model": "m", "num_speculative_tokens": 5}') == {
        "method": "eagle3",
        "model": "m",
    }
    for bad in ('{"model": "m"}', "[1]", "{nope"):
        with pytest.raises(BadInput):
            parse_config(bad)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_rounds_replay_the_loop(k: int) -> None:
    """At temperature 0 the rounds replayed from teacher-forced acceptance are the loop's own
    (oracle: the real loop), for a model draft and for prompt lookup by vLLM's rule."""
    target = tiny(4, 0)
    lm = CachedLM(target, V)
    g = torch.Generator().manual_seed(7)
    base = torch.randint(0, V, (6,), generator=g)
    prompt = torch.cat([base, base, base[:3]])  # repeats, so prompt lookup matches
    for draft in (ModelDraft("truncated:2", truncated_copy(target, 2), V), NgramDraft(V, 3, earliest=True)):
        cont = target_decode(lm, prompt, NEW, 0.0, 1.0, None).tokens
        seq = torch.cat([prompt, cont])
        P = len(prompt)
        p = warp(lm.score(seq)[P - 1 : -1], 0.0, 1.0)
        from infer_tool.spec.acceptance import beta

        b = beta(p, draft.teacher_forced(seq, P, 0.0, 1.0))
        acc = draft.round_acceptance(seq, P, k, p, b)
        run = speculative_decode(lm, draft, prompt, k, NEW, 0.0, 1.0, None)
        assert greedy_rounds(acc, k) == (run.accepted, run.drafted), draft.name
        assert sum(run.accepted) > 0  # the comparison sees acceptances, not only zeros


def test_ngram_earliest_rule() -> None:
    seq = [5, 1, 2, 9, 1, 2, 7, 1, 2]  # suffix [1, 2] occurs at 1 and 4 (and 7, itself)
    assert NgramDraft(V, 2).lookup(seq, 2) == [7, 1]  # latest
    assert NgramDraft(V, 2, earliest=True).lookup(seq, 2) == [9, 1]  # earliest, as vLLM


def test_truncated_dir_is_truncated_copy(tmp_path: Path) -> None:
    """The directory written for vLLM holds the model `truncated_copy` builds in memory: the
    same logits."""
    target = tiny(4, 0)
    src = tmp_path / "target"
    target.save_pretrained(src)
    out = truncated_dir(src, 2, tmp_path / "cache")
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    loaded = LlamaForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, truncated_copy(target, 2)(ids).logits)
    assert truncated_dir(src, 2, tmp_path / "cache") == out  # written once
    with pytest.raises(BadInput, match="truncated:N"):
        truncated_dir(src, 4, tmp_path / "cache")


def test_cross_check_rows() -> None:
    rows = cross_check(
        {"ngram:3": {1: ([0.30], [0.30]), 2: ([0.30, 0.20], [0.30, 0.20])}},
        {"ngram:3": {1: [0.31], 2: [0.30, 0.10]}},
        batch=1,
        temperature=0.0,
        same_text=0.5,
    )
    assert [r.agree for r in rows] == [True, False]
    assert rows[1].max_diff == pytest.approx(0.10) and "50%" in rows[1].reason
    (row,) = cross_check({"d": {1: ([0.30], [0.40])}}, {"d": {1: [0.38]}}, 1, 0.0, 1.0)
    assert row.agree and row.max_diff == 0.0 and row.ours_max == [0.40]  # inside the bounds


def test_vllm_rule_rounds() -> None:
    """vLLM drafts whole proposals past the requested tokens: a round that accepts every known
    draft may accept the unknown ones too (by hand: N = 6 tokens, k = 2)."""
    acc = [[1.0, 1.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0]]
    # t=1 accepts 1 (then a reject) -> t=3 accepts 2 -> t=6: done
    assert vllm_rule_rounds(acc, [2] * 6) == [(1, 1, 2), (2, 2, 2)]
    acc = [[1.0, 1.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [1.0, 1.0], [1.0]]
    # t=1: 1; t=3: 0; t=4: both known drafts accepted -> t=7: done
    assert vllm_rule_rounds(acc, [2] * 6) == [(1, 1, 2), (0, 0, 2), (2, 2, 2)]
    acc = [[1.0, 1.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.0, 1.0], [1.0]]
    # t=1: 1; t=3: 0; t=4: 0; t=5: the one known draft accepted, the second is past the end: 1..2
    assert vllm_rule_rounds(acc, [2] * 6) == [(1, 1, 2), (0, 0, 2), (0, 0, 2), (1, 2, 2)]
    assert vllm_rule_rounds(acc, [0] * 6) == []  # no proposal: plain steps, no drafts


FAKE_WORKER = """
import json, sys, time
job = json.load(open(sys.argv[1]))
with open(sys.argv[2], "a") as f:
    f.write(json.dumps({"host": True, "vllm": "fake"}) + "\\n"); f.flush()
    for s in job["settings"]:
        f.write(json.dumps({"setting": s["name"], "event": "load"}) + "\\n"); f.flush()
        if "hang" in s["name"]:
            time.sleep(60)
        f.write(json.dumps({"setting": s["name"], "event": "run", "batch": 1}) + "\\n"); f.flush()
        rec = {"setting": s["name"], "batch": 1, "repeat": 0, "seconds": 1.0, "tokens": 10, "num_drafts": 0,
               "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": [], "outputs": [[1]]}
        f.write(json.dumps(rec) + "\\n"); f.flush()
    f.write(json.dumps({"done": True}) + "\\n")
"""


def test_a_stage_that_overruns_is_killed_and_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM load that hangs is killed at its limit, reported naming the draft and k, and the
    settings after it run in a fresh worker."""
    import sys
    import time

    from infer_tool.spec import vllm_engine

    fake = tmp_path / "worker.py"
    fake.write_text(FAKE_WORKER)
    monkeypatch.setattr(vllm_engine, "WORKER", fake)
    job = {
        "batch_sizes": [1],
        "repeats": 1,
        "settings": [{"name": n, "speculative_config": None} for n in ("no speculation", "hang k=1", "ok k=1")],
    }
    t0 = time.monotonic()
    host, records = vllm_engine.run_worker(Path(sys.executable), tmp_path, job, load_timeout=2, run_timeout=2)
    assert time.monotonic() - t0 < 30
    errors = [r for r in records if "error" in r]
    assert [(r["setting"], r["stage"]) for r in errors] == [("hang k=1", "load")]
    assert "ran over 2 s; killed" in errors[0]["error"]
    ran = {r["setting"] for r in records if "batch" in r}
    assert ran == {"no speculation", "ok k=1"}
    _, profiles, messages = analyse(records, [vllm_engine.VllmDraftSpec("hang", {})], [1], [1])
    assert messages == [f"draft hang at k=1: {errors[0]['error']}"]


def test_vllm_python_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    from infer_tool.cli.app import main

    for python, needle in ((tmp_path / "nope", "does not exist"), (Path(sys.executable), "cannot import vllm")):
        with pytest.raises(SystemExit) as e:
            main(["spec-profile", "--target", "smollm2-135m", "--draft", "ngram", "--engine", "vllm",
                  "--vllm-python", str(python)])  # fmt: skip
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and needle in err, err
    for argv, needle in (
        (["--engine", "gpu"], "--engine"),
        (["--batch-sizes", "1,²"], "--batch-sizes"),
        (["--batch-sizes", "0"], "--batch-sizes"),
        (["--draft", '{"method": "eagle3"}'], "needs --engine vllm"),
        (["--draft", '{"model": "x"}', "--engine", "vllm"], '"method"'),
        (["--vllm-python", "x"], "--vllm-python: used only by --engine vllm"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["spec-profile", "--target", "smollm2-135m", "--draft", "ngram", *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and needle in err, (argv, err)


def test_report_without_our_loop_renders(capsys: pytest.CaptureFixture[str]) -> None:
    """--engine vllm alone: the JSON document and the tables from vLLM's measurements only."""
    from infer_tool.cli.commands import spec_profile_render as render
    from infer_tool.jobs.spec_profile import SpecProfileReport
    from infer_tool.spec.vllm_engine import VllmDraftSpec, VllmProfile

    per_pos = {"num_drafts": 4, "num_draft_tokens": 8, "num_accepted_tokens": 3, "accepted_per_pos": [2, 1]}
    records = [
        _rec("no speculation", 1, 2.0, outputs=[[1, 2]]),
        _rec("d k=2", 1, 1.0, outputs=[[1, 2]], **per_pos),
    ]
    base, drafts, errors = analyse(records, [VllmDraftSpec("d", {"method": "ngram"})], [2], [1])
    v = VllmProfile("t", "/t", "py", {"vllm": "0.32.0"}, [1], [2], 1, base, drafts)
    doc = render.document(SpecProfileReport(None, {"engine": "vllm", "temperature": 0.0}, ["n"], vllm=v))
    assert doc["drafts"] == [] and doc["vllm"]["drafts"][0]["best_k"] == {1: 2}
    assert doc["vllm"]["drafts"][0]["cells"][0]["same_output"] is True
    render.human(doc)
    out = capsys.readouterr().out
    assert "num_speculative_tokens_per_batch_size: [[1, 1, 2]]" in out
    assert '"num_speculative_tokens": 2' in out
