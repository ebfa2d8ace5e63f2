"""FP4 (NVFP4, MXFP4) in the pipeline: the RTN, GPTQ, AWQ and AutoRound quantizers of the FP4 schemes
(`schemes/fp4.py`), each its INT method's driver with the FP4 solvers (`packers/fp4_solve.py`);
AWQ+GPTQ composes the FP4 AWQ and GPTQ steps as it does the INT ones (`awq_gptq.py`).

Fused shards share one NVFP4 global scale (`GlobalScales`): the linears of one group of the
architecture table (q/k/v, gate/up: they read one input and vLLM fuses them) and each
expert's gate/up (vLLM's w13 keeps w1's scale), from the shards' weights before any of them
is solved (RTN, GPTQ: the original weights; AWQ, AWQ+GPTQ: after the scales are folded in, the
weights it rounds). Fallbacks (a failed Cholesky, a starved expert) are FP4 RTN with that scale.

W4A4 NVFP4: each linear's `input_global_scale = 448·6 / max|x|` of its calibration inputs,
measured with the layer's earlier linears already quantized: GPTQ's from the inputs each
Hessian was measured on (true-sequential; an MoE layer's experts in one more pass of the
quantized layer, on their routed tokens); RTN's and AWQ's in the quantized layer's output
pass (the pass that makes the next layer's inputs); with `--stats`, the saved (fp model's)
statistics. In an MoE layer every expert's gate/up get one (from the largest max |x| over
the experts) and every down another, as vLLM collapses them to one per layer (the largest
activation range) whatever the checkpoint says; the shared expert keeps its own. MXFP4 W4A4
scales activations dynamically: nothing is measured for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from infer_tool.calib.architectures import Architecture, AWQMapping, get_submodule
from infer_tool.calib.distributed import on_first
from infer_tool.calib.layers import capturing_inputs, run_layer, weight_nk
from infer_tool.calib.quantizers import register_quantizer
from infer_tool.calib.quantizers.autoround import AutoRoundQuantizer
from infer_tool.calib.quantizers.awq import AWQQuantizer, Folded
from infer_tool.calib.quantizers.base import LayerContext, LayerOutputs, LayerQuantizer, Needs, record, run_counting
from infer_tool.calib.quantizers.gptq import SOLVE_ELEMENTS, GPTQQuantizer
from infer_tool.calib.result import PipelineResult
from infer_tool.calib.stats import LayerStats, StatsAccumulator
from infer_tool.packers import fp4
from infer_tool.packers.autoround import Rounding
from infer_tool.packers.autoround_fp4 import Fp4Grouped, fake_quantize_rounding_fp4, quantize_rounding_fp4
from infer_tool.packers.awq import apply_awq_clip, awq_search_clip
from infer_tool.packers.fp4_solve import (
    fake_quantize_shards,
    fp4_global_scale,
    input_global_scale,
    quantize_fp4_gptq,
    quantize_fp4_rtn,
)
from infer_tool.packers.fp4_weight import Fp4Weight
from infer_tool.packers.gptq import part_info, part_rows
from infer_tool.schemes.fp4 import Fp4AutoRoundScheme, Fp4AWQScheme, Fp4GPTQScheme, Fp4RTNScheme, Fp4Scheme

NO_TOKENS_AMAX = 0.0  # an input no calibration token reached: global scale 1 (`fp4.nvfp4_global_scale`)


def fused_groups(arch: Architecture, moe: object | None, is_target: Callable[[str], bool]) -> list[tuple[str, ...]]:
    """The groups of a layer's quantized linears (names relative to the layer) that share one
    global scale: the table's groups, then per expert (gate, up) and (down,)."""
    groups = [tuple(n for n in g if is_target(n)) for g in arch.groups]
    if moe is not None:
        for j in moe.order():
            gate, up, down = moe.expert(j)
            groups += [tuple(n for n in (gate, up) if is_target(n)), (down,) if is_target(down) else ()]
    return [g for g in groups if g]


