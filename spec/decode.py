"""Plain target decoding and the draft-k-then-verify loop, batch 1, with KV caches.

Both produce exactly `max_new_tokens` tokens (end-of-sequence tokens do not stop them), so
their wall-clock times compare the same amount of work. Both start with the same prefill:
the target's pass over the prompt yields the first token (the speculative run also feeds
the prompt to the draft); the decode phase after it is timed on its own, since that is
what speculation changes. Each round of the speculative loop then drafts
min(k, tokens left - 1) tokens, verifies them in one target pass over the new tokens,
accepts a prefix with `sampling.verify`, and rolls both caches back to the accepted
prefix (`DynamicCache.crop`). At temperature 0 its output is the target's greedy output.

What this module does not know: acceptance statistics or ranking (`profile`).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from infer_tool.spec.cached_lm import CachedLM
from infer_tool.spec.drafts import Draft
from infer_tool.spec.sampling import sample, verify, warp

Clock = Callable[[], float]  # seconds: time.perf_counter (wall), or time.thread_time on a one-thread CPU


@dataclass
class DecodeRun:
    """One sequence decoded by the target alone."""

    tokens: torch.Tensor  # (max_new_tokens,)
    prefill_seconds: float  # the prompt's pass, which also yields the first token
    seconds: float  # the decode phase: the other max_new_tokens - 1 tokens


@dataclass
class SpecRun:
    """One sequence decoded speculatively."""

    tokens: torch.Tensor  # (max_new_tokens,)
    prefill_seconds: float  # target and draft prompt passes (the target's yields the first token)
    seconds: float  # the decode phase, as in DecodeRun
    accepted: list[int]  # accepted drafted tokens per target pass
    drafted: list[int]  # drafted tokens per target pass

    @property
    def target_passes(self) -> int:
        return len(self.accepted)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for a timed section (it runs again between
    sections). Its pauses, which grow with everything torch and transformers hold, would
    otherwise land at random in one timed pass or another; servers keep it out of their
    step loop too (vLLM calls `gc.freeze()` after start-up)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _pick(probs: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    return int(probs.argmax()) if temperature == 0 else sample(probs, generator)


def _prefill(
    target: CachedLM, prompt: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """Feed the prompt (P,) to the target; the prompt plus the first token (P+1,)."""
    target.reset()
    x = _pick(warp(target.extend(prompt)[-1], temperature, top_p), temperature, generator)
    return torch.cat([prompt, prompt.new_tensor([x])])


def target_decode(
    target: CachedLM,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    clock: Clock = time.perf_counter,
) -> DecodeRun:
    """Autoregressive decoding of `max_new_tokens` tokens after `prompt` (P,)."""
    with gc_paused():
        t0 = clock()
        seq = _prefill(target, prompt, temperature, top_p, generator)
        t1 = clock()
        while seq.shape[0] - prompt.shape[0] < max_new_tokens:
            x = _pick(warp(target.extend(seq)[-1], temperature, top_p), temperature, generator)
            seq = torch.cat([seq, seq.new_tensor([x])])
        t2 = clock()
    return DecodeRun(seq[prompt.shape[0] :], t1 - t0, t2 - t1)


def speculative_decode(
    target: CachedLM,
    draft: Draft,
    prompt: torch.Tensor,
    k: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    clock: Clock = time.perf_counter,
) -> SpecRun:
    """Speculative decoding of `max_new_tokens` tokens after `prompt` (P,) with lookahead k."""
    with gc_paused():
        t0 = clock()
        seq = _prefill(target, prompt, temperature, top_p, generator)
        draft.prefill(prompt)
        t1 = clock()
        P = prompt.shape[0]
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
        t2 = clock()
    return SpecRun(seq[P:], t1 - t0, t2 - t1, accepted, drafted)
