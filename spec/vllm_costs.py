"""vLLM's own step costs, from the worker's per-step timings, and the speedup they predict
for our loop's acceptance at each batch size.

The worker (`vllm_worker.StepTimer`) times every engine step of every timed run as
`[requests, tokens, spec_tokens, prefill, seconds, draft_seconds, ...]`. `step_costs` turns one
setting's steps (all its batch sizes and repeats) into `StepCosts`:
- decode steps (no prompt in the batch): median seconds per (requests b, scheduled tokens),
  the drafter's share included; without speculation a step over b tokens, with a draft model
  a verify step over b x (k + 1) tokens plus the draft's k proposals;
- prefill steps: a least-squares line a + s x (prompt tokens in the step), the draft's
  prefill and first proposal included when it has one.

`predict` prices vLLM's run of a prompt set with these costs: prompts in consecutive
chunks of the batch size, as the worker runs them; per chunk one prefill step, then decode
steps until its slowest sequence has its tokens. Each decode step costs `StepCosts.step(b,
tokens)` for the b sequences still running and the tokens they feed (1 each without
speculation; 1 + the proposal's length with it, vLLM's rule: a round verifies the whole
proposal, `predict.vllm_rule_rounds`); a sequence's rounds come from our acceptance along its
continuation (`profile.DraftProfile.round_acceptance`): at temperature 0 acceptances are 0 or
1 and the rounds are exact; above it they are sampled (`samples` times, a fixed seed). The
predicted speedup is the ratio of the two predicted times, the prefill included as in vLLM's
measured tokens/s.

The costs come from the same runs whose throughput is measured (the prediction that does not
use them is `vllm_cost_model`'s, priced by the same `predict`): what this checks is the
accounting (our acceptance giving vLLM's rounds, the batch's shrinking tail, the prefill),
not a cost model carried to other hardware; costs measured on one machine price that
machine's runs only.

What this module does not know: how the steps were timed, or where acceptance comes from.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field
from typing import Any

SAMPLES = 64  # Monte Carlo runs per chunk when acceptance is not 0 or 1


@dataclass
class StepCosts:
    """Median seconds of one setting's engine steps (see the module docstring)."""

    decode: list[list[float]]  # [requests, tokens, median seconds, steps seen, median drafter seconds], sorted
    prefill: list[float]  # [a, s]: a prefill step of n prompt tokens costs a + s * n seconds
    steps: int = 0  # decode steps seen
    prefills: int = 0

    def _at(self, b: int) -> dict[int, float]:
        return {int(row[1]): row[2] for row in self.decode if row[0] == b}

    def step(self, b: int, tokens: int) -> float:
        """Seconds of a decode step with b requests feeding `tokens` tokens: interpolated
        along tokens among the steps seen with b requests (flat beyond them); for a b not
        seen, linearly between the nearest b seen below and above at the same tokens per
        request (flat beyond)."""
        seen = sorted({int(row[0]) for row in self.decode})
        if not seen:
            raise ValueError("no decode step was timed")
        if b in seen:
            return _interpolate(self._at(b), tokens)
        below = [x for x in seen if x < b]
        above = [x for x in seen if x > b]
        if not below or not above:
            near = (below or above)[-1 if below else 0]
            return _interpolate(self._at(near), round(tokens * near / b))
        lo, hi = below[-1], above[0]
        y0 = _interpolate(self._at(lo), round(tokens * lo / b))
        y1 = _interpolate(self._at(hi), round(tokens * hi / b))
        return y0 + (y1 - y0) * (b - lo) / (hi - lo)

    def prefill_seconds(self, tokens: int, batch: int = 1) -> float:
        a, s = self.prefill
        return a + s * tokens

    def typical(self, b: int) -> list[float] | None:
        """The decode row seen most often with b requests (for a draft model, its only one:
        b x (k + 1) tokens), None when none was seen."""
        rows = [row for row in self.decode if row[0] == b]
        return max(rows, key=lambda row: row[3]) if rows else None


def _interpolate(points: dict[int, float], x: int) -> float:
    if x in points:
        return points[x]
    below = [p for p in points if p < x]
    above = [p for p in points if p > x]
    if not below:
        return points[min(above)]
    if not above:
        return points[max(below)]
    lo, hi = max(below), min(above)
    return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)


def _line(points: list[tuple[float, float]]) -> list[float]:
    """Least-squares a + s x through (x, y); the mean when x does not vary."""
    if not points:
        return [0.0, 0.0]
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return [my, 0.0]
    s = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return [my - s * mx, s]


