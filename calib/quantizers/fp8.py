"""FP8 (e4m3) in the pipeline. The solver is `packers/fp8.quantize_fp8_weight`.

FP8 needs no Hessian-based error feedback: each linear is quantized on its own (RTN-like).
Statistics are measured only when the scheme needs them, on the decoder layer's inputs
(which went through the already-quantized earlier layers):
- static activations: `act_abs_max` of each linear's input -> `input_scale`;
- clip search: the layer Hessian H of each linear group -> `search_fp8_clip`.
Within a layer, the statistics are taken in one fp pass (not true-sequential: o_proj's
inputs come from the unquantized q/k/v), which is what llm-compressor's FP8 presets do.

MoE layers: each expert is quantized on its own. With static activations or the clip
search, its statistics come from its rows of the block input captured in the same fp
pass (every row in "all" mode, its routed rows in "routed" mode; an expert with too few
routed rows takes every row instead, reported as a fallback): gate/up read them, down reads
the expert's fp intermediate activations on them.

KV cache (`kv_cache="fp8"`): once a layer's linears are FP8, the layer is run once more
on its calibration inputs with the attention's cache recorded (`calib/kv_scales.py`), so
the per-layer post-RoPE key / value amax is measured layer by layer on the activations the
deployed FP8 model produces (one extra layer pass; no full-model pass).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from infer_tool.calib.distributed import all_max, all_sum, chunks
from infer_tool.calib.kv_scales import recording_kv
from infer_tool.calib.layers import capturing_inputs, run_layer, weight_nk
from infer_tool.calib.moe import Routing, capturing_routing, run_until_down
from infer_tool.calib.quantizers import register_quantizer
from infer_tool.calib.quantizers.base import LayerContext, LayerOutputs, LayerQuantizer, Needs, run_counting
from infer_tool.calib.result import Fallback, PipelineResult
from infer_tool.calib.stats import LayerStats, StatsAccumulator
from infer_tool.packers.fp8 import Fp8Weight, check_finite, quantize_fp8_weight, search_fp8_clip, static_input_scale
from infer_tool.schemes.fp8 import Fp8Scheme


@register_quantizer(Fp8Scheme)
class Fp8Quantizer(LayerQuantizer[Fp8Scheme]):
    def needs(self, scheme: Fp8Scheme) -> Needs:
        return Needs(
            hessian=scheme.needs_hessian,
            activation_stats=scheme.needs_activation_stats,
            layer_pass=scheme.kv_cache == "fp8",
        )

    def stats_refusal(self, scheme: Fp8Scheme) -> str | None:
        if scheme.kv_cache:
            return "--kv-cache fp8 needs a calibration pass through the model; drop --stats"
        return None

    def notes(self, result: PipelineResult, scheme: Fp8Scheme) -> list[str]:
        """Block shapes runtimes refuse; KV scales transformers ignores."""
        from infer_tool.packers.codecs.fp8_formats import block_alignment_notes

        notes = []
        if scheme.granularity == "block":
            notes += block_alignment_notes({n: w.shape for n, w in result.quantized.items()}, scheme.block_size)
        if result.expert_tokens and scheme.granularity == "tensor" and scheme.activations == "dynamic":
            notes.append(
                "vLLM 0.32's compressed-tensors FP8 MoE kernels take per-tensor expert weights only with static "
                "activations (--fp8-activations static); per-channel (the default) or block weights go with "
                "dynamic ones"
            )
        if result.kv_amax:
            notes.append(
                "k_scale/v_scale are read by vLLM (kv_cache_dtype fp8); transformers 5.x with compressed-tensors "
                "0.20 does not attach them (it looks for a past_key_value(s) argument) and reports them as "
                "unexpected keys"
            )
        return notes

    def solve(self, W: torch.Tensor, stats: LayerStats | None, scheme: Fp8Scheme, name: str) -> Fp8Weight:
        """W (N, K) -> Fp8Weight, with clip ratios (from H) and the static input scale (from
        max |x|) when the scheme asks for them."""
        check_finite(W, f"{name}.weight")
        clip = search = None
        if scheme.clip_search:
            if stats is None or stats.H is None:
                raise ValueError(f"{name}: the FP8 clip search needs the layer Hessian")
            search = search_fp8_clip(W, stats.H.to(W.device), scheme, name=f"{name}.weight")
            clip = search.ratios
        input_scale = None
        if scheme.activations == "static":
            if stats is None:
                raise ValueError(f"{name}: static FP8 activations need calibration statistics")
            input_scale = static_input_scale(stats.act_abs_max)
        fw = quantize_fp8_weight(W, scheme, name=f"{name}.weight", clip=clip, input_scale=input_scale)
        if search is not None:
            fw.info["clip_ratio_min"] = float(clip.min())
            fw.info["clip_ratio_mean"] = float(clip.mean())
            fw.info["clip_loss_ratio"] = search.loss_chosen / max(search.loss_unclipped, 1e-30)
        return fw

    def quantize_layer(self, ctx: LayerContext, scheme: Fp8Scheme) -> LayerOutputs:
        layer, arch, e = ctx.layer, ctx.arch, ctx.error_chunks
        Y = run_layer(layer, ctx.X[:e], ctx.calls[:e])  # fp outputs, for the error only
        groups = [g for g in arch.groups if any(ctx.is_target(n) for n in g)]
        stats: dict[str, LayerStats] = {}
        routing = None
        if (groups or ctx.moe) and (scheme.needs_activation_stats or scheme.needs_hessian):
            heads = {g[0]: ctx.module(g[0]) for g in groups}
            accs = {
                k: StatsAccumulator(weight_nk(m, arch.conv1d).shape[1], hessian=scheme.needs_hessian)
                for k, m in heads.items()
            }
            keep = capturing_routing(ctx.moe, keep_chunks=len(ctx.X)) if ctx.moe else nullcontext()
            with capturing_inputs(heads, accs=accs), keep as routing:
                run_layer(layer, ctx.X, ctx.calls)
            for g in groups:
                st = accs[g[0]].result()
                for n in g:
                    stats[n] = ctx.result.stats[ctx.full(n)] = st
            if routing is not None:
                ctx.count_tokens(routing)
        for g in groups:
            for n in g:
                if ctx.is_target(n):
                    self.quantize_linear(ctx.result, ctx.full(n), ctx.module(n), arch, stats.get(n), scheme)
        if ctx.moe is not None:
            self._quantize_experts(ctx, scheme, routing)
        if scheme.kv_cache == "fp8":
            with recording_kv(layer, f"{ctx.prefix}.") as kv:
                run_layer(layer, ctx.X, ctx.calls)
            ctx.result.kv_amax.update(_over_processes(kv))
        uncounted = ctx.moe is not None and routing is None  # no statistics pass counted the routed tokens
        return LayerOutputs(Y, run_counting(ctx) if uncounted else run_layer(layer, ctx.X, ctx.calls))

    def _quantize_experts(self, ctx: LayerContext, scheme: Fp8Scheme, routing: Routing | None) -> None:
        """The shared expert, then every expert, one at a time; `routing` None: no statistics."""
        moe = ctx.moe
        for j in moe.order():
            names = moe.expert(j)
            todo = [n for n in names if ctx.is_target(n)]
            stats: dict[str, LayerStats | None] = dict.fromkeys(names)
            reason = None
            if routing is not None and todo:
                reason = None if j is None else ctx.starved(routing, j)
                rows = routing.x if j is None or reason else routing.rows(j, moe.calibration.mode)
                stats = expert_stats(ctx, j, rows, scheme.needs_hessian)
            for n in todo:
                self.quantize_linear(ctx.result, ctx.full(n), ctx.module(n), ctx.arch, stats[n], scheme)
                if reason:
                    ctx.result.fallbacks.append(
                        Fallback(ctx.full(n), "statistics over every token", f"expert {j} {reason}")
                    )


def expert_stats(ctx: LayerContext, j: int | None, rows: list[torch.Tensor], hessian: bool) -> dict[str, LayerStats]:
    """{gate, up: statistics of `rows`; down: of expert j's fp intermediate activations on them}."""
    gate, up, down = ctx.moe.expert(j)
    acc_in = StatsAccumulator(ctx.module(gate).in_features, hessian=hessian)
    acc_down = StatsAccumulator(ctx.module(down).in_features, hessian=hessian)
    for x in chunks(rows):
        acc_in.add(x)
    run_until_down(ctx.module(ctx.moe.module_name(j)), rows, acc=acc_down)
    st = acc_in.result()
    return {gate: st, up: st, down: acc_down.result()}


def _over_processes(kv: dict[str, Any]) -> dict[str, Any]:
    """Each attention's KV amax (MAX) and tokens (sum) over every process."""
    names = sorted(kv)
    amax = all_max([a for n in names for a in (kv[n].k_amax, kv[n].v_amax)])
    tokens = all_sum(torch.tensor([kv[n].tokens for n in names], dtype=torch.int64)).tolist()
    for i, n in enumerate(names):
        kv[n].k_amax, kv[n].v_amax, kv[n].tokens = amax[2 * i], amax[2 * i + 1], tokens[i]
    return kv
