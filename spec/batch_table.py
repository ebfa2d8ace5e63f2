"""The k-per-batch-size table measured by our own loop (`batched`), without vLLM.

For each batch size B the prompts run in consecutive chunks of B sequences (as
`vllm_engine` runs vLLM): per chunk, plain decoding of the chunk, then every (draft, k), then
plain decoding again (the mean of the two plain runs cancels a linear drift of the machine's
load, as the batch-1 loop does). Times are the decode phase (the prefill excluded, as in the
batch-1 loop); speedup = plain seconds / speculative seconds over all chunks. Per (draft, B, k)
also vLLM's metrics over its sequences' rounds (`predict.vllm_measured`) and whether every
sequence decoded as it does alone: at temperature 0 its tokens are the target's greedy tokens
and its rounds those replayed from the teacher-forced acceptance (`predict.greedy_rounds`).

The best k at each B is the measured fastest, no speculation (k = 0) included; the table is
`vllm_engine.schedule`'s inclusive ranges. These are our transformers loop's figures on this
machine, not a server's: label them so.

What this module does not know: where models, prompts and acceptance come from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from infer_tool.common.progress import Progress, no_progress
from infer_tool.spec.batched import BatchedLM, batched, batched_speculative_decode, batched_target_decode
from infer_tool.spec.decode import Clock
from infer_tool.spec.drafts import Draft
from infer_tool.spec.predict import VllmMetrics, greedy_rounds, vllm_measured
from infer_tool.spec.vllm_engine import schedule


@dataclass
class LoopCell:
    """One (draft, batch size, k) measured by our batched loop."""

    draft: str
    batch: int
    k: int
    seconds: float  # decode phase, all chunks
    plain_seconds: float  # plain decoding of the same chunks (mean of before and after)
    speedup: float
    passes: int  # target passes over a batch, all chunks
    metrics: VllmMetrics | None  # vLLM's metrics over every sequence's rounds
    accepted_hist: list[int]  # rounds that accepted 0..k drafted tokens
    as_alone: bool | None  # T = 0: every sequence's tokens and rounds are those it has alone


@dataclass
class LoopTable:
    batch_sizes: list[int]
    ks: list[int]
    cells: list[LoopCell]
    plain_seconds: dict[int, float]  # batch size -> plain decoding, all chunks
    best_k: dict[str, dict[int, int]] = field(default_factory=dict)  # draft -> batch size -> k (0: none)
    schedule: dict[str, list[list[int]]] = field(default_factory=dict)  # draft -> [[lo, hi, k], ...]


def _gens(seed: int, first: int, n: int, temperature: float) -> list[torch.Generator | None]:
    return [None if temperature == 0 else torch.Generator().manual_seed(seed + first + i) for i in range(n)]


def measure(
    target: torch.nn.Module,
    vocab: int,
    drafts: list[Draft],
    prompts: list[torch.Tensor],
    *,
    ks: list[int],
    batch_sizes: list[int],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    continuations: list[torch.Tensor] | None = None,
    acceptance: list[dict[int, list[list[list[float]]]]] | None = None,
    clock: Clock = time.perf_counter,
    name: str = "target",
    progress: Progress | None = None,
) -> LoopTable:
    """Measure every (draft, k) and plain decoding at every batch size. `continuations` and
    `acceptance` (per draft, k -> per prompt `round_acceptance`): what each sequence does
    alone at temperature 0, for `LoopCell.as_alone`."""
    progress = progress or no_progress
    lm = BatchedLM(target, vocab, name=f"target {name}")
    N, T = max_new_tokens, temperature
    total = len(batch_sizes) * len(prompts) * (1 + len(drafts) * len(ks))
    done = 0
    cells: list[LoopCell] = []
    plain_total: dict[int, float] = {}
    for B in batch_sizes:
        plain = 0.0
        runs: dict[tuple[int, int], list] = {(j, k): [] for j in range(len(drafts)) for k in ks}
        for s in range(0, len(prompts), B):
            chunk = prompts[s : s + B]
            before = batched_target_decode(lm, chunk, N, T, top_p, _gens(seed, s, len(chunk), T), clock).seconds
            for j, d in enumerate(drafts):
                for k in ks:
                    bd = batched(d)
                    run = batched_speculative_decode(
                        lm, bd, chunk, k, N, T, top_p, _gens(seed, s, len(chunk), T), clock
                    )
                    runs[j, k].append((s, run))
                    done += len(chunk)
                    progress(f"batched loop (batch {B})", done, total)
            after = batched_target_decode(lm, chunk, N, T, top_p, _gens(seed, s, len(chunk), T), clock).seconds
            plain += (before + after) / 2
            done += len(chunk)
            progress(f"batched loop (batch {B})", done, total)
        plain_total[B] = plain
        for (j, k), chunk_runs in runs.items():
            seconds = sum(r.seconds for _, r in chunk_runs)
            accepted = [n for _, r in chunk_runs for a in r.accepted for n in a]
            drafted = [n for _, r in chunk_runs for a in r.drafted for n in a]
            alone = None
            if T == 0 and continuations is not None and acceptance is not None:
                alone = all(
                    torch.equal(r.tokens[i], continuations[s + i].cpu())
                    and greedy_rounds(acceptance[j][k][s + i], k) == (r.accepted[i], r.drafted[i])
                    for s, r in chunk_runs
                    for i in range(len(r.tokens))
                )
            cells.append(
                LoopCell(
                    draft=drafts[j].name,
                    batch=B,
                    k=k,
                    seconds=seconds,
                    plain_seconds=plain,
                    speedup=plain / seconds,
                    passes=sum(r.passes for _, r in chunk_runs),
                    metrics=vllm_measured(accepted, drafted, k),
                    accepted_hist=[accepted.count(n) for n in range(k + 1)],
                    as_alone=alone,
                )
            )
    table = LoopTable(batch_sizes, ks, cells, plain_total)
    for d in drafts:
        best = {}
        for B in batch_sizes:
            options = [(1.0, 0)] + [(c.speedup, c.k) for c in cells if c.draft == d.name and c.batch == B]
            best[B] = max(options)[1]
        table.best_k[d.name] = best
        table.schedule[d.name] = schedule(best)
    return table
