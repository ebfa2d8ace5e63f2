"""What one speculative round costs, in target decode steps, and how it is measured.

A round with lookahead k drafts m <= k tokens and verifies them in one target pass over
the m + 1 new tokens. In units of one plain decode step of the target (the cost of one
token without speculation) the round costs

    draft(m, catch_up) + verify(m)

- verify(m) = v(m): a target pass over m + 1 new tokens (with the round's acceptance
  step) / a plain decode step. On a GPU at batch 1 it stays near 1 for small m; on a CPU,
  or at a server's batch sizes, it grows with m, and a speedup model that assumes v = 1
  picks too large a k.
- draft(m, catch_up): the draft's work in the round; `catch_up` when the previous round
  accepted all its drafts, so the draft's first pass also feeds the last drafted token,
  which it proposed but never consumed.

`RoundCosts` is all that predictions (`predict`) know about hardware. Three
implementations: `MeasuredCosts`, timed here on the machine the profile runs on;
`GivenCostRatio`, which keeps the measured v(m) but takes the draft's cost per proposed
token from the user (`--cost-ratio`); and `RooflineCosts`, a projection to a GPU type at
a batch size (sizing's roofline: a target pass over batch x (m + 1) tokens against a
batch-wide decode step, the draft's steps at the same batch on the same GPU). Acceptance
does not change with the hardware, so the same acceptance goes with any of them.

What this module does not know: acceptance, or how drafts propose tokens (it only calls
`propose`, `prefill` and `rollback`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from infer_tool.spec.cached_lm import CachedLM
from infer_tool.spec.decode import Clock, gc_paused
from infer_tool.spec.drafts import Draft
from infer_tool.spec.sampling import sample, verify, warp


class RoundCosts(Protocol):
    """Costs of the parts of one speculative round, in target decode steps."""

    def verify(self, m: int) -> float:
        """v(m): the verify step for m drafted tokens; v(0) is a plain step plus a round's
        acceptance bookkeeping, about 1."""
        ...

    def draft(self, m: int, catch_up: bool) -> float:
        """The draft proposing m tokens (m = 0: a lookup that found nothing)."""
        ...


def _interpolate(points: dict[int, float], m: int) -> float:
    """points[m] when measured, else linear between the nearest measured m (flat beyond)."""
    if m in points:
        return points[m]
    below = [x for x in points if x < m]
    above = [x for x in points if x > m]
    if not above:
        return points[max(below)]
    lo, hi = max(below), min(above)
    return points[lo] + (points[hi] - points[lo]) * (m - lo) / (hi - lo)


@dataclass
class TargetTimes:
    """Median seconds of the target's side of the loops: a plain decode step (pass over one
    token, pick, append) and a round's verify step for m drafted tokens (pass over m + 1
    tokens, acceptance, append, cache rollback)."""

    step_seconds: float
    pass_seconds: dict[int, float]

    def verify(self, m: int) -> float:
        return _interpolate(self.pass_seconds, m) / self.step_seconds


@dataclass
class DraftTimes:
    """Median seconds of one `propose` call, fitted as call + m·token (+ catch_up):
    a model draft costs ~token per drafted token, prompt lookup ~call per round."""

    call: float
    token: float
    catch_up: float


@dataclass
class MeasuredCosts:
    """`RoundCosts` from times measured on this machine, side by side."""

    target: TargetTimes
    times: DraftTimes

    def verify(self, m: int) -> float:
        return self.target.verify(m)

    def draft(self, m: int, catch_up: bool) -> float:
        t = self.times
        return (t.call + m * t.token + (t.catch_up if catch_up else 0.0)) / self.target.step_seconds


@dataclass
class GivenCostRatio:
    """The measured v(m) with a given draft cost c per proposed token (catch-up included)."""

    target: TargetTimes
    c: float

    def verify(self, m: int) -> float:
        return self.target.verify(m)

    def draft(self, m: int, catch_up: bool) -> float:
        return self.c * m


@dataclass
class RooflineCosts:
    """`RoundCosts` projected by the roofline (`spec.roofline`) onto one GPU type at
    one batch size B, from seconds of whole-batch passes:

    - verify(m) = target pass over B x (m + 1) tokens / target pass over B x 1 tokens;
    - draft(m, catch_up) = the draft's m passes at batch B (the first over 2 tokens per
      sequence after a fully accepted round, the rest over 1) / the target's step; no
      passes when m = 0. A free draft (prompt lookup, on the CPU beside the GPU) has
      `draft_step_s = draft_catch_up_s = 0`."""

    step_s: float  # target pass over B x 1 tokens
    pass_s: dict[int, float]  # m -> target pass over B x (m + 1) tokens, m = 0 included
    draft_step_s: float  # draft pass over B x 1 tokens
    draft_catch_up_s: float  # draft pass over B x 2 tokens

    def verify(self, m: int) -> float:
        return self.pass_s[m] / self.step_s

    def draft(self, m: int, catch_up: bool) -> float:
        if m == 0:
            return 0.0
        first = self.draft_catch_up_s if catch_up else self.draft_step_s
        return (first + (m - 1) * self.draft_step_s) / self.step_s


def _seconds(fn: Callable[[], object], clock: Clock) -> float:
    t0 = clock()
    fn()
    return clock() - t0


class CostTimer:
    """Times, at `context` (L,) (its last token not yet in the caches, as at a round's
    start), the steps `decode`'s loops are made of: the plain decode step; the verify
    step for every m in `ms` (0 included); for each draft, `propose` of 1 token, of
    min(max(ms), 4) >= 2 tokens, and of 1 token with its cache two tokens behind
    (catch-up), each right after a verify step as in the loop.

    One `round()` times everything once, in turn, with the garbage collector paused as in
    the loops (`decode.gc_paused`); rounds can be spread over a long run so that the
    medians see the same machine as the loop does. The caches are re-filled at each round,
    so the models may be used for other work in between."""

    def __init__(
        self,
        target: CachedLM,
        drafts: list[Draft],
        context: torch.Tensor,
        ms: list[int],
        temperature: float,
        top_p: float,
        seed: int = 0,
        clock: Clock = time.perf_counter,
    ):
        self.target, self.drafts, self.context, self.clock = target, drafts, context, clock
        self.temperature, self.top_p = temperature, top_p
        self.ms = sorted(set(ms) | {0})
        self.gen = None if temperature == 0 else torch.Generator().manual_seed(seed)
        self.filler = context.new_zeros(max(self.ms))  # token values do not change a pass's cost
        self.steps: list[float] = []
        self.passes: dict[int, list[float]] = {m: [] for m in self.ms}
        self.long = max(2, min(4, self.ms[-1]))  # the longer proposal timed, for the per-token slope
        self.proposals = [{"one": [], "long": [], "catch_up": []} for _ in drafts]

    def _plain_step(self) -> None:
        ctx, T = self.context, self.temperature
        p = warp(self.target.extend(ctx)[-1], T, self.top_p)
        torch.cat([ctx, ctx.new_tensor([int(p.argmax()) if T == 0 else sample(p, self.gen)])])
        self.target.rollback(ctx.shape[0] - 1)

    def _verify_step(self, m: int) -> None:
        ctx, x = self.context, self.filler[:m]
        p = warp(self.target.extend(torch.cat([ctx, x]))[-(m + 1) :], self.temperature, self.top_p)
        n, y = verify(p, torch.nn.functional.one_hot(x, p.shape[-1]).float(), x, self.gen)
        torch.cat([ctx, x[:n], ctx.new_tensor([y])])
        self.target.rollback(ctx.shape[0] - 1)

    def _propose(self, d: Draft, n: int, behind: int) -> None:
        d.rollback(self.context.shape[0] - behind)
        d.propose(self.context, n, self.temperature, self.top_p, self.gen)

    def round(self, keep: bool = True) -> None:
        """Time every step once; `keep=False` for a warm-up."""
        ctx, clock = self.context, self.clock
        self.target.reset()
        self.target.extend(ctx[:-1])
        for d in self.drafts:
            d.prefill(ctx[:-1])
        with gc_paused():
            s = _seconds(self._plain_step, clock)
            self.steps += [s] if keep else []
            for m in self.ms:
                s = _seconds(lambda m=m: self._verify_step(m), clock)
                self.passes[m] += [s] if keep else []
            for d, samples in zip(self.drafts, self.proposals):
                for key, n, behind in (("one", 1, 1), ("long", self.long, 1), ("catch_up", 1, 2)):
                    self._verify_step(1)  # leaves the machine as the loop's verify step does
                    s = _seconds(lambda d=d, n=n, behind=behind: self._propose(d, n, behind), clock)
                    samples[key] += [s] if keep else []

    def result(self) -> tuple[TargetTimes, list[DraftTimes]]:
        """Medians over the kept rounds (at least one)."""
        med = statistics.median
        target_times = TargetTimes(med(self.steps), {m: med(v) for m, v in self.passes.items()})
        draft_times = []
        for samples in self.proposals:
            one, long, catch_up = med(samples["one"]), med(samples["long"]), med(samples["catch_up"])
            token = max((long - one) / (self.long - 1), 0.0)
            draft_times.append(DraftTimes(call=max(one - token, 0.0), token=token, catch_up=max(catch_up - one, 0.0)))
        return target_times, draft_times
