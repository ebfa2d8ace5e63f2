"""A step-cost model of vLLM fitted from runs without speculation, and the prices it gives a
speculative run: the prediction that does not use the speculative runs' own timings.

The worker's probes (`vllm_worker.run_probe`) run a model alone, without speculation, and
time its engine steps `[requests, tokens, spec_tokens, prefill, seconds, draft_seconds,
forward_seconds, logits_seconds]`: plain decoding at each batch size B (1 query token a
request) and, over a cached prefix, one step of q query tokens a request for q = 1 .. k + 1.
`fit` keeps medians per (B, q) in a `ModelFit`:
- `decode[B]`: a plain decode step, whole (schedule, forward, head, sampling, output);
- `query[B][q]`: a cached-prefix step of q tokens a request, whole; only its growth over q = 1
  is used (a new request's admission costs what it costs at every q);
- the same two for the model's own work, forward plus head (`decode_pass`, `query_pass`);
- `logits_row`: the head's seconds per extra row (the slope of its median seconds over the
  decode steps' B rows: a cached-prefix step computes the head on one row a request, a verify
  step on q; 0 with one batch size);
- prefill lines `a + s x tokens`, whole step and model work.

`fit.verify(B, q)` = decode[B] + (query[B][q] - query[B][1]) + logits_row x B x (q - 1): the
target's step that scores q tokens a request. `fit.pass_(B, q)` = decode_pass[B] +
(query_pass[B][q] - query_pass[B][1]): one forward and head of the model over q tokens a
request. Between measured B (or q) linear, flat beyond.

`ModelCosts` prices a decode step of a speculative run with k (the interface
`vllm_costs.predict` takes): the target's verify step over the tokens fed, plus for a draft
model its proposal as vLLM's draft-model proposer runs it (`SpecDecodeBaseProposer.propose`):
one pass over the tokens the target scored, then k - 1 passes of one token a request, each
priced by the draft measured alone. A prefill step: the target's prefill line, plus the
draft's prefill pass and its k - 1 one-token passes. A proposal without a model (n-gram,
suffix) costs nothing here. Not in the model: the proposer's own bookkeeping outside the
draft's forward and head, the rejection sampler, and how a real verify step's attention
differs from a cached-prefix prefill's.

What this module does not know: where acceptance comes from or how rounds are counted
(`vllm_costs.predict`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from infer_tool.spec.vllm_costs import _interpolate, _line


@dataclass
class ModelFit:
    """One model's costs measured alone, without speculation (median seconds; see the module docstring)."""

    decode: dict[int, float]
    decode_pass: dict[int, float]
    query: dict[int, dict[int, float]]
    query_pass: dict[int, dict[int, float]]
    logits_row: float
    prefill: list[float]  # [a, s], whole prefill step
    prefill_pass: list[float]  # [a, s], forward and head of a prefill step
    steps: int = 0  # steps used
    misses: list[str] = field(default_factory=list)  # probe steps that did not hit the cache (left out)

    def _by_batch(self, b: float, at: Callable[[int], float]) -> float:
        seen = sorted(self.decode)
        if b in self.decode:
            return at(int(b))
        below, above = [x for x in seen if x < b], [x for x in seen if x > b]
        if not below or not above:
            return at((below or above)[-1 if below else 0])
        lo, hi = below[-1], above[0]
        return at(lo) + (at(hi) - at(lo)) * (b - lo) / (hi - lo)

    def _growth(self, table: dict[int, dict[int, float]], b: int, q: float) -> float:
        points = table.get(b, {})
        if 1 not in points or q <= 1:
            return 0.0
        return _interpolate(points, q) - points[1]

    def verify(self, b: float, q: float) -> float:
        """Seconds of the target's engine step scoring q tokens for each of b requests (at least
        the cheapest step measured at that batch size: medians of short, noisy steps can make
        the growth over q negative)."""
        return self._by_batch(
            b,
            lambda x: max(
                self.decode[x] + self._growth(self.query, x, q) + self.logits_row * x * (q - 1),
                _floor(self.decode[x], self.query.get(x, {})),
            ),
        )

    def pass_(self, b: float, q: float) -> float:
        """Seconds of one forward and head of this model over q tokens for each of b requests
        (at least the cheapest measured at that batch size)."""
        return self._by_batch(
            b,
            lambda x: max(
                self.decode_pass[x] + self._growth(self.query_pass, x, q),
                _floor(self.decode_pass[x], self.query_pass.get(x, {})),
            ),
        )

    def prefill_seconds(self, tokens: float) -> float:
        return self.prefill[0] + self.prefill[1] * tokens

    def prefill_pass_seconds(self, tokens: float) -> float:
        return self.prefill_pass[0] + self.prefill_pass[1] * tokens