class GlobalScales:
    """NVFP4 global scales of one decoder layer's quantized linears (full names), one per fused
    group, computed from the group's current weights when one of its linears is first asked
    for; MXFP4: None."""

    def __init__(self, scheme: Fp4Scheme, groups: Iterable[tuple[str, ...]], weight_of: Callable[[str], torch.Tensor]):
        self.scheme = scheme
        self.group = {n: g for g in groups for n in g}
        self.weight_of = weight_of
        self.known: dict[str, torch.Tensor | None] = {}

    @classmethod
    def of_layer(
        cls, layer: nn.Module, prefix: str, arch: Architecture, moe: object | None, targets: set[str], scheme: Fp4Scheme
    ) -> GlobalScales:
        groups = fused_groups(arch, moe, lambda n: f"{prefix}.{n}" in targets)
        strip = len(prefix) + 1
        return cls(
            scheme,
            [tuple(f"{prefix}.{n}" for n in g) for g in groups],
            lambda full: weight_nk(get_submodule(layer, full[strip:]), arch.conv1d).detach(),
        )

    def of(self, name: str) -> torch.Tensor | None:
        if not self.scheme.global_scales:
            return None
        if name not in self.known:
            group = self.group.get(name, (name,))
            gs = fp4_global_scale([self.weight_of(n) for n in group], self.scheme)
            self.known.update(dict.fromkeys(group, gs))
        return self.known[name]


def expert_kinds(ctx: LayerContext) -> dict[str, str]:
    """{full name: "w13" | "w2"} of the routed experts' quantized linears of an MoE layer (not
    the shared expert's): the linears whose input global scales vLLM collapses per layer."""
    if ctx.moe is None:
        return {}
    out = {}
    for j in range(len(ctx.moe)):
        gate, up, down = ctx.moe.expert(j)
        out.update({ctx.full(gate): "w13", ctx.full(up): "w13", ctx.full(down): "w2"})
    return {n: k for n, k in out.items() if n in ctx.targets}


def set_input_scales(ctx: LayerContext, amax: dict[str, float], scheme: Fp4Scheme) -> None:
    """Give every quantized linear of the layer its `input_global_scale` from the max |x| of its
    inputs (`amax`, full names); routed experts' gate/up and down share the largest of theirs."""
    if input_global_scale(0.0, scheme) is None:
        return
    kinds = expert_kinds(ctx)
    shared = {
        k: max([amax.get(n, NO_TOKENS_AMAX) for n, kk in kinds.items() if kk == k], default=NO_TOKENS_AMAX)
        for k in ("w13", "w2")
    }
    for n in ctx.linears:
        full = ctx.full(n)
        if full in ctx.result.quantized:
            a = shared[kinds[full]] if full in kinds else amax.get(full, NO_TOKENS_AMAX)
            ctx.result.quantized[full].input_global_scale = input_global_scale(a, scheme)


def measured(ctx: LayerContext, run: Callable[[], list[torch.Tensor]]) -> tuple[list[torch.Tensor], dict[str, float]]:
    """`run()` (a pass of the quantized layer) with the max |x| of every quantized linear's
    inputs over it ({full name: amax}; 0 for an expert no token reached)."""
    mods = {ctx.full(n): ctx.module(n) for n in ctx.linears if ctx.is_target(n)}
    accs = {n: StatsAccumulator(m.in_features, hessian=False) for n, m in mods.items()}
    with capturing_inputs(mods, accs=accs):
        out = run()
    amax = {}
    for n, acc in accs.items():
        st = acc.result(empty_ok=True)
        amax[n] = NO_TOKENS_AMAX if st is None else st.act_abs_max
    return out, amax


