"""GPTQ in the pipeline, true-sequential: each linear group's Hessian is measured on
inputs that went through the already-quantized earlier groups of the layer (q/k/v, then
o, then gate/up, then down), so every group compensates the error upstream of it. The
solver is `packers/gptq.quantize_gptq`.

A sub-block whose output is its last linear's output (attention -> o_proj, MLP ->
down_proj) is final once that linear is quantized: later runs replay its cached output
(`calib/replay.py`), so each linear runs once over the calibration tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from infer_tool.calib.layers import capturing_inputs, run_layer, run_until, weight_nk
from infer_tool.calib.quantizers.base import LayerContext, LayerQuantizer, Needs
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
            if keep is not None:  # the sub-block's output is now final; each kept input is freed once used
                inputs = keep.pop(group[0])
                cached[g] = [points[g].linear(inputs.pop(0)) for _ in range(len(inputs))]
        with replaying(points, cached):
            Y_hat = run_layer(layer, X, calls)
        return Y, Y_hat


QUANTIZER = GPTQQuantizer()
