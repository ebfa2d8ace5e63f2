"""Profile drafts for speculative decoding against one target: acceptance, cost, speedup.

Passes, in order (each reported through the `progress` callback):
1. the target decodes each prompt's continuation once (greedy at temperature 0, else
   sampled with a per-prompt seed);
2. target and every draft score prompt + continuation teacher-forced, one forward pass
   per sequence, giving exact β per position (`spec_acceptance`);
3. the cost ratio c = median draft decode step / median target decode step at batch 1,
   timed in alternating chunks (unless given);
4. the real draft-k-then-verify loop per prompt, draft and k (`spec_decode`), with the
   accepted-length histogram, timed against plain decoding of the same prompt re-run
   just before (interleaving keeps a shared machine's load drift out of the ratio).

What this module does not know: where models and prompts come from, or how results
are printed.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from infer_tool.common.progress import Progress, no_progress
from infer_tool.evals.spec_acceptance import (
    Acceptance,
    beta,
    expected_tokens,
    predicted_speedup,
    summarize,
    vllm_rate,
)
from infer_tool.evals.spec_decode import DecodeRun, SpecRun, speculative_decode, target_decode
from infer_tool.evals.spec_drafts import Draft, ModelDraft
from infer_tool.evals.spec_models import CachedLM
from infer_tool.evals.spec_sampling import warp

LATENCY_STEPS = 8  # decode steps per timing chunk for the cost ratio
LATENCY_ROUNDS = 4  # alternating target/draft chunks


@dataclass
class KResult:
    """One lookahead k of one draft."""

    k: int
    expected_tokens: float  # (1 − α^(k+1)) / (1 − α)
    measured_tokens: float  # emitted tokens / target passes in the real loop
    predicted_speedup: float
    measured_speedup: float  # plain decoding seconds / speculative seconds, same tokens
    predicted_vllm_rate: float  # E[accepted] / k
    measured_vllm_rate: float  # accepted / drafted in the real loop
    accepted_hist: list[int]  # target passes that accepted 0..k drafted tokens
    target_passes: int
    seconds: float
    greedy_identical: bool | None  # temperature 0: output equals the target's greedy output


@dataclass
class DraftProfile:
    name: str
    acceptance: Acceptance
    cost_ratio: float
    cost_ratio_source: str  # "measured" or "given"
    draft_step_ms: float
    per_k: list[KResult]
    best_k: int  # by predicted speedup
    best_k_measured: int


@dataclass
class SpecProfile:
    target: str
    target_step_ms: float
    baseline_seconds: float  # plain decoding, re-timed next to the speculative runs
    tokens: int  # generated tokens per run (prompts × max_new_tokens)
    drafts: list[DraftProfile]
    ranking: list[dict[str, object]] = field(default_factory=list)


def _median_ms(seconds: list[float]) -> float:
    return 1000.0 * statistics.median(seconds) if seconds else float("nan")


def _generator(seed: int, temperature: float) -> torch.Generator | None:
    return None if temperature == 0 else torch.Generator().manual_seed(seed)


def rank(drafts: list[DraftProfile]) -> list[dict[str, object]]:
    """Drafts ordered by predicted speedup at their best k, each with a reason sentence."""
    def best(d: DraftProfile) -> KResult:
        return next(r for r in d.per_k if r.k == d.best_k)

    ordered = sorted(drafts, key=lambda d: best(d).predicted_speedup, reverse=True)
    ranking: list[dict[str, object]] = []
    for i, d in enumerate(ordered):
        b = best(d)
        a = d.acceptance.alpha
        reason = (
            f"alpha {a:.3f} at cost ratio c {d.cost_ratio:.3g}: at k={b.k} a target pass yields "
            f"{b.expected_tokens:.2f} tokens for {b.k * d.cost_ratio + 1:.2f} target-step costs, "
            f"predicted {b.predicted_speedup:.2f}x (measured {b.measured_speedup:.2f}x)"
        )
        cheaper_losers = [o for o in ordered[i + 1 :] if o.acceptance.alpha > a]
        dearer_winners = [o for o in ordered[:i] if o.acceptance.alpha < a]
        if cheaper_losers:
            o = cheaper_losers[0]
            reason += (
                f"; ranks above {o.name} despite lower acceptance ({a:.3f} < "
                f"{o.acceptance.alpha:.3f}) because its steps are cheaper (c {d.cost_ratio:.3g} "
                f"vs {o.cost_ratio:.3g})"
            )
        if dearer_winners:
            o = dearer_winners[0]
            reason += (
                f"; higher acceptance than {o.name} ({a:.3f} > {o.acceptance.alpha:.3f}) but "
                f"loses to it: its cost ratio c {d.cost_ratio:.3g} (vs {o.cost_ratio:.3g}) "
                "makes each round dearer"
            )
        if b.predicted_speedup < 1.0:
            reason += "; predicted slower than plain decoding at every k tried"
        ranking.append(
            {"rank": i + 1, "name": d.name, "best_k": b.k, "predicted_speedup": b.predicted_speedup,
             "measured_speedup": b.measured_speedup, "reason": reason}
        )
    return ranking


def profile(
    target_name: str,
    target: torch.nn.Module,
    vocab: int,
    drafts: list[Draft],
    prompts: list[torch.Tensor],
    ks: list[int],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    *,
    cost_ratio: float | None,
    seed: int,
    n_boot: int = 1000,
    progress: Progress | None = None,
) -> SpecProfile:
    """Measure every draft against `target` on `prompts` (each (P_i,) int64) for each k."""
    progress = progress or no_progress
    lm = CachedLM(target, vocab)
    n = len(prompts)

    baseline: list[DecodeRun] = []
    for i, prompt in enumerate(prompts):
        baseline.append(target_decode(lm, prompt, max_new_tokens, temperature, top_p, _generator(seed + i, temperature)))
        progress("target decode", i + 1, n)
    target_steps = [s for run in baseline for s in run.step_seconds]
    target_step_ms = _median_ms(target_steps)

    betas: list[list[torch.Tensor]] = [[] for _ in drafts]
    for i, (prompt, run) in enumerate(zip(prompts, baseline)):
        seq = torch.cat([prompt, run.tokens])
        P = prompt.shape[0]
        p = warp(lm.score(seq)[P - 1 : -1], temperature, top_p)  # (T, V)
        for j, draft in enumerate(drafts):
            betas[j].append(beta(p, draft.teacher_forced(seq, P, temperature, top_p)))
        progress("acceptance", i + 1, n)

    # Cost ratio: draft and target decode steps timed in alternating chunks, so that a
    # drift in machine load hits both medians alike.
    target_as_draft = ModelDraft("target", target, vocab)
    step_ms: list[float] = []
    ratios: list[float] = []
    for j, draft in enumerate(drafts):
        d_steps: list[float] = []
        t_steps: list[float] = []
        for _ in range(LATENCY_ROUNDS):
            t_steps += target_as_draft.step_seconds(prompts[0], LATENCY_STEPS)
            d_steps += draft.step_seconds(prompts[0], LATENCY_STEPS)
        step_ms.append(_median_ms(d_steps))
        ratios.append(_median_ms(d_steps) / _median_ms(t_steps))
        progress("cost ratio", j + 1, len(drafts))

    # The real loop, prompt by prompt: the plain baseline is re-timed next to the
    # speculative runs of the same prompt, so both see the same machine load.
    runs: dict[tuple[int, int], list[SpecRun]] = {(j, k): [] for j in range(len(drafts)) for k in ks}
    plain_seconds = 0.0
    total = n * len(drafts) * len(ks)
    for i, prompt in enumerate(prompts):
        plain_seconds += target_decode(lm, prompt, max_new_tokens, temperature, top_p,
                                       _generator(seed + i, temperature)).seconds
        for j, draft in enumerate(drafts):
            for k in ks:
                runs[j, k].append(speculative_decode(lm, draft, prompt, k, max_new_tokens, temperature,
                                                     top_p, _generator(seed + i, temperature)))
                progress("speculative decode", sum(len(r) for r in runs.values()), total)

    profiles: list[DraftProfile] = []
    for j, draft in enumerate(drafts):
        acc = summarize(betas[j], n_boot, seed)
        c = cost_ratio if cost_ratio is not None else ratios[j]
        per_k: list[KResult] = []
        for k in ks:
            rs = runs[j, k]
            hist = [0] * (k + 1)
            for r in rs:
                for a in r.accepted:
                    hist[a] += 1
            passes = sum(r.target_passes for r in rs)
            drafted = sum(sum(r.drafted) for r in rs)
            seconds = sum(r.seconds for r in rs)
            per_k.append(KResult(
                k=k,
                expected_tokens=expected_tokens(acc.alpha, k),
                measured_tokens=n * max_new_tokens / passes,
                predicted_speedup=predicted_speedup(acc.alpha, k, c),
                measured_speedup=plain_seconds / seconds,
                predicted_vllm_rate=vllm_rate(acc.alpha, k),
                measured_vllm_rate=sum(sum(r.accepted) for r in rs) / drafted if drafted else 0.0,
                accepted_hist=hist,
                target_passes=passes,
                seconds=seconds,
                greedy_identical=(
                    all(torch.equal(r.tokens, b.tokens) for r, b in zip(rs, baseline))
                    if temperature == 0 else None
                ),
            ))
        profiles.append(DraftProfile(
            name=draft.name,
            acceptance=acc,
            cost_ratio=c,
            cost_ratio_source="given" if cost_ratio is not None else "measured",
            draft_step_ms=step_ms[j],
            per_k=per_k,
            best_k=max(per_k, key=lambda r: r.predicted_speedup).k,
            best_k_measured=max(per_k, key=lambda r: r.measured_speedup).k,
        ))
    return SpecProfile(
        target=target_name,
        target_step_ms=target_step_ms,
        baseline_seconds=plain_seconds,
        tokens=n * max_new_tokens,
        drafts=profiles,
        ranking=rank(profiles),
    )
