"""GPTQ in the pipeline, true-sequential: each linear group's Hessian is measured on
inputs that went through the already-quantized earlier groups of the layer (q/k/v, then
o, then gate/up, then down), so every group compensates the error upstream of it. The
solver is `packers/gptq.quantize_gptq`; the linears of one group share its Hessian and are
solved as one stack of rows (`_solve_together`): each gets the bits of its own solve, with one
factorisation and one column loop for the group.

A sub-block whose output is its last linear's output (attention -> o_proj, MLP ->
down_proj) is final once that linear is quantized: later runs replay its cached output
(`calib/replay.py`), so each linear runs once over the calibration tokens. With
`ctx.spill` (a directory), those outputs and the linears' kept inputs live in files there
instead of in memory (`calib/spill.py`): the same bytes, read back in order.

MoE layers: once the attention is quantized, the MoE block's input and the router's
choices are captured once; then the gate/up of every expert, then every down, one Hessian
per expert, each freed after its solve. Gate/up read the expert's rows of the block input:
every row in "all" mode (and for the shared expert), its routed rows in "routed" mode;
linears sharing a Hessian (all gate/up in "all" mode; an expert's gate and up) are solved
as one stack of rows. Down reads the expert's intermediate activations computed with its
quantized gate/up. Starved experts (routed mode) fall back to RTN.

With SmoothQuant (`scheme.smoothquant`), the layer is smoothed first (`smoothquant.smooth_layer`,
from one fp pass measuring the per-channel maxima of the norm mappings' inputs, ending at the
last of them); every Hessian is then measured on the smoothed inputs. With static int8
activations, each linear's `input_scale` comes from the max |x| of the inputs its Hessian was
measured on.
"""

from __future__ import annotations

from typing import Any

import torch

from infer_tool.calib.distributed import chunks
from infer_tool.calib.layers import capturing_inputs, run_layer, run_until, set_weight_nk, weight_nk
from infer_tool.calib.moe import Routing, capturing_routing, run_until_down
from infer_tool.calib.quantizers import register_quantizer
from infer_tool.calib.quantizers.base import (
    LayerContext,
    LayerOutputs,
    LayerQuantizer,
    Needs,
    measure_groups,
    record,
    record_rtn_fallback,
    with_input_scale,
)
from infer_tool.calib.quantizers.fp8 import expert_stats
from infer_tool.calib.quantizers.smoothquant import SmoothsSavedStats, smooth_layer, smoothed_groups
from infer_tool.calib.replay import replay_points, replaying
from infer_tool.calib.spill import chunk_store, drain
from infer_tool.calib.stats import CrossAccumulator, LayerStats, StatsAccumulator
from infer_tool.packers.gptq import gptaq_target, part_info, part_rows, quantize_gptq
from infer_tool.packers.int_weight import QuantizedWeight
from infer_tool.schemes.integer import GPTQScheme

SOLVE_ELEMENTS = 1 << 26  # weights stacked into one solve (fp32: 256 MiB; the solver keeps ~3 copies)


