"""Profile drafts for speculative decoding against one target: acceptance, round costs,
predicted and measured speedups.

Passes, in order (each reported through the `progress` callback):
1. the target decodes each prompt's continuation once (greedy at temperature 0, else
   sampled with a per-prompt seed);
2. target and every draft score prompt + continuation teacher-forced, one forward pass
   per sequence, giving exact β per position (`acceptance`) and, per k, the
   acceptance of the drafts a round starting at each position makes;
3. the round costs (`costs.CostTimer`): the plain decode step, the verify step for
   m drafted tokens and each draft's proposals, timed side by side at one context (the
   user's c may replace the draft side);
4. unless `loop=False` (screening): the real draft-k-then-verify loop per prompt, draft
   and k (`decode`), timed against plain decoding of the same prompt run just before
   and just after that prompt's speculative runs (their mean cancels a linear drift of the
   machine's load). The timing rounds of pass 3 are spread between the prompts, so
   predictions and measurements see the same machine;
5. given batch sizes (with the loop): the loop batched at each size (`batch_table`), the
   k-per-batch-size table measured by our loop.

Predictions (`predict`) use passes 2 and 3 only, so screening has them too; where the
loop ran, each k also has its measurement and the prediction's relative error, and k and
drafts are chosen by the measurement (`ranking`). Given a `ProjectionRequest`, the
acceptance of pass 2 also goes, with roofline costs instead of the timed ones, to a
projection onto a GPU type at several concurrencies (`projection`).

What this module does not know: where models and prompts come from, or how results are
printed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from infer_tool.common.progress import Progress, no_progress
from infer_tool.spec.acceptance import Acceptance, beta, summarize
from infer_tool.spec.batch_table import LoopTable, measure
from infer_tool.spec.cached_lm import CachedLM, NonFiniteLogits
from infer_tool.spec.costs import CostTimer, DraftTimes, GivenCostRatio, MeasuredCosts, RoundCosts
from infer_tool.spec.decode import Clock, SpecRun, speculative_decode, target_decode
from infer_tool.spec.drafts import Draft, ModelDraft
from infer_tool.spec.predict import (
    Expectation,
    VllmMetrics,
    alpha_prediction,
    sequence_prediction,
    vllm_measured,
    vllm_predicted,
)
from infer_tool.spec.projection import Projection, ProjectionRequest, project
from infer_tool.spec.ranking import CategoryResult, best, rank, speedup_on
from infer_tool.spec.sampling import warp

TIMING_ROUNDS = 9  # rounds of side-by-side cost timing (after one warm-up round)


@dataclass
class KResult:
    """One lookahead k of one draft. Costs are in target decode steps; speedups are plain
    decoding time / speculative decoding time, prefill excluded."""

    k: int
    verify_cost: float  # v(k): a target pass over k + 1 new tokens
    draft_cost: float  # per round, catch-up included at rate α^k
    cost_ratio: float  # draft_cost / k: the draft's cost per proposed token
    predicted_tokens: float  # tokens per target pass, from the acceptance sequence
    predicted_speedup: float  # from the acceptance sequence and the round costs
    alpha_tokens: float  # (1 − α^(k+1)) / (1 − α)
    alpha_speedup: float  # alpha_tokens / (draft_cost + verify_cost)
    vllm_predicted: VllmMetrics  # from α
    measured_tokens: float | None = None  # decoded tokens / target passes in the loop
    measured_speedup: float | None = None
    error: float | None = None  # predicted_speedup / measured_speedup − 1
    vllm_measured: VllmMetrics | None = None
    accepted_hist: list[int] | None = None  # target passes that accepted 0..k drafted tokens
    target_passes: int | None = None
    seconds: float | None = None  # decode phase, all prompts
    greedy_identical: bool | None = None  # temperature 0: output equals the target's greedy output


@dataclass
class DraftProfile:
    name: str
    acceptance: Acceptance
    cost_ratio: float  # c: the draft proposing one token, in target decode steps
    cost_source: str  # "measured" or "given" (--cost-ratio)
    times: DraftTimes  # measured propose() seconds: per call, per token, catch-up extra
    per_k: list[KResult]
    best_k: int  # on the profile's basis
    slower_everywhere: bool  # slower than plain decoding at every k, on the basis
    per_category: list[CategoryResult] = field(default_factory=list)
    # k -> per prompt, per position: acceptance of the drafts of a round starting there
    # (what `predict.sequence_prediction` needs to predict under other RoundCosts)
    round_acceptance: dict[int, list[list[list[float]]]] = field(default_factory=dict, repr=False)
    # k -> per prompt, per position: tokens such a round drafts when not cut at the end (vLLM's rule)
    round_drafted: dict[int, list[list[int]]] = field(default_factory=dict, repr=False)
    # temperature > 0, a model draft: as round_acceptance, but for drafts proposed as the draft's
    # argmax (vLLM's default draft_sample_method "greedy"): p(argmax q) per position instead of
    # sum min(p, q); empty otherwise (at temperature 0, and for one-hot proposals, the two are equal)
    round_acceptance_argmax: dict[int, list[list[list[float]]]] = field(default_factory=dict, repr=False)


@dataclass
class SpecProfile:
    target: str
    target_step_ms: float
    verify_costs: dict[int, float]  # v(m) at the measured m
    basis: str  # "measured" (the loop ran) or "predicted" (screening)
    baseline_seconds: float | None  # plain decoding, decode phase, all prompts
    tokens: int  # decoded tokens per run over all prompts (prefill tokens excluded)
    drafts: list[DraftProfile]
    ranking: list[dict[str, object]] = field(default_factory=list)
    projection: Projection | None = None  # onto a GPU type at several concurrencies
    continuations: list[list[int]] = field(default_factory=list, repr=False)  # the target's, per prompt
    batched: LoopTable | None = None  # our loop at batch sizes > 1 (`batch_table`), when asked


@contextlib.contextmanager
def where(what: str) -> Iterator[None]:
    """Non-finite logits inside the block are refused naming `what` (the prompt and pass)."""
    try:
        yield
    except NonFiniteLogits as e:
        raise NonFiniteLogits(f"{e}, in {what}: its outputs cannot be profiled") from None


def _generator(seed: int, temperature: float) -> torch.Generator | None:
    return None if temperature == 0 else torch.Generator().manual_seed(seed)


def _k_result(
    k: int,
    alpha: float,
    costs: RoundCosts,
    preds: list[Expectation],
    runs: list[SpecRun] | None,
    plain_seconds: float,
    conts: list[torch.Tensor],
    temperature: float,
) -> KResult:
    a = alpha_prediction(alpha, k, costs)
    tokens = sum(e.tokens for e in preds)
    r = KResult(
        k=k,
        verify_cost=a.verify_cost,
        draft_cost=a.draft_cost,
        cost_ratio=a.draft_cost / k,
        predicted_tokens=tokens / sum(e.passes for e in preds),
        predicted_speedup=tokens / sum(e.cost for e in preds),
        alpha_tokens=a.tokens,
        alpha_speedup=a.speedup,
        vllm_predicted=vllm_predicted(alpha, k),
    )
    if runs is None:
        return r
    accepted = [n for run in runs for n in run.accepted]
    drafted = [n for run in runs for n in run.drafted]
    r.accepted_hist = [accepted.count(n) for n in range(k + 1)]
    r.target_passes = len(accepted)
    r.seconds = sum(run.seconds for run in runs)
    r.measured_tokens = tokens / r.target_passes
    r.measured_speedup = plain_seconds / r.seconds
    r.error = r.predicted_speedup / r.measured_speedup - 1.0
    r.vllm_measured = vllm_measured(accepted, drafted, k)
    if temperature == 0:
        r.greedy_identical = all(torch.equal(run.tokens, c) for run, c in zip(runs, conts))
    return r


@dataclass
class _Figures:
    k: int
    predicted_speedup: float
    measured_speedup: float | None


def _categories(
    categories: list[str | None],
    betas: list[torch.Tensor],
    ks: list[int],
    basis: str,
    preds: dict[int, list[Expectation]],
    runs: dict[int, list[SpecRun]] | None,
    plain: list[float],
) -> list[CategoryResult]:
    """Per category: pooled α, and each k's speedup over the category's prompts."""
    out = []
    for cat in sorted({c for c in categories if c is not None}):
        idx = [i for i, c in enumerate(categories) if c == cat]
        per_k = []
        for k in ks:
            pred = sum(preds[k][i].tokens for i in idx) / sum(preds[k][i].cost for i in idx)
            meas = sum(plain[i] for i in idx) / sum(runs[k][i].seconds for i in idx) if runs else None
            per_k.append(_Figures(k, pred, meas))
        b = best(per_k, basis)
        out.append(
            CategoryResult(
                category=cat,
                prompts=len(idx),
                alpha=float(torch.cat([betas[i] for i in idx]).double().mean()),
                best_k=b.k,
                speedup=speedup_on(b, basis),
                predicted_speedup=b.predicted_speedup,
            )
        )
    return out


def profile(
    target_name: str,
    target: torch.nn.Module,
    vocab: int,
    drafts: list[Draft],
    prompts: list[torch.Tensor],
    *,
    ks: list[int],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    cost_ratio: float | None,
    seed: int,
    categories: list[str | None] | None = None,
    loop: bool = True,
    timing_rounds: int = TIMING_ROUNDS,
    clock: Clock = time.perf_counter,
    n_boot: int = 1000,
    projection: ProjectionRequest | None = None,
    batch_sizes: list[int] | None = None,
    progress: Progress | None = None,
) -> SpecProfile:
    """Profile every draft against `target` on `prompts` (each (P_i,) int64) for each k;
    `max_new_tokens` >= 2 (the first token comes from the prefill). `clock` times every
    pass (wall time by default). `projection`: also project the speedups onto its GPU
    and concurrencies (its pass times list the drafts in the order of `drafts`). `batch_sizes`
    (with the loop): also run the loop batched at each size (`batch_table`)."""
    progress = progress or no_progress
    lm = CachedLM(target, vocab, name=f"target {target_name}")
    n, N = len(prompts), max_new_tokens
    categories = categories or [None] * n

    conts = []
    for i, prompt in enumerate(prompts):
        with where(f"the target's decode of prompt {i + 1} of {n}"):
            run = target_decode(lm, prompt, N, temperature, top_p, _generator(seed + i, temperature))
        conts.append(run.tokens)
        progress("target decode", i + 1, n)

    betas: list[list[torch.Tensor]] = [[] for _ in drafts]
    acc: list[dict[int, list[list[list[float]]]]] = [{k: [] for k in ks} for _ in drafts]
    drafted: list[dict[int, list[list[int]]]] = [{k: [] for k in ks} for _ in drafts]
    argmax_acc: list[dict[int, list[list[list[float]]]]] = [{} for _ in drafts]
    for i, (prompt, cont) in enumerate(zip(prompts, conts)):
        seq = torch.cat([prompt, cont])
        P = prompt.shape[0]
        with where(f"the teacher-forced scoring of prompt {i + 1} of {n}"):
            p = warp(lm.score(seq)[P - 1 : -1], temperature, top_p)  # (N, V)
        for j, draft in enumerate(drafts):
            with where(f"the teacher-forced scoring of prompt {i + 1} of {n}"):
                q = draft.teacher_forced(seq, P, temperature, top_p)
            b = beta(p, q)
            betas[j].append(b)
            for k in ks:
                acc[j][k].append(draft.round_acceptance(seq, P, k, p, b))
                drafted[j][k].append(draft.round_drafted(seq, P, k))
            if temperature > 0 and isinstance(draft, ModelDraft):
                g = p.gather(-1, q.argmax(-1, keepdim=True)).squeeze(-1)  # p(argmax q) per position
                for k in ks:
                    argmax_acc[j].setdefault(k, []).append(draft.round_acceptance(seq, P, k, p, g))
        progress("acceptance", i + 1, n)

    # Cost timing rounds run before, between and after the prompts' loop runs, so that the
    # costs the predictions use see the same machine as the measurements.
    context = torch.cat([prompts[0], conts[0][: N // 2 + 1]])  # a mid-generation context
    timer = CostTimer(lm, drafts, context, [0, 1, *ks], temperature, top_p, seed, clock)
    with where("the cost timing (a context from prompt 1)"):
        timer.round(keep=False)  # warm-up
    slots = [r * (n + 1) // timing_rounds if loop else 0 for r in range(timing_rounds)]

    def time_rounds(slot: int) -> None:
        for _ in range(slots.count(slot)):
            with where("the cost timing (a context from prompt 1)"):
                timer.round()
            progress("cost timing", len(timer.steps), timing_rounds)

    runs: list[dict[int, list[SpecRun]]] | None = None
    plain: list[float] = []
    if loop:
        runs = [{k: [] for k in ks} for _ in drafts]
        total, done = n * len(drafts) * len(ks), 0
        for i, prompt in enumerate(prompts):
            time_rounds(i)
            args = (N, temperature, top_p)
            with where(f"the speculative loop over prompt {i + 1} of {n}"):
                before = target_decode(lm, prompt, *args, _generator(seed + i, temperature), clock).seconds
                for j, draft in enumerate(drafts):
                    for k in ks:
                        runs[j][k].append(
                            speculative_decode(lm, draft, prompt, k, *args, _generator(seed + i, temperature), clock)
                        )
                        done += 1
                        progress("speculative decode", done, total)
                after = target_decode(lm, prompt, *args, _generator(seed + i, temperature), clock).seconds
            plain.append((before + after) / 2)
    time_rounds(n if loop else 0)
    target_times, draft_times = timer.result()
    costs: list[RoundCosts] = [
        GivenCostRatio(target_times, cost_ratio) if cost_ratio is not None else MeasuredCosts(target_times, t)
        for t in draft_times
    ]
    preds = [{k: [sequence_prediction(a, k, costs[j]) for a in acc[j][k]] for k in ks} for j in range(len(drafts))]
    summaries = [summarize(b, n_boot, seed) for b in betas]
    projected = None
    if projection is not None:  # the same acceptance, the roofline's costs
        projected = project(projection, [d.name for d in drafts], [a.alpha for a in summaries], acc, ks)

    table = None
    if loop and batch_sizes:
        with where("the batched loop"):
            table = measure(
                target,
                vocab,
                drafts,
                prompts,
                ks=ks,
                batch_sizes=batch_sizes,
                max_new_tokens=N,
                temperature=temperature,
                top_p=top_p,
                seed=seed,
                continuations=conts,
                acceptance=acc,
                drafted=drafted,
                clock=clock,
                name=target_name,
                progress=progress,
            )

    basis = "measured" if loop else "predicted"
    profiles = []
    for j, draft in enumerate(drafts):
        acceptance = summaries[j]
        per_k = [
            _k_result(
                k, acceptance.alpha, costs[j], preds[j][k], runs[j][k] if runs else None, sum(plain), conts, temperature
            )
            for k in ks
        ]
        profiles.append(
            DraftProfile(
                name=draft.name,
                acceptance=acceptance,
                cost_ratio=costs[j].draft(1, False),
                cost_source="given" if cost_ratio is not None else "measured",
                times=draft_times[j],
                per_k=per_k,
                best_k=best(per_k, basis).k,
                slower_everywhere=all(speedup_on(r, basis) < 1.0 for r in per_k),
                per_category=_categories(categories, betas[j], ks, basis, preds[j], runs[j] if runs else None, plain),
                round_acceptance=acc[j],
                round_drafted=drafted[j],
                round_acceptance_argmax=argmax_acc[j],
            )
        )
    return SpecProfile(
        target=target_name,
        target_step_ms=1000.0 * target_times.step_seconds,
        verify_costs={m: target_times.verify(m) for m in sorted(target_times.pass_seconds)},
        basis=basis,
        baseline_seconds=sum(plain) if loop else None,
        tokens=n * (N - 1),
        drafts=profiles,
        ranking=rank(profiles, basis),
        projection=projected,
        continuations=[c.tolist() for c in conts],
        batched=table,
    )