class Fp4Layer:
    """What the three FP4 quantizers share: the layer's global scales, the FP4 RTN fallback,
    the input scales of W4A4 from saved statistics, and the report's note."""

    scales: GlobalScales | None = None

    def begin(self, ctx: LayerContext, scheme: Fp4Scheme) -> None:
        """The layer's global scales, and FP4 RTN for what falls back (`base.record_rtn_fallback`)."""
        self.scales = GlobalScales.of_layer(ctx.layer, ctx.prefix, ctx.arch, ctx.moe, ctx.targets, scheme)
        ctx.rtn = lambda W, name: self.rtn(W, scheme, name)

    def global_scale(self, name: str) -> torch.Tensor | None:
        return None if self.scales is None else self.scales.of(name)

    def rtn(self, W: torch.Tensor, scheme: Fp4Scheme, name: str) -> Fp4Weight:
        """FP4 RTN of linear `name` with its fused group's global scale."""
        return quantize_fp4_rtn(W, None, scheme, global_scale=self.global_scale(name))

    def shares_fused(self, scheme: Fp4Scheme) -> bool:
        return scheme.global_scales

    def fused_share(self, weights: list[torch.Tensor], scheme: Fp4Scheme) -> torch.Tensor | None:
        """NVFP4: the one global scale of the fused shards (MXFP4: None)."""
        return fp4_global_scale(weights, scheme)

    def solve_data_free(
        self, W: torch.Tensor, scheme: Fp4Scheme, name: str, shared: torch.Tensor | None = None
    ) -> Fp4Weight:
        """FP4 RTN at the fused group's global scale `shared` (None: W's own)."""
        return quantize_fp4_rtn(W.float(), None, scheme, global_scale=shared)

    def prepare_stats(
        self,
        layer: nn.Module,
        prefix: str,
        arch: Architecture,
        stats: dict[str, LayerStats],
        *,
        targets: set[str],
        result: PipelineResult,
        scheme: Fp4Scheme,
    ) -> dict[str, LayerStats]:
        self.scales = GlobalScales.of_layer(layer, prefix, arch, None, targets, scheme)
        return stats

    def smoothing(self, scheme: Fp4Scheme) -> None:
        """No SmoothQuant on the FP4 grid (its options are INT's)."""
        return None

    def static_int8(self, scheme: Fp4Scheme) -> bool:
        """FP4's static input scales are its own (`set_input_scales`), not int8 ones."""
        return False

    def with_input_scale(self, w: Fp4Weight, stats: LayerStats | None, scheme: Fp4Scheme) -> Fp4Weight:
        if stats is not None:
            w.input_global_scale = input_global_scale(stats.act_abs_max, scheme)
        return w

    def notes(self, result: PipelineResult, scheme: Fp4Scheme) -> list[str]:
        """The method's notes, and where the checkpoint runs."""
        served = (
            f"{scheme.preset} ({scheme.fp4}-pack-quantized): vLLM 0.32 serves it on NVIDIA GPUs (Marlin FP4 from "
            "sm75 for weights only, W4A4 natively on Blackwell) and its CPU build refuses it; transformers + "
            "compressed-tensors 0.20 runs it in bfloat16 only (load it with dtype=torch.bfloat16)"
        )
        return [*super().notes(result, scheme), served]  # type: ignore[misc]


@register_quantizer(Fp4RTNScheme)
class Fp4RTNQuantizer(Fp4Layer, LayerQuantizer[Fp4RTNScheme]):
    def needs(self, scheme: Fp4RTNScheme) -> Needs:
        return Needs(activation_stats=input_global_scale(0.0, scheme) is not None)

    def solve(self, W: torch.Tensor, stats: LayerStats | None, scheme: Fp4RTNScheme, name: str) -> Fp4Weight:
        return self.with_input_scale(self.rtn(W.float(), scheme, name), stats, scheme)

    def quantize_weights(self, ctx: LayerContext, scheme: Fp4RTNScheme) -> None:
        self.begin(ctx, scheme)
        super().quantize_weights(ctx, scheme)

    def quantize_layer(self, ctx: LayerContext, scheme: Fp4RTNScheme) -> LayerOutputs:
        if self.needs(scheme).data_free:
            return super().quantize_layer(ctx, scheme)
        e = ctx.error_chunks
        Y = run_layer(ctx.layer, ctx.X[:e], ctx.calls[:e])  # fp outputs, for the error only
        self.quantize_weights(ctx, scheme)
        Y_hat, amax = measured(ctx, lambda: run_counting(ctx))
        set_input_scales(ctx, amax, scheme)
        return LayerOutputs(Y, Y_hat)