def step_costs(steps: list[list[float]]) -> StepCosts:
    """One setting's costs from its timed steps `[requests, tokens, spec_tokens, prefill,
    seconds, draft_seconds, ...]`."""
    decode: dict[tuple[int, int], list[tuple[float, float]]] = {}
    pre: list[tuple[float, float]] = []
    for r, t, _spec, prefill, s, d, *_ in steps:
        if prefill:
            pre.append((t, s))
        else:
            decode.setdefault((int(r), int(t)), []).append((s, d))
    med = statistics.median
    return StepCosts(
        decode=[[r, t, med(x[0] for x in v), len(v), med(x[1] for x in v)] for (r, t), v in sorted(decode.items())],
        prefill=_line(pre),
        steps=sum(len(v) for v in decode.values()),
        prefills=len(pre),
    )


@dataclass
class Sequence:
    """One prompt as the prediction sees it: its length, and per position t (tokens generated
    so far, t = 1..N-1) the proposal vLLM verifies there (`drafted[t]`) and the acceptance
    probability of its known tokens (`acceptance[t]`, positions past the last token unknown
    and taken as accepted: the sequence ends there anyway). Without speculation both empty."""

    prompt_tokens: int
    acceptance: list[list[float]] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)


def _accepted(a: list[float], rng: random.Random) -> int:
    """Leading drafted tokens accepted, each with its probability given the ones before."""
    for i, x in enumerate(a):
        if x < 1.0 and (x <= 0.0 or rng.random() >= x):
            return i
    return len(a)


def _chunk(costs: Any, chunk: list[Sequence], n_tokens: int, rng: random.Random) -> tuple[float, int]:
    """(seconds, decode steps) of one chunk: its prefill step, then decode steps while any
    sequence has fewer than `n_tokens` tokens."""
    seconds = costs.prefill_seconds(sum(s.prompt_tokens for s in chunk), len(chunk))
    t = [1] * len(chunk)  # tokens generated; the prefill gave the first
    steps = 0
    while True:
        active = [i for i, x in enumerate(t) if x < n_tokens]
        if not active:
            return seconds, steps
        fed = 0
        for i in active:
            s = chunk[i]
            d = s.drafted[t[i]] if s.drafted else 0
            fed += 1 + d
            j = _accepted(s.acceptance[t[i]][:d], rng) if d else 0
            t[i] += j + 1
        seconds += costs.step(len(active), fed)
        steps += 1


@dataclass
class Prediction:
    seconds: float  # the prompt set, prefill included
    decode_steps: float  # engine steps after the prefills, over the prompt set (a mean when sampled)


def predict(
    costs: Any, sequences: list[Sequence], batch: int, n_tokens: int, samples: int = SAMPLES, seed: int = 0
) -> Prediction:
    """vLLM generating `n_tokens` tokens for each sequence, in consecutive chunks of `batch`,
    priced with `costs` (a `StepCosts`, or anything with its `step` and `prefill_seconds`:
    `vllm_cost_model.ModelCosts`): exact when every acceptance is 0 or 1, else the mean over `samples`
    sampled runs."""
    exact = all(x in (0.0, 1.0) for s in sequences for a in s.acceptance for x in a)
    runs = 1 if exact else samples
    rng = random.Random(seed)
    seconds = steps = 0.0
    for start in range(0, len(sequences), batch):
        chunk = sequences[start : start + batch]
        for _ in range(runs):
            sec, n = _chunk(costs, chunk, n_tokens, rng)
            seconds += sec / runs
            steps += n / runs
    return Prediction(seconds, steps)


@dataclass
class PricedRow:
    """One (draft, batch size, k): vLLM's step costs, the speedup they predict for our
    acceptance, and vLLM's measured speedup."""

    draft: str
    batch: int
    k: int
    plain_step_ms: float | None  # median no-speculation decode step at the full batch
    verify_step_ms: float | None  # median speculative decode step at the full batch, drafter's time excluded
    draft_ms: float | None  # the drafter's median time in such a step
    predicted_seconds: float
    plain_predicted_seconds: float
    predicted_steps: float  # decode steps over the prompt set, from our acceptance
    vllm_steps: int | None  # decode steps vLLM took (its first repeat)
    predicted_speedup: float
    vllm_speedup: float | None
    vllm_speedup_range: tuple[float, float] | None
    error: float | None  # predicted / measured - 1
    # The same acceptance priced by the cost model fitted from runs without speculation
    # (`vllm_cost_model`), none of this setting's own timings; None when it could not be fitted.
    model_speedup: float | None = None
    model_error: float | None = None  # model_speedup / measured - 1
    model_plain_step_ms: float | None = None  # its plain decode step at B
    model_verify_step_ms: float | None = None  # its verify step at B, k + 1 tokens a request
    model_draft_ms: float | None = None  # its draft proposal at B (0: a proposal without a model)
    # vLLM's speedup in its worker's CPU time (when the steps were timed in CPU time, the clock the
    # predictions are priced in) and the errors against it
    vllm_speedup_cpu: float | None = None
    vllm_speedup_cpu_range: tuple[float, float] | None = None
    error_cpu: float | None = None
    model_error_cpu: float | None = None
    clock: str = "wall"  # the clock the step costs (both predictions') were timed in
