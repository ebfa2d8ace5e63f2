"""AutoRound in the pipeline (Cheng et al. 2023, §3; auto-round's `SignRoundQuantizer.quantize_block`),
one decoder block at a time: every target linear's rounding offsets V and clip factors α, β
(`packers/autoround.Rounding`) are learned by signed gradient descent on the block's output
error, then the linears are rounded with the best parameters seen and recorded.

Per block, for t = 0 .. T−1 (T = `iters`):
    L_t = ‖block_q(X_q[B_t]) − block_fp(X_fp[B_t])‖² / |B_t|       (mean squared error)
    θ ← θ − lr·(1 − t/T)·sign(∇_θ L_t),  θ = (V, α, β), then V clamped to [−0.5, 0.5], α, β to [0, 1]
where X_q are the block's inputs through the already-quantized blocks (the pipeline's chain)
and X_fp the fp model's own inputs (`Needs.fp_chain`): the target is the fp model's output,
so a block also makes up for the error upstream of it (auto-round's default
`enable_quanted_input`). The parameters kept are those of the iteration with the lowest L_t
(evaluated before its step, as auto-round does); t = 0 is plain RTN, so the result is never
worse than RTN on the batch that scored it.

Batches: the calibration sequences are cut into units of u = gcd(batch, chunk) consecutive
sequences (a unit never straddles two of the pipeline's chunks); each step draws batch / u
units from a seeded shuffle of all units (reshuffled when fewer remain than a batch, as
auto-round's `IndexSampler`). The calibration windows are drawn at random places in the
corpus, so a unit of consecutive sequences is as random a sample as any.

Across processes each process holds its chunks, so each unit of a batch is run by the
process that holds it: the gradient of its squared error (and the error itself) are then
added unit by unit in ascending order on every process (`distributed.sum_in_order`, the
owner broadcasting): every process takes the same step, with the bits of a one-process run.

MoE layers: the experts' linears are tuned with the rest of the block (an expert no
sequence of a batch is routed to gets no gradient in that step).
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from infer_tool.calib.distributed import gather_terms, shard, sum_in_order
from infer_tool.calib.layers import LayerCall, first, relative_error, run_layer, weight_nk
from infer_tool.calib.quantizers import register_quantizer
from infer_tool.calib.quantizers.base import LayerContext, LayerOutputs, LayerQuantizer, Needs, record, run_counting
from infer_tool.calib.result import PipelineResult
from infer_tool.packers.autoround import Grouped, Rounding, fake_quantize_rounding, quantize_rounding
from infer_tool.schemes.integer import AutoRoundScheme


class TunedLinear(nn.Module):
    """Stands in for a linear while its block is tuned: y = x·Ŵᵀ + b, with Ŵ (N, K) the
    fake-quantized weight of the current step (`W_hat`, set before each step: a leaf whose
    gradient the step reads)."""

    def __init__(self, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.bias = None if bias is None else bias.detach().to(dtype)
        self.W_hat: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.W_hat, self.bias)


@dataclass(frozen=True)
class Unit:
    """Sequences [a, b) of the pipeline's global chunk `chunk`, held by process `owner`
    (`local`: its index among that process's chunks)."""

    chunk: int
    local: int
    a: int
    b: int
    owner: int


def units_of(rows_per_chunk: list[tuple[int, int, int]], batch: int) -> tuple[list[Unit], int]:
    """(every unit in global order, units per batch) from [(owner, local index, rows)] per
    global chunk in order (module docstring: units of gcd(batch, chunk) sequences)."""
    chunk = max(rows for _, _, rows in rows_per_chunk)
    u = math.gcd(batch, chunk)
    units = [
        Unit(c, local, a, min(a + u, rows), owner)
        for c, (owner, local, rows) in enumerate(rows_per_chunk)
        for a in range(0, rows, u)
    ]
    return units, max(1, min(len(units), batch // u))


class Batches:
    """auto-round's `IndexSampler` over units: the next k of a seeded shuffle, reshuffled
    (from the start) when fewer than k remain."""

    def __init__(self, n: int, k: int, seed: int) -> None:
        self.n, self.k, self.g = n, k, torch.Generator().manual_seed(seed)
        self._shuffle()

    def _shuffle(self) -> None:
        self.order, self.next = torch.randperm(self.n, generator=self.g).tolist(), 0

    def draw(self) -> list[int]:
        if self.next + self.k > self.n:
            self._shuffle()
        picked = self.order[self.next : self.next + self.k]
        self.next += self.k
        return sorted(picked)


def slice_call(call: LayerCall, rows: int, a: int, b: int, dtype: torch.dtype = torch.float32) -> LayerCall:
    """The call's arguments for sequences [a, b) of a chunk of `rows`, floating tensors in
    `dtype`: every tensor of two or more dimensions whose first is `rows` is sliced (masks,
    per-sequence rotary tables); broadcast ones (first dimension 1) are kept."""
    if a == 0 and b == rows and dtype == torch.float32:
        return call

    def cut(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            o = o[a:b] if o.dim() >= 2 and o.shape[0] == rows and rows > 1 else o
            return o.to(dtype) if o.is_floating_point() else o
        if isinstance(o, tuple):
            return tuple(cut(x) for x in o)
        if isinstance(o, list):
            return [cut(x) for x in o]
        if isinstance(o, dict):
            return {k: cut(v) for k, v in o.items()}
        return o

    return LayerCall(cut(call.args), cut(call.kwargs))


def layer_index(prefix: str) -> int:
    """3 for 'model.layers.3'."""
    found = re.search(r"(\d+)$", prefix)
    return int(found.group(1)) if found else 0


@contextlib.contextmanager
def tuned(layer: nn.Module, names: list[str], dtype: torch.dtype) -> Iterator[dict[str, TunedLinear]]:
    """Each linear `names[i]` of `layer` replaced by a `TunedLinear` while open (yielded by
    name); the layer's own parameters need no grad meanwhile (all restored after)."""
    grads = {id(p): p.requires_grad for p in layer.parameters()}
    originals: dict[str, nn.Module] = {}
    stand_ins: dict[str, TunedLinear] = {}
    try:
        for p in layer.parameters():
            p.requires_grad_(False)
        for n in names:
            parent_name, _, child = n.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            module = getattr(parent, child)
            originals[n] = module
            stand_ins[n] = TunedLinear(getattr(module, "bias", None), dtype)
            setattr(parent, child, stand_ins[n])
        yield stand_ins
    finally:
        for n, module in originals.items():
            parent_name, _, child = n.rpartition(".")
            setattr(layer.get_submodule(parent_name) if parent_name else layer, child, module)
        for p in layer.parameters():
            p.requires_grad_(grads.get(id(p), p.requires_grad))


@register_quantizer(AutoRoundScheme)
class AutoRoundQuantizer(LayerQuantizer[AutoRoundScheme]):
    def needs(self, scheme: AutoRoundScheme) -> Needs:
        return Needs(live_blocks=True, fp_chain=True)

    def stats_refusal(self, scheme: AutoRoundScheme) -> str | None:
        return (
            "--stats works with --method gptq or rtn: autoround tunes each block on its live inputs toward the fp "
            "model's block outputs, which saved statistics do not hold"
        )

    def notes(self, result: PipelineResult, scheme: AutoRoundScheme) -> list[str]:
        """One line: how much the descent lowered the block losses, and how often RTN stayed best."""
        entries = result.method_report.get("autoround", [])
        if not entries:
            return []
        ratios = sorted(e["best_loss"] / e["rtn_loss"] for e in entries if e["rtn_loss"] > 0)
        kept = sum(e["best_iter"] == 0 for e in entries)
        median = ratios[len(ratios) // 2] if ratios else float("nan")
        return [
            (
                f"autoround: {scheme.iters} steps of lr {scheme.step_size:g} per block, batches of "
                f"{entries[0]['batch']} sequences; the best batch loss was {median:.3f}x plain RTN's (median over "
                f"{len(entries)} blocks); RTN (step 0) stayed the best on {kept} of {len(entries)} blocks"
            )
        ]

    def quantize_layer(self, ctx: LayerContext, scheme: AutoRoundScheme) -> LayerOutputs:
        if ctx.Y_fp is None:
            raise RuntimeError("autoround needs the fp chain (Needs.fp_chain): the pipeline did not provide it")
        e = ctx.error_chunks
        Y = run_layer(ctx.layer, ctx.X[:e], ctx.calls[:e])
        names = [n for n in ctx.linears if ctx.is_target(n)]
        entry = None
        if names:
            best, entry = self.tune(ctx, names, scheme)
            for n in names:
                weight = self.rounded(self.grouped(ctx, n, scheme), best[n], scheme)
                record(ctx.result, ctx.full(n), ctx.module(n), weight, ctx.arch, None)
        Y_hat = self.output_pass(ctx, scheme)
        if entry is not None:  # what the descent aims at: the fp model's output (the report's layer error: fp(X_q)'s)
            entry["error_vs_fp_model"] = relative_error(Y_hat[:e], ctx.Y_fp[:e])
            ctx.result.method_report.setdefault("autoround", []).append(entry)
        return LayerOutputs(Y, Y_hat)

    # the grid: INT here (`packers/autoround.py`); the FP4 quantizer puts its own in
    def grouped(self, ctx: LayerContext, n: str, scheme: AutoRoundScheme) -> Any:
        """Linear n's fp weight as the grid's groups (`Grouped`)."""
        return Grouped.of(weight_nk(ctx.module(n), ctx.arch.conv1d), scheme)

    def fake(self, W: Any, p: Rounding, scheme: AutoRoundScheme) -> torch.Tensor:
        """Ŵ (N, K) float32, differentiable in p."""
        return fake_quantize_rounding(W, p, scheme)

    def rounded(self, W: Any, p: Rounding, scheme: AutoRoundScheme) -> Any:
        """The weight to record: the codes and scales of the learned rounding."""
        return quantize_rounding(W.w.reshape(W.shape), p, scheme)

    def output_pass(self, ctx: LayerContext, scheme: AutoRoundScheme) -> list[torch.Tensor]:
        """Ŷ on every chunk: the quantized layer's outputs (the next layer's inputs)."""
        return run_counting(ctx)

    def tune(self, ctx: LayerContext, names: list[str], scheme: AutoRoundScheme) -> tuple[dict[str, Rounding], dict]:
        """The descent on one block (module docstring): the best parameters per linear, and the
        block's report entry (losses at step 0 and at the best step)."""
        layer, dev = ctx.layer, ctx.X[0].device if ctx.X else torch.device("cpu")
        me = shard()
        layout = gather_terms([(me.rank, j, int(x.shape[0])) for j, x in enumerate(ctx.X)])
        units, k = units_of(layout, scheme.batch)
        batches = Batches(len(units), k, (scheme.batch_seed << 20) + layer_index(ctx.prefix))
        dtype = getattr(torch, scheme.tune_dtype)
        weights = {n: self.grouped(ctx, n, scheme) for n in names}
        params = {n: Rounding.initial(weights[n].shape, scheme.group_for(weights[n].shape[1]), dev) for n in names}
        # per unit, once: its inputs in the tuning dtype, its arguments, its targets (views)
        inputs, targets, unit_calls = {}, {}, {}
        for i, unit in enumerate(units):
            if unit.owner == me.rank:
                x = ctx.X[unit.local]
                inputs[i] = x[unit.a : unit.b].to(dtype)
                targets[i] = ctx.Y_fp[unit.local][unit.a : unit.b]
                unit_calls[i] = slice_call(ctx.calls[unit.local], int(x.shape[0]), unit.a, unit.b, dtype)
        # what a unit's term holds: ∂(squared error)/∂Ŵ of every linear (float32), then the squared error
        likes = [torch.zeros(weights[n].shape, device=dev) for n in names] + [torch.zeros(1, device=dev)]
        per_sequence = int(ctx.X[0][0].numel())  # T·D (every process holds a chunk: `plan_shard`)
        block = layer if dtype == torch.float32 else _copy_in(layer, dtype)
        best: dict[str, Rounding] = {}
        best_loss, best_iter, rtn_loss, rows = math.inf, 0, math.nan, 0

        def term(i: int, W_hat: list[torch.Tensor]) -> list[torch.Tensor]:
            """Unit i's gradient of its squared error with respect to every Ŵ, and the error."""
            call = unit_calls[i]
            with torch.enable_grad():
                out = first(block(inputs[i], *call.args, **call.kwargs))
                sse = (out.float() - targets[i].float()).pow(2).sum()
                grads = torch.autograd.grad(sse, W_hat, allow_unused=True)
            return [
                torch.zeros_like(w, dtype=torch.float32) if g is None else g.float() for g, w in zip(grads, W_hat)
            ] + [sse.detach().reshape(1)]

        with tuned(block, names, dtype) as stand_ins:
            for t in range(scheme.iters):
                with torch.enable_grad():  # Ŵ of this step, once for every unit of the batch
                    W_hat = [self.fake(weights[n], params[n], scheme) for n in names]
                leaves = [w.detach().to(dtype).requires_grad_(True) for w in W_hat]
                for n, leaf in zip(names, leaves):
                    stand_ins[n].W_hat = leaf
                picked = batches.draw()
                *dW, sse = sum_in_order(
                    [units[i].owner for i in picked],
                    lambda j, picked=picked, leaves=leaves: term(picked[j], leaves),
                    likes,
                )
                rows = sum(units[i].b - units[i].a for i in picked)
                loss = float(sse) / (rows * per_sequence)
                if t == 0:
                    rtn_loss = loss
                if t == 0 or loss < best_loss:
                    best_loss, best_iter = loss, t
                    best = {n: params[n].detached() for n in names}
                with torch.enable_grad():  # the chain rule through the quantizer, once for the batch
                    torch.autograd.backward(W_hat, dW)
                del W_hat, leaves, dW
                lr = scheme.step_size * (1.0 - t / scheme.iters)
                with torch.no_grad():
                    for n in names:
                        for leaf in params[n].tensors():
                            if leaf.grad is not None:
                                leaf.sub_(lr * torch.sign(leaf.grad))
                                leaf.grad = None
                        params[n].project()
        entry = {
            "layer": ctx.prefix,
            "rtn_loss": rtn_loss,
            "best_loss": best_loss,
            "best_iter": best_iter,
            "iters": scheme.iters,
            "batch": rows,
            "units": len(units),
        }
        return best, entry


def _copy_in(layer: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of `layer` in `dtype` (tuning in low precision leaves the layer itself as it is)."""
    import copy

    return copy.deepcopy(layer).to(dtype)
