"""Plain target decoding and the draft-k-then-verify loop, batch 1, with KV caches.

Both produce exactly `max_new_tokens` tokens (end-of-sequence tokens do not stop them), so
their wall-clock times compare the same amount of work. The speculative loop drafts
min(k, tokens left - 1) tokens, verifies them in one target pass over the new tokens,
accepts a prefix with `spec_sampling.verify`, and rolls both caches back to the accepted
prefix (`DynamicCache.crop`). At temperature 0 its output is the target's greedy output.

What this module does not know: acceptance statistics or ranking (`spec_profile`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from infer_tool.evals.spec_drafts import Draft
from infer_tool.evals.spec_models import CachedLM
from infer_tool.evals.spec_sampling import sample, verify, warp


@dataclass
class DecodeRun:
    """One sequence decoded by the target alone."""

    tokens: torch.Tensor  # (max_new_tokens,)
    seconds: float  # whole run, prefill included
    step_seconds: list[float] = field(default_factory=list)  # single-token decode steps


@dataclass
class SpecRun:
    """One sequence decoded speculatively."""

    tokens: torch.Tensor  # (max_new_tokens,)
    seconds: float
    accepted: list[int]  # accepted drafted tokens per target pass
    drafted: list[int]  # drafted tokens per target pass

    @property
    def target_passes(self) -> int:
        return len(self.accepted)


def _pick(probs: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    return int(probs.argmax()) if temperature == 0 else sample(probs, generator)


def target_decode(
    target: CachedLM,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
) -> DecodeRun:
    """Autoregressive decoding of `max_new_tokens` tokens after `prompt` (P,)."""
    t0 = time.perf_counter()
    target.reset()
    seq = prompt
    steps: list[float] = []
    logits = target.extend(seq)[-1]
    for i in range(max_new_tokens):
        x = _pick(warp(logits, temperature, top_p), temperature, generator)
        seq = torch.cat([seq, seq.new_tensor([x])])
        if i + 1 < max_new_tokens:
            ts = time.perf_counter()
            logits = target.extend(seq)[-1]
            steps.append(time.perf_counter() - ts)
    return DecodeRun(seq[prompt.shape[0] :], time.perf_counter() - t0, steps)


def speculative_decode(
    target: CachedLM,
    draft: Draft,
    prompt: torch.Tensor,
    k: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
) -> SpecRun:
    """Speculative decoding of `max_new_tokens` tokens after `prompt` (P,) with lookahead k."""
    t0 = time.perf_counter()
    target.reset()
    draft.start()
    P = prompt.shape[0]
    seq = prompt
    accepted: list[int] = []
    drafted: list[int] = []
    while seq.shape[0] - P < max_new_tokens:
        left = max_new_tokens - (seq.shape[0] - P)
        L = seq.shape[0]
        k_now = min(k, left - 1)
        if k_now > 0:
            x, q = draft.propose(seq, k_now, temperature, top_p, generator)  # (k',), (k', V)
        else:
            x, q = seq.new_zeros(0), torch.zeros(0, 1, device=seq.device)  # no draft: plain step
        k_now = x.shape[0]
        logits = target.extend(torch.cat([seq, x]))[-(k_now + 1) :]  # (k'+1, V)
        p = warp(logits, temperature, top_p)
        n, y = verify(p, q, x, generator)
        seq = torch.cat([seq, x[:n], seq.new_tensor([y])])
        target.rollback(L + n)  # keep seq[:-1]; y is fed next round
        draft.rollback(L + n)
        accepted.append(n)
        drafted.append(k_now)
    return SpecRun(seq[P:], time.perf_counter() - t0, accepted, drafted)
