"""The cost model fitted from vLLM runs without speculation (`spec/vllm_cost_model.py`),
without vLLM: probe records are generated from a known ground truth (a step's cost as a
function of batch size and query tokens, a draft's passes, a prefill line), with outliers and
a cache miss mixed in, and the fit must give back the ground truth's prices; the predicted
time of a run is checked against a hand count of its steps priced by the ground truth."""

from __future__ import annotations

import pytest

from infer_tool.spec.vllm_cost_model import ModelCosts, fit
from infer_tool.spec.vllm_costs import Sequence, predict

ADMIT = 0.010  # a new request's admission: in every cached-prefix step, in no decode step
OVERHEAD = 0.008  # schedule, sampling, output: in every step, outside the model's work


def target_logits(rows: float) -> float:
    return 0.006 + 0.001 * rows


def target_forward(b: float, q: float) -> float:
    return 0.030 + 0.004 * b + 0.002 * b * (q - 1)


def draft_logits(rows: float) -> float:
    return 0.004 + 0.0005 * rows


def draft_forward(b: float, q: float) -> float:
    return 0.012 + 0.002 * b + 0.001 * b * (q - 1)


def true_verify(b: float, q: float) -> float:
    """The target's step scoring q tokens for each of b requests: forward over b x q tokens, the
    head over b x q rows."""
    return OVERHEAD + target_forward(b, q) + target_logits(b * q)


def true_draft_pass(b: float, q: float) -> float:
    """One draft pass over q tokens a request: forward, head over b rows (one a request)."""
    return draft_forward(b, q) + draft_logits(b)


def step(b: int, q: int, prefill: int, forward, logits, admit: float = 0.0, scale: float = 1.0) -> list[float]:
    f, lg = forward(b, q), logits(b)
    return [b, b * q, 0, prefill, (OVERHEAD + admit + f + lg) * scale, 0.0, f * scale, lg * scale]


def probe_records(forward, logits, batches=(1, 2, 4), queries=(1, 2, 3, 4)) -> list[dict]:
    """What `vllm_worker.run_probe` writes for a model of this ground truth: per batch size 3
    repeats of a plain decode (a prefill of 40 tokens a request, then 5 decode steps, one of
    them an outlier 10x slower) and of each cached-prefix probe; one probe step missed the cache."""
    recs = []
    for b in batches:
        for r in range(3):
            pre = [b, 40 * b, 0, 1, 0.02 + 0.0004 * 40 * b, 0.0, 0.015 + 0.0003 * 40 * b, 0.001]
            decode = [step(b, 1, 0, forward, logits, scale=10.0 if (r, b) == (1, 2) else 1.0) for _ in range(5)]
            recs.append({"probe": "decode", "batch": b, "steps": [pre, *decode]})
            for q in queries:
                s = step(b, q, int(q > 1), forward, logits, admit=ADMIT)
                if (b, q, r) == (4, 3, 0):  # the prefix was not cached: the whole prompt computed
                    s = [b, b * (64 + q), 0, 1, 0.5, 0.0, 0.4, 0.01]
                recs.append({"probe": q, "batch": b, "steps": [s]})
    return recs


def test_fit_gives_back_the_ground_truth() -> None:
    t = fit(probe_records(target_forward, target_logits))
    assert t.logits_row == pytest.approx(0.001)
    for b in (1, 2, 4):
        assert t.decode[b] == pytest.approx(true_verify(b, 1))  # the outlier is outvoted
        for q in (1, 2, 3, 4):
            assert t.verify(b, q) == pytest.approx(true_verify(b, q)), (b, q)
    assert t.verify(3, 2) == pytest.approx(true_verify(3, 2))  # between batch sizes: linear, exact here
    assert t.verify(2, 2.5) == pytest.approx(true_verify(2, 2.5))  # between query lengths (n-gram's mean)
    assert t.prefill == pytest.approx([0.02, 0.0004])
    assert len(t.misses) == 1 and "B=4 q=3" in t.misses[0]


def test_speculative_step_is_verify_plus_the_drafts_passes() -> None:
    target = fit(probe_records(target_forward, target_logits))
    draft = fit(probe_records(draft_forward, draft_logits))
    for b in (1, 2, 4):
        assert draft.pass_(b, 1) == pytest.approx(true_draft_pass(b, 1))
        for k in (1, 2, 3):
            want = true_verify(b, k + 1) + true_draft_pass(b, k + 1) + (k - 1) * true_draft_pass(b, 1)
            assert ModelCosts(target, draft, k).step(b, b * (k + 1)) == pytest.approx(want), (b, k)
            assert ModelCosts(target, None, k).step(b, b * (k + 1)) == pytest.approx(true_verify(b, k + 1))
        assert ModelCosts(target, draft, 0).step(b, b) == pytest.approx(true_verify(b, 1))


def test_predicted_run_is_the_hand_count_priced_by_the_ground_truth() -> None:
    """Two prompts of 40 tokens at B = 2, 6 tokens each, k = 2. Prompt 0 accepts everything;
    prompt 1 accepts nothing. Rounds: prefill gives token 1; step 1: both feed 3 tokens, prompt 0
    reaches 4, prompt 1 reaches 2; step 2: prompt 0 reaches 7 (done), prompt 1 reaches 3; then
    prompt 1 alone: 4, 5, 6 (three more steps of B = 1). No speculation: the prefill, then 5
    steps of B = 2."""
    target = fit(probe_records(target_forward, target_logits))
    draft = fit(probe_records(draft_forward, draft_logits))
    k, n = 2, 6
    ones, zeros = [[1.0] * k for _ in range(n)], [[0.0] * k for _ in range(n)]
    seqs = [Sequence(40, ones, [k] * n), Sequence(40, zeros, [k] * n)]

    def spec_step(b: int) -> float:
        return true_verify(b, k + 1) + true_draft_pass(b, k + 1) + (k - 1) * true_draft_pass(b, 1)

    prefill = 0.02 + 0.0004 * 80
    draft_prefill = 0.015 + 0.0003 * 80 + 0.001 + (k - 1) * true_draft_pass(2, 1)
    want = prefill + draft_prefill + 2 * spec_step(2) + 3 * spec_step(1)
    got = predict(ModelCosts(target, draft, k), seqs, 2, n)
    assert got.decode_steps == 5
    assert got.seconds == pytest.approx(want)
    plain = predict(ModelCosts(target, None, 0), [Sequence(40), Sequence(40)], 2, n)
    assert plain.seconds == pytest.approx(prefill + 5 * true_verify(2, 1))


def test_no_decode_step_is_refused() -> None:
    with pytest.raises(ValueError, match="no plain decode step"):
        fit([{"probe": 2, "batch": 1, "steps": [[1, 2, 0, 1, 0.1, 0.0, 0.08, 0.01]]}])


def test_our_loops_prices_first_pass_of_one_token_and_no_prefill() -> None:
    """Our batched loop's rounds: the draft's first pass feeds 1 token a row (not the target's
    k + 1), and its timed phase has no prefill."""
    target = fit(probe_records(target_forward, target_logits))
    draft = fit(probe_records(draft_forward, draft_logits))
    for b in (1, 2, 4):
        for k in (1, 3):
            costs = ModelCosts(target, draft, k, first_pass=1, prefill=False)
            assert costs.step(b, b * (k + 1)) == pytest.approx(true_verify(b, k + 1) + k * true_draft_pass(b, 1))
            assert costs.prefill_seconds(100, b) == 0.0
