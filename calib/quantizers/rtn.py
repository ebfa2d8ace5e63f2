"""RTN in the pipeline: every linear alone (the solver is `packers/rtn.quantize_rtn`).

Without statistics by default. A scheme that reads activations (static int8 activations'
`input_scale`, SmoothQuant's per-channel maxima) measures every group's input in one fp
pass of the layer first (not true-sequential, like FP8's statistics); SmoothQuant is then
folded (`smoothquant.smooth_layer`) and each linear solved with its group's (smoothed)
statistics. MoE experts take their statistics from their rows of the block input (every row,
or their routed rows under --moe-calibration routed), as FP8's quantizer does.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from infer_tool.calib.layers import run_layer
from infer_tool.calib.moe import capturing_routing
from infer_tool.calib.quantizers import register_quantizer
from infer_tool.calib.quantizers.base import (
    LayerContext,
    LayerOutputs,
    LayerQuantizer,
    Needs,
    measure_groups,
    run_counting,
    with_input_scale,
)
from infer_tool.calib.quantizers.fp8 import expert_stats
from infer_tool.calib.quantizers.smoothquant import SmoothsSavedStats, smooth_layer
from infer_tool.calib.stats import LayerStats
from infer_tool.packers.int_weight import QuantizedWeight
from infer_tool.packers.rtn import quantize_rtn
from infer_tool.schemes.integer import RTNScheme


@register_quantizer(RTNScheme)
class RTNQuantizer(SmoothsSavedStats, LayerQuantizer[RTNScheme]):
    def needs(self, scheme: RTNScheme) -> Needs:
        smooth = scheme.smoothquant is not None
        return Needs(activation_stats=smooth or scheme.int8_activations == "static", channel_max=smooth)

    def solve(self, W: torch.Tensor, stats: LayerStats | None, scheme: RTNScheme, name: str) -> QuantizedWeight:
        return with_input_scale(quantize_rtn(W, stats, scheme), stats, scheme, name)

    def quantize_layer(self, ctx: LayerContext, scheme: RTNScheme) -> LayerOutputs:
        if self.needs(scheme).data_free:
            return super().quantize_layer(ctx, scheme)
        layer, arch, e = ctx.layer, ctx.arch, ctx.error_chunks
        Y = run_layer(layer, ctx.X[:e], ctx.calls[:e])  # fp outputs, for the error only
        static_experts = ctx.moe is not None and scheme.int8_activations == "static"
        keep = capturing_routing(ctx.moe, keep_chunks=len(ctx.X)) if static_experts else nullcontext()
        with keep as routing:
            stats = measure_groups(ctx)
        if scheme.smoothquant is not None:
            stats = smooth_layer(
                layer, ctx.prefix, arch, scheme.smoothquant, stats, targets=ctx.targets, result=ctx.result
            )
        for group in arch.groups:
            for n in group:
                ctx.result.stats[ctx.full(n)] = stats[group[0]]
                if ctx.is_target(n):
                    self.quantize_linear(ctx.result, ctx.full(n), ctx.module(n), arch, stats[group[0]], scheme)
        if ctx.moe is not None:
            if routing is not None:
                ctx.count_tokens(routing)
            for j in ctx.moe.order():
                todo = [n for n in ctx.moe.expert(j) if ctx.is_target(n)]
                rows = (
                    None
                    if routing is None or not todo
                    else (
                        routing.x if j is None or ctx.starved(routing, j) else routing.rows(j, ctx.moe.calibration.mode)
                    )
                )
                st = expert_stats(ctx, j, rows, False) if rows is not None else {}
                for n in todo:
                    self.quantize_linear(ctx.result, ctx.full(n), ctx.module(n), arch, st.get(n), scheme)
        return LayerOutputs(
            Y, run_counting(ctx) if ctx.moe is not None and routing is None else run_layer(layer, ctx.X, ctx.calls)
        )
