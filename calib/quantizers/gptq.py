"""GPTQ in the pipeline, true-sequential: each linear group's Hessian is measured on
inputs that went through the already-quantized earlier groups of the layer (q/k/v, then
o, then gate/up, then down), so every group compensates the error upstream of it. The
solver is `packers/gptq.quantize_gptq`.

A sub-block whose output is its last linear's output (attention -> o_proj, MLP ->
down_proj) is final once that linear is quantized: later runs replay its cached output
(`calib/replay.py`), so each linear runs once over the calibration tokens.

MoE layers: once the attention is quantized, the MoE block's input and the router's
choices are captured once; then one Hessian per expert, one expert at a time: gate/up
from the expert's rows of the block input (every row in "all" mode, its routed rows in
"routed" mode; the shared expert always every row), then down from the expert's
intermediate activations computed with its quantized gate/up, each freed after its solve.
An expert's down only depends on its own gate/up, so this equals quantizing the gate/up of
all experts, then every down. Starved experts (routed mode) fall back to RTN.
"""

from __future__ import annotations

from typing import Any

import torch

from infer_tool.calib.layers import StopForward, capturing_inputs, run_layer, run_until, weight_nk
from infer_tool.calib.moe import Routing, capturing_routing
from infer_tool.calib.quantizers.base import LayerContext, LayerQuantizer, Needs, record_rtn_fallback
from infer_tool.calib.replay import replay_points, replaying
from infer_tool.calib.stats import LayerStats, StatsAccumulator
from infer_tool.packers.gptq import quantize_gptq
from infer_tool.packers.quantized import QuantizedWeight


class GPTQQuantizer(LayerQuantizer):
    def needs(self, scheme: Any) -> Needs:
        return Needs(hessian=True)

    def solve(self, W: torch.Tensor, stats: LayerStats | None, scheme: Any, name: str) -> QuantizedWeight:
        return quantize_gptq(W, stats, scheme)

    def quantize_layer(self, ctx: LayerContext, scheme: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        layer, X, calls, arch = ctx.layer, ctx.X, ctx.calls, ctx.arch
        Y, points = replay_points(layer, arch, X[: ctx.error_chunks], calls[: ctx.error_chunks])
        cached: dict[int, list[torch.Tensor]] = {}  # group index -> its quantized linear's outputs, per chunk
        for g, group in enumerate(arch.groups):
            todo = [n for n in group if ctx.is_target(n)]
            if not todo:
                continue
            head = ctx.module(group[0])
            acc = {group[0]: StatsAccumulator(weight_nk(head, arch.conv1d).shape[1], hessian=True)}
            keep: dict[str, list[torch.Tensor]] | None = {group[0]: []} if g in points else None
            with replaying(points, cached), capturing_inputs({group[0]: head}, accs=acc, keep=keep, keep_chunks=len(X), stop=True):
                run_until(layer, X, calls, head)
            stats = acc[group[0]].result()
            for n in group:
                ctx.result.stats[ctx.full(n)] = stats
            for n in todo:
                self.quantize_linear(ctx.result, ctx.full(n), ctx.module(n), arch, stats, scheme)
            if keep is not None:  # the sub-block's output is now final
                cached[g] = [points[g].linear(x) for x in keep.pop(group[0])]
        if ctx.moe is not None:
            with replaying(points, cached), capturing_routing(ctx.moe, keep_chunks=len(X)) as routing:
                run_until(layer, X, calls, ctx.moe.experts)
            ctx.count_tokens(routing)
            self._quantize_experts(ctx, scheme, routing)
            del routing
        with replaying(points, cached):
            Y_hat = run_layer(layer, X, calls)
        return Y, Y_hat

    def _quantize_experts(self, ctx: LayerContext, scheme: Any, routing: Routing) -> None:
        """The shared expert, then every expert in turn: gate/up, then down (see above)."""
        moe, mode = ctx.moe, ctx.moe.calibration.mode
        every_row = None  # statistics of the whole block input, measured once
        for j in ([None] if moe.shared else []) + list(range(len(moe))):
            gate, up, down = moe.shared if j is None else moe.expert(j)
            todo = [n for n in (gate, up, down) if ctx.is_target(n)]
            reason = None if j is None else ctx.starved(routing, j)
            if reason:
                for n in todo:
                    record_rtn_fallback(ctx, n, scheme, f"expert {j} {reason}")
                continue
            rows = routing.x if j is None else routing.rows(j, mode)  # (t_j, H) per chunk
            if rows is routing.x:
                every_row = every_row or _hessian(rows, ctx.module(gate))
                stats = every_row
            else:
                stats = _hessian(rows, ctx.module(gate))
            for n in (gate, up):
                if n in todo:
                    self.quantize_linear(ctx.result, ctx.full(n), ctx.module(n), ctx.arch, stats, scheme)
            if down in todo:  # its inputs through the quantized gate/up
                expert, head = ctx.module(down.rpartition(".")[0]), ctx.module(down)
                acc = {"down": StatsAccumulator(head.in_features, hessian=True)}
                with capturing_inputs({"down": head}, accs=acc, stop=True):
                    for x in rows:
                        try:
                            expert(x)
                        except StopForward:
                            pass
                self.quantize_linear(ctx.result, ctx.full(down), head, ctx.arch, acc["down"].result(), scheme)
            del stats, rows


def _hessian(rows: list[torch.Tensor], gate: torch.nn.Module) -> LayerStats:
    acc = StatsAccumulator(gate.in_features, hessian=True)
    for x in rows:
        acc.add(x)
    return acc.result()


QUANTIZER = GPTQQuantizer()
