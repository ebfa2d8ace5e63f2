"""Pricing our acceptance with vLLM's own step costs (`spec/vllm_costs.py`), without vLLM:
step costs from timed steps, and the predicted time and steps of a prompt set checked against
hand-worked chunks, against `predict.vllm_rule_rounds` (the rounds vLLM makes) and against an
exact expectation when acceptance is random."""

from __future__ import annotations

import random

import pytest

from infer_tool.spec.predict import vllm_rule_rounds
from infer_tool.spec.vllm_costs import Sequence, StepCosts, predict, step_costs

# [requests, tokens, spec_tokens, prefill, seconds, draft_seconds]
STEPS = [
    [1, 10, 0, 1, 0.6, 0.1],
    [1, 30, 0, 1, 0.8, 0.2],
    [1, 1, 0, 0, 1.0, 0.0],
    [1, 1, 0, 0, 1.2, 0.0],
    [1, 1, 0, 0, 9.0, 0.0],  # an outlier the median ignores
    [2, 2, 0, 0, 1.5, 0.0],
    [1, 3, 2, 0, 2.0, 0.5],
    [2, 6, 4, 0, 3.0, 0.7],
]


def test_step_costs_from_timed_steps() -> None:
    c = step_costs(STEPS)
    assert c.prefill == pytest.approx([0.5, 0.01])  # the line through (10, 0.6) and (30, 0.8)
    assert c.prefill_seconds(20) == pytest.approx(0.7)
    assert c.step(1, 1) == pytest.approx(1.2)  # median of 1.0, 1.2, 9.0
    assert c.step(1, 2) == pytest.approx(1.6)  # halfway between 1 and 3 tokens
    assert c.step(1, 5) == pytest.approx(2.0)  # flat beyond the largest seen
    assert c.typical(2) == [2, 2, 1.5, 1, 0.0]  # ties: the first seen most often
    assert (c.steps, c.prefills) == (6, 2)


def test_step_at_a_batch_not_seen_is_linear_between_neighbours() -> None:
    c = StepCosts(decode=[[1, 2, 1.0, 1, 0.0], [4, 8, 4.0, 1, 0.0]], prefill=[0.0, 0.0])
    assert c.step(2, 4) == pytest.approx(2.0)  # 2 tokens per request, a third of the way from 1 to 4
    assert c.step(8, 16) == pytest.approx(4.0)  # flat beyond the largest batch seen


COSTS = StepCosts(
    decode=[[1, 1, 1.0, 1, 0.0], [2, 2, 1.5, 1, 0.0], [1, 3, 2.0, 1, 0.5], [2, 6, 3.0, 1, 0.7]],
    prefill=[0.5, 0.01],
)


def test_hand_worked_chunks() -> None:
    """Two prompts (10 and 20 tokens), 6 tokens each, k = 2: A accepts every draft (rounds at
    t = 1, 4), B none (t = 1..5). Batch 2: prefill 0.5 + 0.3; two steps with both (6 tokens, 3.0
    each), three with B alone (3 tokens, 2.0 each) = 12.8 s, 5 steps. Batch 1: A 0.6 + 2 x 2.0,
    B 0.7 + 5 x 2.0 = 15.3 s, 7 steps. Plain at batch 2: 0.8 + 5 steps x 1.5."""
    n = 6
    a = Sequence(10, [[1.0, 1.0]] * n, [2] * n)
    b = Sequence(20, [[0.0, 0.0]] * n, [2] * n)
    two = predict(COSTS, [a, b], 2, n)
    assert (two.seconds, two.decode_steps) == (pytest.approx(12.8), 5)
    one = predict(COSTS, [a, b], 1, n)
    assert (one.seconds, one.decode_steps) == (pytest.approx(15.3), 7)
    plain = predict(COSTS, [Sequence(10), Sequence(20)], 2, n)
    assert (plain.seconds, plain.decode_steps) == (pytest.approx(0.8 + 5 * 1.5), 5)


@pytest.mark.parametrize("k", [1, 3])
def test_steps_are_the_rounds_vllm_makes(k: int) -> None:
    """At temperature 0 (acceptance 0 or 1) each sequence takes as many steps at batch 1 as
    `vllm_rule_rounds` replays, for a draft model (k every round) and for lookup proposals of
    any length (0: a plain step, no draft)."""
    rng = random.Random(k)
    n = 20
    for lookup in (False, True):
        seqs = []
        rounds = 0
        for _ in range(6):
            drafted = [rng.randint(0, k + 1) if lookup else k for _ in range(n)]
            acc = [[float(rng.random() < 0.6) for _ in range(min(d, n - t))] for t, d in enumerate(drafted)]
            seqs.append(Sequence(8, acc, drafted))
            walked = vllm_rule_rounds(acc, drafted)
            plain_steps = _walk_plain_steps(acc, drafted, n)
            rounds += len(walked) + plain_steps
        assert predict(COSTS, seqs, 1, n).decode_steps == rounds


def _walk_plain_steps(acc: list[list[float]], drafted: list[int], n: int) -> int:
    """Steps without a proposal along the same walk (vllm_rule_rounds lists drafts only)."""
    t, plain = 1, 0
    while t < n:
        known = acc[t][: min(drafted[t], n - t)]
        j = next((i for i, x in enumerate(known) if x < 0.5), len(known))
        plain += drafted[t] == 0
        t += j + 1
    return plain


def test_random_acceptance_matches_the_exact_expectation() -> None:
    """Acceptance alpha per drafted token, k = 1, one sequence: the expected steps from t solve
    E(t) = 1 + alpha E(t + 2) + (1 - alpha) E(t + 1), E(t >= n) = 0; the sampled mean agrees
    within 3%."""
    n, alpha = 16, 0.6
    e = [0.0] * (n + 2)
    for t in range(n - 1, 0, -1):
        e[t] = 1 + alpha * e[t + 2] + (1 - alpha) * e[t + 1]
    seq = Sequence(4, [[alpha]] * n, [1] * n)
    got = predict(COSTS, [seq], 1, n, samples=3000, seed=1).decode_steps
    assert got == pytest.approx(e[1], rel=0.03)
    assert got != pytest.approx(n - 1, rel=0.1)  # the sampling sees acceptances
