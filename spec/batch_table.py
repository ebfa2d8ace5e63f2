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

Each (draft, B, k) also gets a predicted speedup from the cost model `vllm_cost_model` fitted
to this loop's own passes without speculation (`probe_records`, timed per B in the same window
as the measurement): the target's pass of 1 token a row and of q = 1 .. k + 1 tokens a row
after a prompt, the draft model's alone; a round costs the target's pass over 1 + the drafted
tokens a row plus, for a model draft, k passes of the draft (its first over the tokens it has
not seen, 1 a row taken here); rounds from the teacher-forced acceptance along each
continuation with this loop's rule (a round drafts at most the tokens left, `greedy_rounds`),
sampled at temperature > 0; the prefill is excluded, as in the measurement.

What this module does not know: where models, prompts and acceptance come from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from infer_tool.common.progress import Progress, no_progress
from infer_tool.spec.batched import (
    BatchedLM,
    BatchedModelDraft,
    batched,
    batched_speculative_decode,
    batched_target_decode,
)
from infer_tool.spec.decode import Clock
from infer_tool.spec.drafts import Draft, ModelDraft
from infer_tool.spec.predict import VllmMetrics, greedy_rounds, vllm_measured
from infer_tool.spec.vllm_cost_model import ModelCosts, ModelFit, fit
from infer_tool.spec.vllm_costs import Sequence, predict
from infer_tool.spec.vllm_engine import schedule

PROBE_REPEATS = 3  # timed chunks per batch size for the cost model
PROBE_DECODE_PASSES = 4  # one-token passes per chunk


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
    predicted_speedup: float | None = None  # the cost model fitted to this loop's passes without speculation
    predicted_passes: float | None = None  # target passes over a batch the prediction counts, all chunks


@dataclass
class LoopTable:
    batch_sizes: list[int]
    ks: list[int]
    cells: list[LoopCell]
    plain_seconds: dict[int, float]  # batch size -> plain decoding, all chunks
    best_k: dict[str, dict[int, int]] = field(default_factory=dict)  # draft -> batch size -> k (0: none)
    schedule: dict[str, list[list[int]]] = field(default_factory=dict)  # draft -> [[lo, hi, k], ...]
    # the cost model's fits of this loop's passes without speculation: "target" and each model draft's name
    cost_fits: dict[str, ModelFit] = field(default_factory=dict)


def _gens(seed: int, first: int, n: int, temperature: float) -> list[torch.Generator | None]:
    return [None if temperature == 0 else torch.Generator().manual_seed(seed + first + i) for i in range(n)]


def probe_records(
    lm: BatchedLM, prompts: list[torch.Tensor], B: int, queries: list[int], clock: Clock, repeats: int = PROBE_REPEATS
) -> list[dict]:
    """This loop's passes without speculation in the records `vllm_cost_model.fit` reads
    (`vllm_worker.run_probe`'s): per repeat a chunk of B prompts is prefilled (untimed), then
    timed: PROBE_DECODE_PASSES passes of 1 token a row ("decode"), and for each q one pass of q
    tokens a row, rolled back after. A pass here is the whole step (the head over every row
    fed: no separate logits)."""
    recs: list[dict] = []
    for r in range(repeats):
        chunk = [prompts[(r * B + i) % len(prompts)].tolist() for i in range(B)]
        lm.reset(B)
        lm.extend(chunk)
        steps = []
        for _ in range(PROBE_DECODE_PASSES):
            t = clock()
            lm.extend([[x[-1]] for x in chunk])
            s = clock() - t
            steps.append([B, B, 0, 0, s, 0.0, s, 0.0])
        recs.append({"probe": "decode", "batch": B, "steps": steps})
        for q in queries:
            lengths = list(lm.lengths)
            t = clock()
            lm.extend([(x * q)[:q] for x in chunk])
            s = clock() - t
            for row, n in enumerate(lengths):
                lm.rollback(row, n)
            recs.append({"probe": q, "batch": B, "steps": [[B, B * q, 0, int(q > 1), s, 0.0, s, 0.0]]})
    return recs


def predicted_speedup(
    target: ModelFit,
    draft: ModelFit | None,
    k: int,
    B: int,
    acceptance: list[list[list[float]]],
    drafted: list[list[int]],
    max_new_tokens: int,
    seed: int,
) -> tuple[float, float]:
    """(speedup, target passes) the cost model predicts for this loop at batch size B and k (see
    the module docstring)."""
    N = max_new_tokens
    seqs = [Sequence(0, acc, [min(d, N - t - 1) for t, d in enumerate(dr)]) for acc, dr in zip(acceptance, drafted)]
    plain = predict(ModelCosts(target, None, 0, prefill=False), [Sequence(0) for _ in seqs], B, N)
    spec = predict(ModelCosts(target, draft, k, first_pass=1, prefill=False), seqs, B, N, seed=seed)
    return plain.seconds / spec.seconds, spec.decode_steps


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
    drafted: list[dict[int, list[list[int]]]] | None = None,
    clock: Clock = time.perf_counter,
    name: str = "target",
    progress: Progress | None = None,
) -> LoopTable:
    """Measure every (draft, k) and plain decoding at every batch size. `continuations` and
    `acceptance` (per draft, k -> per prompt `round_acceptance`): what each sequence does
    alone at temperature 0, for `LoopCell.as_alone`; with `drafted` (per draft, k -> per prompt
    `round_drafted`) too, each cell's predicted speedup."""
    progress = progress or no_progress
    round_drafted = drafted  # (the loop below counts its own drafted tokens)
    lm = BatchedLM(target, vocab, name=f"target {name}")
    N, T = max_new_tokens, temperature
    total = len(batch_sizes) * len(prompts) * (1 + len(drafts) * len(ks))
    done = 0
    cells: list[LoopCell] = []
    plain_total: dict[int, float] = {}
    queries = list(range(1, max(ks) + 2))
    model_lms = {d.name: BatchedModelDraft(d).lm for d in drafts if isinstance(d, ModelDraft)}
    probes: dict[str, list[dict]] = {"target": [], **{name: [] for name in model_lms}}
    for B in batch_sizes:
        plain = 0.0
        if round_drafted is not None:
            probes["target"] += probe_records(lm, prompts, B, queries, clock)
            for name, dlm in model_lms.items():
                probes[name] += probe_records(dlm, prompts, B, queries, clock)
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
    if round_drafted is not None and acceptance is not None:
        table.cost_fits = {name: fit(recs) for name, recs in probes.items()}
        index = {d.name: j for j, d in enumerate(drafts)}
        for c in cells:
            j = index[c.draft]
            c.predicted_speedup, c.predicted_passes = predicted_speedup(
                table.cost_fits["target"],
                table.cost_fits.get(c.draft),
                c.k,
                c.batch,
                acceptance[j][c.k],
                round_drafted[j][c.k],
                N,
                seed,
            )
    for d in drafts:
        best = {}
        for B in batch_sizes:
            options = [(1.0, 0)] + [(c.speedup, c.k) for c in cells if c.draft == d.name and c.batch == B]
            best[B] = max(options)[1]
        table.best_k[d.name] = best
        table.schedule[d.name] = schedule(best)
    return table
