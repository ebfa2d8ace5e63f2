"""Predicted speedup of speculative decoding from acceptance and round costs; vLLM's metrics.

Speedup is plain decoding time / speculative decoding time for the same tokens, prefill
excluded from both (`decode`). Costs come from a `costs.RoundCosts` in target
decode steps, so plain decoding of n tokens costs n.

Two predictions per lookahead k:
- `sequence_prediction`, from the acceptance along each prompt's continuation: the
  expected cost of the loop itself, by a recursion over positions that follows
  `decode`'s rules (a round at position t drafts min(k, tokens left - 1) tokens and
  accepts the first j with probability a_1···a_j·(1 - a_(j+1)); the draft catches up
  after a fully accepted round). It keeps what the mean α averages away: acceptance comes
  in runs (repeated text, prompt lookup), and the last rounds are short. At temperature 0
  its acceptances are 0 or 1 and it expects the loop's own accepted lengths.
- `alpha_prediction`, from α alone under independence (Leviathan et al. 2023, eq. 1, with
  the verify cost measured instead of assumed 1): (1 - α^(k+1)) / (1 - α) tokens per pass
  over k·c + v(k), c the draft's cost per proposed token including its catch-up (needed
  after a fully accepted round, probability α^k). It is the figure to carry to other text.

vLLM's spec-decode metrics (`vllm/v1/spec_decode/metrics.py`; the scheduler counts a
draft only when tokens were proposed): mean acceptance length = 1 + accepted / drafts,
acceptance rate = accepted / drafted tokens, per-position rate i = drafts that accepted
at least i tokens / drafts. Under independence they are 1 + Σ α^i, Σ α^i / k and α^i.

What this module does not know: models, timing or where acceptance comes from.
"""

from __future__ import annotations

from dataclasses import dataclass

from infer_tool.spec.acceptance import expected_tokens, vllm_rate
from infer_tool.spec.costs import RoundCosts


def outcome_probs(a: list[float]) -> list[float]:
    """P(exactly j of the drafted tokens accepted), j = 0..m, from the acceptance
    probability a_i of each drafted token given the ones before it were accepted."""
    probs, run = [], 1.0
    for x in a:
        probs.append(run * (1.0 - x))
        run *= x
    probs.append(run)
    return probs


@dataclass
class Expectation:
    """Expected decode phase of one sequence."""

    cost: float  # target decode steps
    passes: float  # target passes (rounds)
    tokens: int  # tokens decoded (all but the prefill's)


def sequence_prediction(acceptance: list[list[float]], k: int, costs: RoundCosts) -> Expectation:
    """acceptance[t] (t = 0..N-1, N >= 1 tokens generated, t = 0 the prefill's token): the
    acceptance probabilities of the tokens a round starting after t tokens drafts (at
    most k; fewer or none for prompt lookup)."""
    N = len(acceptance)
    cost = {(N, False): 0.0, (N, True): 0.0}
    passes = dict(cost)
    for t in range(N - 1, 0, -1):
        kk = min(k, N - t - 1)
        for catch_up in (False, True):
            if kk == 0:  # the last token: a plain step, no draft
                c, nexts = costs.verify(0), [(1.0, (t + 1, False))]
            else:
                a = acceptance[t][:kk]
                m = len(a)
                c = costs.draft(m, catch_up) + costs.verify(m)
                nexts = [(pj, (t + j + 1, 0 < m == j)) for j, pj in enumerate(outcome_probs(a))]
            cost[t, catch_up] = c + sum(pj * cost[s] for pj, s in nexts)
            passes[t, catch_up] = 1.0 + sum(pj * passes[s] for pj, s in nexts)
    return Expectation(cost[1, False], passes[1, False], N - 1)


@dataclass
class AlphaPrediction:
    tokens: float  # (1 - α^(k+1)) / (1 - α) per target pass
    draft_cost: float  # per round, catch-up at rate α^k, target steps
    verify_cost: float  # v(k)
    speedup: float


def alpha_prediction(alpha: float, k: int, costs: RoundCosts) -> AlphaPrediction:
    full = alpha**k  # P(the previous round accepted all k), the catch-up rate
    draft = (1.0 - full) * costs.draft(k, False) + full * costs.draft(k, True)
    v = costs.verify(k)
    tokens = expected_tokens(alpha, k)
    return AlphaPrediction(tokens, draft, v, tokens / (draft + v))


@dataclass
class VllmMetrics:
    """vLLM's spec-decode metrics (see the module docstring)."""

    mean_acceptance_length: float
    acceptance_rate: float
    per_position: list[float]  # positions 1..k


def vllm_predicted(alpha: float, k: int) -> VllmMetrics:
    return VllmMetrics(expected_tokens(alpha, k), vllm_rate(alpha, k), [alpha**i for i in range(1, k + 1)])


def greedy_rounds(acceptance: list[list[float]], k: int) -> tuple[list[int], list[int]]:
    """The loop's rounds at temperature 0, where every acceptance is 0 or 1: (accepted,
    drafted) tokens per target pass, following `decode`'s rules (the first round starts after
    the prefill's token, a round at t drafts min(k, N - t - 1), accepts the leading run of
    ones and the next starts after it and the emitted token). `acceptance` as for
    `sequence_prediction`; exact without running the loop."""
    N = len(acceptance)
    accepted, drafted = [], []
    t = 1
    while t < N:
        a = acceptance[t][: min(k, N - t - 1)]
        j = next((i for i, x in enumerate(a) if x < 0.5), len(a))
        accepted.append(j)
        drafted.append(len(a))
        t += j + 1
    return accepted, drafted


def vllm_rule_rounds(acceptance: list[list[float]], drafted: list[int]) -> list[tuple[int, int, int]]:
    """The rounds vLLM makes at temperature 0 along the same continuation: (accepted at
    least, accepted at most, drafted) per round with a draft. vLLM drafts a round's whole
    proposal (`drafted[t]`: k for a model, the match's continuation for prompt lookup) even
    when it runs past the requested tokens, where the continuation, and so acceptance, is
    unknown here: a round whose known drafts were all accepted may accept up to all of it.
    Rounds without a proposal are plain steps, not drafts (vLLM counts none)."""
    N = len(acceptance)
    out = []
    t = 1
    while t < N:
        d = drafted[t]
        known = acceptance[t][: min(d, N - t)]
        j = next((i for i, x in enumerate(known) if x < 0.5), len(known))
        if d > 0:
            out.append((j, d if j == len(known) and d > len(known) else j, d))
        t += j + 1
    return out


def vllm_measured(accepted: list[int], drafted: list[int], k: int) -> VllmMetrics | None:
    """From the loop's rounds (accepted and drafted tokens per target pass); None when no
    round drafted anything."""
    rounds = [(a, d) for a, d in zip(accepted, drafted) if d > 0]
    if not rounds:
        return None
    drafts = len(rounds)
    acc = sum(a for a, _ in rounds)
    return VllmMetrics(
        1.0 + acc / drafts,
        acc / sum(d for _, d in rounds),
        [sum(a >= i for a, _ in rounds) / drafts for i in range(1, k + 1)],
    )