@register_quantizer(Fp4GPTQScheme)
class Fp4GPTQQuantizer(Fp4Layer, GPTQQuantizer):
    """GPTQ's true-sequential driver (`gptq.py`) with the FP4 solver; linears sharing a
    Hessian are solved as one stack whose rows keep their own linear's global scale."""

    def __init__(self) -> None:
        self.amax: dict[str, float] = {}  # {full name: max |x| of its inputs}, this run's

    def needs(self, scheme: Fp4GPTQScheme) -> Needs:
        return Needs(hessian=True, activation_stats=input_global_scale(0.0, scheme) is not None)

    def solve(self, W: torch.Tensor, stats: LayerStats | None, scheme: Fp4GPTQScheme, name: str) -> Fp4Weight:
        w = quantize_fp4_gptq(W, stats, scheme, global_scale=self.global_scale(name))
        self._remember(name, stats)
        return self.with_input_scale(w, stats, scheme)

    def _remember(self, name: str, stats: LayerStats | None) -> None:
        if stats is not None:
            self.amax[name] = stats.act_abs_max

    def quantize_layer(self, ctx: LayerContext, scheme: Fp4GPTQScheme) -> LayerOutputs:
        self.begin(ctx, scheme)
        self.amax = {}
        out = super().quantize_layer(ctx, scheme)
        if ctx.moe is not None and input_global_scale(0.0, scheme) is not None:
            # the experts' inputs on their routed tokens (starved experts had no Hessian): one more pass
            _, amax = measured(ctx, lambda: run_layer(ctx.layer, ctx.X, ctx.calls))
            self.amax.update({n: a for n, a in amax.items() if n in expert_kinds(ctx)})
        set_input_scales(ctx, self.amax, scheme)
        return out

    def _solve_together(self, ctx: LayerContext, names: list[str], stats: LayerStats, scheme: Fp4GPTQScheme) -> None:
        """GPTQ of linears that share one Hessian as one solve over their stacked rows (as the
        INT driver's), each row with its own linear's global scale."""
        modules = [ctx.module(n) for n in names]
        weights = [weight_nk(m, ctx.arch.conv1d).detach() for m in modules]
        K = int(weights[0].shape[1])
        per_solve = max(1, SOLVE_ELEMENTS // (K * max(int(w.shape[0]) for w in weights)))
        for a in range(0, len(names), per_solve):
            part = slice(a, a + per_solve)
            fulls = [ctx.full(n) for n in names[part]]
            gs = None
            if scheme.global_scales:
                gs = torch.cat([self.global_scale(f).expand(int(w.shape[0])) for f, w in zip(fulls, weights[part])])
                gs = gs.reshape(-1, 1)
            sizes = [int(w.shape[0]) for w in weights[part]]
            solved = quantize_fp4_gptq(torch.cat(weights[part]), stats, scheme, global_scale=gs, parts=sizes)
            for i, (full, m, rows) in enumerate(zip(fulls, modules[part], part_rows(sizes, sum(sizes)))):
                self._remember(full, stats)
                one = solved.rows(rows)
                one.info = part_info(solved.info, i)
                record(ctx.result, full, m, self.with_input_scale(one, stats, scheme), ctx.arch, stats)


@register_quantizer(Fp4AWQScheme)
class Fp4AWQQuantizer(Fp4Layer, AWQQuantizer):
    """AWQ's driver (`awq.py`) with its scale and clip searches scored by the FP4 quantizer,
    then FP4 RTN of the scaled, clipped weights."""

    def search_and_fold(self, ctx: LayerContext, scheme: Fp4AWQScheme) -> Folded:
        """AWQ's searches and fold (`AWQQuantizer.search_and_fold`) with the layer's fused groups
        known to the FP4 quantizer that scores them."""
        self.begin(ctx, scheme)
        return super().search_and_fold(ctx, scheme)

    def quantize_layer(self, ctx: LayerContext, scheme: Fp4AWQScheme) -> LayerOutputs:
        folded = self.search_and_fold(ctx, scheme)
        self.clip_and_quantize(ctx, scheme, folded)
        Y = folded.Y[: ctx.error_chunks]
        if input_global_scale(0.0, scheme) is None:
            return LayerOutputs(Y, run_layer(ctx.layer, ctx.X, ctx.calls))
        Y_hat, amax = measured(ctx, lambda: run_layer(ctx.layer, ctx.X, ctx.calls))
        set_input_scales(ctx, amax, scheme)
        return LayerOutputs(Y, Y_hat)

    def qdq(
        self, ctx: LayerContext, m: AWQMapping, scheme: Fp4AWQScheme
    ) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
        """Each fused group of `m`'s balance linears (an MoE mapping holds every expert's gate/up)
        quantize-dequantized with one global scale of its own."""
        names = [ctx.full(b) for b in m.balance]
        shards: dict[tuple[str, ...], list[int]] = {}
        for i, n in enumerate(names):
            shards.setdefault(self.scales.group.get(n, (n,)) if self.scales else (n,), []).append(i)

        def qdq(weights: list[torch.Tensor]) -> list[torch.Tensor]:
            out: list[torch.Tensor | None] = [None] * len(weights)
            for idx in shards.values():
                for i, q in zip(idx, fake_quantize_shards([weights[i] for i in idx], scheme)):
                    out[i] = q
            return out  # type: ignore[return-value]

        return qdq

    def clip_and_record(self, ctx: LayerContext, n: str, scheme: Fp4AWQScheme, x: torch.Tensor | None) -> None:
        """The clip search of linear `n` on its (scaled) inputs x (t, K), scored with FP4 RTN at
        the fused group's global scale, then FP4 RTN; x None or empty: RTN only."""
        module = ctx.module(n)
        W = weight_nk(module, ctx.arch.conv1d).detach().float()
        gs = self.global_scale(ctx.full(n))

        def qdq_rows(w: torch.Tensor) -> torch.Tensor:
            return fp4.fake_quantize_weight(w, scheme.fp4, gs)

        clip = on_first(
            lambda: (
                awq_search_clip(W, x, scheme, qdq_rows=qdq_rows).cpu()
                if scheme.clip and n not in ctx.arch.no_clip and x is not None and x.shape[0]
                else None
            )
        )
        if clip is not None:
            W = apply_awq_clip(W, clip)
        record(ctx.result, ctx.full(n), module, quantize_fp4_rtn(W, None, scheme, global_scale=gs), ctx.arch, None)


@register_quantizer(Fp4AutoRoundScheme)
class Fp4AutoRoundQuantizer(Fp4Layer, AutoRoundQuantizer):
    """AutoRound's descent (`autoround.py`) on the FP4 grid (`packers/autoround_fp4.py`), each
    fused group with its global scale from the fp weights. W4A4: the block is tuned with its
    activations unquantized, and the NVFP4 input scales come from the quantized layer's output
    pass, as FP4 RTN's do."""

    def quantize_layer(self, ctx: LayerContext, scheme: Fp4AutoRoundScheme) -> LayerOutputs:
        self.begin(ctx, scheme)
        return super().quantize_layer(ctx, scheme)

    def grouped(self, ctx: LayerContext, n: str, scheme: Fp4AutoRoundScheme) -> Fp4Grouped:
        W = weight_nk(ctx.module(n), ctx.arch.conv1d)
        return Fp4Grouped.of(W, scheme, self.global_scale(ctx.full(n)))

    def fake(self, W: Fp4Grouped, p: Rounding, scheme: Fp4AutoRoundScheme) -> torch.Tensor:
        return fake_quantize_rounding_fp4(W, p, scheme)

    def rounded(self, W: Fp4Grouped, p: Rounding, scheme: Fp4AutoRoundScheme) -> Fp4Weight:
        return quantize_rounding_fp4(W, p, scheme)

    def output_pass(self, ctx: LayerContext, scheme: Fp4AutoRoundScheme) -> list[torch.Tensor]:
        if input_global_scale(0.0, scheme) is None:
            return run_counting(ctx)
        Y_hat, amax = measured(ctx, lambda: run_counting(ctx))
        set_input_scales(ctx, amax, scheme)
        return Y_hat