@register_quantizer(GPTQScheme)
class GPTQQuantizer(SmoothsSavedStats, LayerQuantizer[GPTQScheme]):
    def needs(self, scheme: GPTQScheme) -> Needs:
        smooth = self.smoothing(scheme) is not None
        return Needs(hessian=True, activation_stats=smooth, channel_max=smooth, fp_inputs=scheme.gptaq is not None)

    def stats_refusal(self, scheme: GPTQScheme) -> str | None:
        if scheme.gptaq is not None:
            return "--gptaq pairs each layer's live inputs with the fp model's: it cannot run from --stats"
        return None

    def smoothing(self, scheme: GPTQScheme) -> float | None:
        """SmoothQuant's α before the solve, or None (a number format without it overrides this)."""
        return scheme.smoothquant

    def static_int8(self, scheme: GPTQScheme) -> bool:
        """Whether the solved linears carry a static int8 input scale."""
        return scheme.int8_activations == "static"

    def solve(
        self, W: torch.Tensor, stats: LayerStats | None, scheme: GPTQScheme, name: str, parts: list[int] | None = None
    ) -> QuantizedWeight:
        """GPTQ of W (N, K); `parts`: the row counts of stacked linears (`_solve_together`)."""
        return with_input_scale(quantize_gptq(W, stats, scheme, parts=parts), stats, scheme, name)

    def quantize_layer(self, ctx: LayerContext, scheme: GPTQScheme) -> LayerOutputs:
        layer, X, calls, arch = ctx.layer, ctx.X, ctx.calls, ctx.arch
        alpha = self.smoothing(scheme)
        if alpha is not None:
            stats = measure_groups(ctx, only=smoothed_groups(layer, arch))  # the fp inputs of the norm mappings
            smooth_layer(layer, ctx.prefix, arch, alpha, stats, targets=ctx.targets, result=ctx.result)
        e = max(ctx.error_chunks, 1)  # a process without error chunks still finds its replay points
        Y, points = replay_points(layer, arch, X[:e], calls[:e])
        Y = Y[: ctx.error_chunks]
        cached: dict[int, list[torch.Tensor]] = {}  # group index -> its quantized linear's outputs, per chunk
        for g, group in enumerate(arch.groups):
            todo = [n for n in group if ctx.is_target(n)]
            if not todo:
                if ctx.fp_inputs is not None:
                    for _ in drain(ctx.fp_inputs.pop(group[0])):
                        pass
                continue
            head = ctx.module(group[0])
            K = int(weight_nk(head, arch.conv1d).shape[1])
            acc = StatsAccumulator(K, hessian=True)
            paired = _Paired(acc, K, ctx.fp_inputs.pop(group[0])) if ctx.fp_inputs is not None else None
            keep = {group[0]: chunk_store(ctx.spill, X[0].device)} if g in points else None
            with (
                replaying(points, cached),
                capturing_inputs(
                    {group[0]: head}, accs={group[0]: paired or acc}, keep=keep, keep_chunks=len(X), stop=True
                ),
            ):
                run_until(layer, X, calls, head)
            stats = acc.result()
            for n in group:
                ctx.result.stats[ctx.full(n)] = stats
            if paired is not None:
                self._toward_fp(ctx, todo, stats, paired.result(), scheme)
            if len(todo) > 1:  # q/k/v, gate/up: one solve of the stacked rows, each linear's own bits
                self._solve_together(ctx, todo, stats, scheme)
            else:
                self.quantize_linear(ctx.result, ctx.full(todo[0]), ctx.module(todo[0]), arch, stats, scheme)
            if keep is not None:  # the sub-block's output is now final; each kept input is freed once used
                cached[g] = chunk_store(ctx.spill, X[0].device)
                for x in drain(keep.pop(group[0])):
                    cached[g].append(points[g].linear(x))
        if ctx.moe is not None:
            with replaying(points, cached), capturing_routing(ctx.moe, keep_chunks=len(X)) as routing:
                run_until(layer, X, calls, ctx.moe.experts)
            ctx.count_tokens(routing)
            self._quantize_experts(ctx, scheme, routing)
            del routing
        with replaying(points, cached):
            Y_hat = run_layer(layer, X, calls)
        return LayerOutputs(Y, Y_hat)

    def _toward_fp(
        self, ctx: LayerContext, names: list[str], stats: LayerStats, dXXT: torch.Tensor, scheme: GPTQScheme
    ) -> None:
        """Asymmetric calibration (`scheme.gptaq`): each linear's weights become GPTQ's target
        W* (`packers/gptq.gptaq_target`) before the solve; a Hessian that does not factorise
        keeps W (the solve then retries with more damping, as always)."""
        for n in names:
            m = ctx.module(n)
            W = weight_nk(m, ctx.arch.conv1d).detach()
            target = gptaq_target(W.float(), stats.H.to(W.device), dXXT.to(W.device), scheme.gptaq, scheme.damp)
            if target is not None:
                set_weight_nk(m, target.to(W.dtype), ctx.arch.conv1d)

    def _quantize_experts(self, ctx: LayerContext, scheme: GPTQScheme, routing: Routing) -> None:
        """Gate/up of the shared expert and of every expert, then every down (see above)."""
        moe, mode = ctx.moe, ctx.moe.calibration.mode
        jobs: list[int | None] = []  # None: the shared expert
        for j in moe.order():
            reason = None if j is None else ctx.starved(routing, j)
            if reason:
                # a static input scale over every row of the block input (the expert's own are too few)
                every = expert_stats(ctx, j, routing.x, False) if self.static_int8(scheme) else {}
                for n in moe.expert(j):
                    if ctx.is_target(n):
                        record_rtn_fallback(ctx, n, scheme, f"expert {j} {reason}", every.get(n))
            else:
                jobs.append(j)

        def every_row(j: int | None) -> bool:
            return j is None or mode == "all"

        # gate/up: one Hessian for every row of the block input, one per expert's routed rows
        shared = [n for j in jobs if every_row(j) for n in moe.expert(j)[:2] if ctx.is_target(n)]
        if shared:
            self._solve_together(ctx, shared, _hessian(routing.x, ctx.module(shared[0])), scheme)
        for j in jobs:
            todo = [n for n in moe.expert(j)[:2] if ctx.is_target(n)]
            if todo and not every_row(j):
                self._solve_together(ctx, todo, _hessian(routing.rows(j, mode), ctx.module(todo[0])), scheme)
        # down: each expert's inputs through its quantized gate/up
        for j in jobs:
            down = moe.expert(j)[2]
            if not ctx.is_target(down):
                continue
            head, rows = ctx.module(down), routing.x if every_row(j) else routing.rows(j, mode)
            acc = StatsAccumulator(head.in_features, hessian=True)
            run_until_down(ctx.module(moe.module_name(j)), rows, acc=acc)
            self.quantize_linear(ctx.result, ctx.full(down), head, ctx.arch, acc.result(), scheme)

    def _solve_together(self, ctx: LayerContext, names: list[str], stats: LayerStats, scheme: GPTQScheme) -> None:
        """GPTQ of linears that share one Hessian as one solve over their stacked rows: GPTQ's
        updates are row-wise given H, so this is each linear's own solve to the bit
        (`solve_columns`' parts), with one factorisation and one column loop instead of one per
        linear."""
        modules = [ctx.module(n) for n in names]
        weights = [weight_nk(m, ctx.arch.conv1d).detach() for m in modules]
        K = int(weights[0].shape[1])
        per_solve = max(1, SOLVE_ELEMENTS // (K * max(int(w.shape[0]) for w in weights)))
        for a in range(0, len(names), per_solve):
            part = slice(a, a + per_solve)
            sizes = [int(w.shape[0]) for w in weights[part]]
            full = ", ".join(ctx.full(n) for n in names[part])
            solved = self.solve(torch.cat(weights[part]), stats, scheme, full, parts=sizes)
            for i, (n, m, rows) in enumerate(zip(names[part], modules[part], part_rows(sizes, sum(sizes)))):
                one = solved.rows(rows)
                one.info = part_info(solved.info, i)
                record(ctx.result, ctx.full(n), m, one, ctx.arch, stats)


class _Paired:
    """The Hessian accumulator of one group's live inputs, with GPTAQ's dXXᵀ of the same
    inputs against the fp model's, read in chunk order from `fp` (the pipeline's store)."""

    def __init__(self, acc: StatsAccumulator, K: int, fp: Any) -> None:
        self.acc, self.cross, self.fp = acc, CrossAccumulator(K), drain(fp)

    def add(self, x: torch.Tensor) -> None:
        x_fp = next(self.fp, None)
        if x_fp is None:
            raise RuntimeError("the fp chain has fewer chunks than the quantized chain")
        self.acc.add(x)
        self.cross.add(x_fp, x)

    def result(self) -> torch.Tensor:
        if next(self.fp, None) is not None:
            raise RuntimeError("the fp chain has more chunks than the quantized chain")
        return self.cross.result()


def _hessian(rows: list[torch.Tensor], gate: torch.nn.Module) -> LayerStats:
    acc = StatsAccumulator(gate.in_features, hessian=True)
    for x in chunks(rows):
        acc.add(x)
    return acc.result()