def _floor(decode: float, query: dict[int, float]) -> float:
    return min([decode, *query.values()])


def fit(records: list[dict]) -> ModelFit:
    """A `ModelFit` from one probe setting's records `{"probe": "decode" | q, "batch", "steps"}`."""
    med = statistics.median
    decode: dict[int, list[tuple[float, float]]] = {}
    query: dict[tuple[int, int], list[tuple[float, float]]] = {}
    rows: dict[int, list[float]] = {}
    pre: list[tuple[float, float]] = []
    pre_pass: list[tuple[float, float]] = []
    misses: list[str] = []
    used = 0
    for rec in records:
        b, kind = int(rec["batch"]), rec["probe"]
        for r, t, _spec, prefill, s, _d, fwd, logits in rec["steps"]:
            work = fwd + logits
            if kind == "decode":
                if prefill:
                    pre.append((t, s))
                    pre_pass.append((t, work))
                    used += 1
                elif int(r) == b:
                    decode.setdefault(b, []).append((s, work))
                    rows.setdefault(b, []).append(logits)
                    used += 1
            elif int(r) == b and int(t) == b * int(kind):
                query.setdefault((b, int(kind)), []).append((s, work))
                used += 1
            elif int(r) == b:
                misses.append(f"B={b} q={kind}: {int(t)} tokens scheduled, not {b * int(kind)}")
    if not decode:
        raise ValueError("no plain decode step was timed")
    q_whole: dict[int, dict[int, float]] = {}
    q_pass: dict[int, dict[int, float]] = {}
    for (b, q), v in sorted(query.items()):
        q_whole.setdefault(b, {})[q] = med(x[0] for x in v)
        q_pass.setdefault(b, {})[q] = med(x[1] for x in v)
    return ModelFit(
        decode={b: med(x[0] for x in v) for b, v in sorted(decode.items())},
        decode_pass={b: med(x[1] for x in v) for b, v in sorted(decode.items())},
        query=q_whole,
        query_pass=q_pass,
        logits_row=max(0.0, _line([(b, med(v)) for b, v in sorted(rows.items())])[1]),
        prefill=_line(pre),
        prefill_pass=_line(pre_pass),
        steps=used,
        misses=misses,
    )


@dataclass
class ModelCosts:
    """The prices of one speculative setting (k > 0) or of no speculation (k = 0), from the
    target's and the draft's fits; `draft` None: proposals cost nothing (n-gram, suffix)."""

    target: ModelFit
    draft: ModelFit | None
    k: int
    first_pass: float | None = None  # tokens a request of the draft's first pass; None: the target's q (vLLM)
    prefill: bool = True  # False: prefill steps cost nothing (a loop timed without its prefill)

    def draft_seconds(self, b: float, q: float) -> float:
        """The draft model's proposal of k tokens for b requests after the target scored q a request."""
        if self.draft is None or self.k == 0:
            return 0.0
        first = q if self.first_pass is None else self.first_pass
        return self.draft.pass_(b, first) + (self.k - 1) * self.draft.pass_(b, 1)

    def step(self, b: int, tokens: int) -> float:
        q = tokens / b
        return self.target.verify(b, q) + self.draft_seconds(b, q)

    def prefill_seconds(self, tokens: int, batch: int = 1) -> float:
        if not self.prefill:
            return 0.0
        s = self.target.prefill_seconds(tokens)
        if self.draft is not None and self.k:
            s += self.draft.prefill_pass_seconds(tokens) + (self.k - 1) * self.draft.pass_(batch, 1)
        return s
