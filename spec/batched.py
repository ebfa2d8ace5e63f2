"""Plain and speculative decoding of B sequences together (batch > 1), with KV caches, in
transformers: the loop of `decode` with every target and draft pass over the whole batch.

Each sequence keeps its own rounds: it drafts its own proposal (up to k, fewer near its end),
accepts its own prefix with `sampling.verify` and its own random stream, and leaves the batch
when it has its tokens, as vLLM's requests do; so at temperature 0 every sequence emits the
target's greedy tokens and accepts what the batch-1 loop accepts.

`BatchedLM` holds the batch's caches in one `DynamicCache` whose slots line up across rows:
- a pass feeds each row its own new tokens, left-padded to the longest with pad slots;
- a round's rejected tokens stay in the cache as dead slots (`rollback` marks them), so no row
  is cropped on its own;
- a 4-D additive attention mask (B, 1, new, slots) lets a real token see only its own row's
  earlier live tokens (a pad slot sees only itself: a query with no visible key would give
  NaN); position ids count each row's live tokens, as if it decoded alone;
- rows that finish leave the cache (`keep`, `DynamicCache.batch_select_indices`).
Dead slots still cost attention work; the prompts and runs here are short. Full attention only
(a sliding window would count dead slots).

What this module does not know: acceptance statistics or costs (`profile`, `costs`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from infer_tool.spec.cached_lm import _cache_kwarg, check_finite
from infer_tool.spec.decode import Clock, gc_paused
from infer_tool.spec.drafts import Draft, ModelDraft
from infer_tool.spec.sampling import sample, verify, warp


class BatchedLM:
    """A causal LM decoding B sequences at once with rollback per row (module docstring)."""

    def __init__(self, model: torch.nn.Module, vocab: int | None = None, name: str = "the model"):
        self.model, self.vocab, self.name = model, vocab, name
        self._kwarg = _cache_kwarg(model)
        self.dtype = next(model.parameters()).dtype
        self.reset(0)

    def reset(self, batch: int) -> None:
        from transformers import DynamicCache

        try:
            self.cache = DynamicCache(config=self.model.config)
        except TypeError:  # transformers < 4.56
            self.cache = DynamicCache()
        self.live = torch.zeros(batch, 0, dtype=torch.bool)  # (B, slots): slot holds a live token of its row
        self.slots: list[list[int]] = [[] for _ in range(batch)]  # per row: the slot of each live token

    @property
    def lengths(self) -> list[int]:
        """Live tokens per row (the row's sequence length in the cache)."""
        return [len(s) for s in self.slots]

    def extend(self, new: list[list[int]]) -> list[torch.Tensor]:
        """Feed each row its tokens `new[r]` (possibly none); logits (len(new[r]), V) float32
        per row at those positions."""
        B, S = self.live.shape
        m = max(len(x) for x in new)
        assert len(new) == B and m > 0, "one list of new tokens per row, at least one token in all"
        ids = torch.zeros(B, m, dtype=torch.long)
        pos = torch.zeros(B, m, dtype=torch.long)
        fresh = torch.zeros(B, m, dtype=torch.bool)
        for r, x in enumerate(new):
            pad, n = m - len(x), len(self.slots[r])
            ids[r, pad:] = torch.tensor(x, dtype=torch.long)
            pos[r, pad:] = torch.arange(n, n + len(x))
            fresh[r, pad:] = True
            self.slots[r] += range(S + pad, S + m)
        live = torch.cat([self.live, fresh], dim=1)  # (B, S + m)
        q_slot = S + torch.arange(m)
        causal = torch.arange(S + m)[None, :] <= q_slot[:, None]  # (m, S + m)
        seen = live[:, None, :] & causal[None]  # (B, m, S + m)
        itself = torch.zeros(m, S + m, dtype=torch.bool)
        itself[torch.arange(m), q_slot] = True
        seen = torch.where(fresh[:, :, None], seen, itself[None])  # a pad slot sees only itself
        mask = torch.zeros(B, 1, m, S + m, dtype=self.dtype)
        mask.masked_fill_(~seen[:, None], torch.finfo(self.dtype).min)
        dev = next(self.model.parameters()).device
        with torch.inference_mode():  # the model only: `live` is updated in place later
            out = self.model(
                input_ids=ids.to(dev),
                attention_mask=mask.to(dev),
                position_ids=pos.to(dev),
                use_cache=True,
                **{self._kwarg: self.cache},
            )
        self.live = live
        logits = out.logits[:, :, : self.vocab].float()
        rows = []
        for r, x in enumerate(new):
            first = len(self.slots[r]) - len(x)
            rows.append(check_finite(logits[r, m - len(x) :], f"{self.name} (row {r})", first))
        return rows

    def rollback(self, row: int, length: int) -> None:
        """Keep only the first `length` live tokens of `row`; the rest become dead slots."""
        dead = self.slots[row][length:]
        if dead:
            self.live[row, dead] = False
            del self.slots[row][length:]

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows, in this order (the others finished)."""
        if rows == list(range(len(self.slots))):
            return
        idx = torch.tensor(rows, dtype=torch.long)
        if self.live.shape[1] > 0:
            self.cache.batch_select_indices(idx.to(next(self.model.parameters()).device))
        self.live = self.live[idx]
        self.slots = [self.slots[r] for r in rows]


class BatchedModelDraft:
    """A model draft proposing for every row at once, from its own `BatchedLM`."""

    def __init__(self, draft: ModelDraft):
        self.name = draft.name
        self.lm = BatchedLM(draft.lm.model, draft.vocab, name=f"draft {draft.name}")

    def prefill(self, prompts: list[list[int]]) -> None:
        self.lm.reset(len(prompts))
        self.lm.extend(prompts)

    def propose(
        self, seqs: list[list[int]], ks: list[int], temperature: float, top_p: float, gens: list
    ) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Row r drafts ks[r] tokens after seqs[r]: tokens and their q rows (ks[r], V) per row."""
        tokens: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        feeds = [s[n:] for s, n in zip(seqs, self.lm.lengths)]
        while True:
            want = [r for r in range(len(seqs)) if len(tokens[r]) < ks[r]]
            if not want:
                break
            logits = self.lm.extend([feeds[r] if r in want else [] for r in range(len(seqs))])
            for r in want:
                q = warp(logits[r][-1], temperature, top_p)
                x = int(q.argmax()) if temperature == 0 else sample(q, gens[r])
                tokens[r].append(x)
                qs[r].append(q)
            feeds = [[tokens[r][-1]] if r in want else [] for r in range(len(seqs))]
        empty = torch.zeros(0, 1)
        return tokens, [torch.stack(q) if q else empty for q in qs]

    def rollback(self, row: int, length: int) -> None:
        self.lm.rollback(row, min(self.lm.lengths[row], length))

    def keep(self, rows: list[int]) -> None:
        self.lm.keep(rows)


class BatchedLookupDraft:
    """A lookup draft (prompt lookup, suffix decoding): one copy per row, proposing on its own."""

    def __init__(self, draft: Draft):
        self.name, self.draft = draft.name, draft
        self.rows: list = []

    def prefill(self, prompts: list[list[int]]) -> None:
        self.rows = [self.draft.clone() for _ in prompts]

    def propose(
        self, seqs: list[list[int]], ks: list[int], temperature: float, top_p: float, gens: list
    ) -> tuple[list[list[int]], list[torch.Tensor]]:
        tokens = [d.lookup(s, k) if k > 0 else [] for d, s, k in zip(self.rows, seqs, ks)]
        one_hot = torch.nn.functional.one_hot
        return tokens, [one_hot(torch.tensor(t), self.draft.vocab).float() if t else torch.zeros(0, 1) for t in tokens]

    def rollback(self, row: int, length: int) -> None:
        pass

    def keep(self, rows: list[int]) -> None:
        self.rows = [self.rows[r] for r in rows]


BatchedDraft = BatchedModelDraft | BatchedLookupDraft


def batched(draft: Draft) -> BatchedDraft:
    return BatchedModelDraft(draft) if isinstance(draft, ModelDraft) else BatchedLookupDraft(draft)


@dataclass
class BatchRun:
    """B sequences decoded together."""

    tokens: list[torch.Tensor]  # per sequence (max_new_tokens,)
    prefill_seconds: float
    seconds: float  # the decode phase of the whole batch
    accepted: list[list[int]]  # per sequence: accepted drafted tokens per target pass
    drafted: list[list[int]]
    passes: int  # target passes over the batch after the prefill


def _pick(p: torch.Tensor, temperature: float, gen: torch.Generator | None) -> int:
    return int(p.argmax()) if temperature == 0 else sample(p, gen)


def _prefill(target: BatchedLM, prompts: list[list[int]], temperature: float, top_p: float, gens: list) -> list:
    target.reset(len(prompts))
    logits = target.extend(prompts)
    return [p + [_pick(warp(lg[-1], temperature, top_p), temperature, g)] for p, lg, g in zip(prompts, logits, gens)]


def batched_target_decode(
    target: BatchedLM,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    gens: list,
    clock: Clock = time.perf_counter,
) -> BatchRun:
    """Plain decoding of every prompt (P_i,) together, `max_new_tokens` each."""
    ps = [p.tolist() for p in prompts]
    with gc_paused():
        t0 = clock()
        seqs = _prefill(target, ps, temperature, top_p, gens)
        t1 = clock()
        for _ in range(max_new_tokens - 1):
            logits = target.extend([[s[-1]] for s in seqs])
            for s, lg, g in zip(seqs, logits, gens):
                s.append(_pick(warp(lg[-1], temperature, top_p), temperature, g))
        t2 = clock()
    out = [torch.tensor(s[len(p) :]) for s, p in zip(seqs, ps)]
    return BatchRun(out, t1 - t0, t2 - t1, [[] for _ in ps], [[] for _ in ps], max_new_tokens - 1)


def batched_speculative_decode(
    target: BatchedLM,
    draft: BatchedDraft,
    prompts: list[torch.Tensor],
    k: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    gens: list,
    clock: Clock = time.perf_counter,
) -> BatchRun:
    """Speculative decoding of every prompt together with lookahead k; each sequence's round
    as in `decode.speculative_decode`."""
    ps = [p.tolist() for p in prompts]
    B, N = len(ps), max_new_tokens
    accepted: list[list[int]] = [[] for _ in ps]
    drafted: list[list[int]] = [[] for _ in ps]
    passes = 0
    with gc_paused():
        t0 = clock()
        seqs = _prefill(target, ps, temperature, top_p, gens)
        draft.prefill(ps)
        t1 = clock()
        active = list(range(B))  # sequence of each row
        while active:
            ks = [min(k, N - (len(seqs[i]) - len(ps[i])) - 1) for i in active]
            props, qs = draft.propose([seqs[i] for i in active], ks, temperature, top_p, [gens[i] for i in active])
            lengths = target.lengths
            logits = target.extend([seqs[i][lengths[r] :] + props[r] for r, i in enumerate(active)])
            passes += 1
            for r, i in enumerate(active):
                m = len(props[r])
                p = warp(logits[r][-(m + 1) :], temperature, top_p)
                n, y = verify(p, qs[r].to(p.device), torch.tensor(props[r], dtype=torch.long), gens[i])
                L = len(seqs[i])
                seqs[i] += props[r][:n] + [y]
                target.rollback(r, L + n)  # keep seq[:-1]; y is fed next round
                draft.rollback(r, L + n)
                accepted[i].append(n)
                drafted[i].append(m)
            rows = [r for r, i in enumerate(active) if len(seqs[i]) - len(ps[i]) < N]
            target.keep(rows)
            draft.keep(rows)
            active = [active[r] for r in rows]
        t2 = clock()
    out = [torch.tensor(s[len(p) :]) for s, p in zip(seqs, ps)]
    return BatchRun(out, t1 - t0, t2 - t1, accepted, drafted, passes)
