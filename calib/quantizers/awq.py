"""AWQ in the pipeline, per decoder block (Lin et al. 2023, §3.2): the scale search for
every mapping of the architecture table on the fp block, then the scales folded into the
block (`awq_fold.fold_scales`, the one apply step): `search_and_fold`; then the clip search
and RTN of each linear: `clip_and_quantize`. The searches are `packers/awq`'s. Another
quantizer can take the folded layer from `search_and_fold` and round it its own way
(`awq_gptq.py`).

- The searches run on the first `search_chunks` chunks; the activation statistics use all.
  Across processes, the searches run on process 0 (which holds those chunks) and their
  scales and clip thresholds are broadcast (`calib/distributed.on_first`).
- Where the inspected block is the balanced linear itself (up -> down, v -> o), the
  output MSE comes from the Gram matrix XᵀX instead of re-running the linear for each
  candidate: the same losses, fewer flops.
- A mapping whose shapes do not line up (v -> o under GQA) is skipped, as AutoAWQ does.
- MoE layers (`awq_moe.py`): the norm before the block is balanced against every expert's
  gate/up and the shared expert's, scored on the block output; then each expert's up ->
  down, one expert at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from infer_tool.calib.architectures import AWQMapping, get_submodule
from infer_tool.calib.distributed import on_first
from infer_tool.calib.layers import (
    LayerCall,
    capturing_calls,
    capturing_inputs,
    first,
    group_modules,
    group_of,
    run_layer,
    set_weight_nk,
    weight_nk,
)
from infer_tool.calib.quantizers import register_quantizer
from infer_tool.calib.quantizers.awq_fold import fold_scales, smooth_channels
from infer_tool.calib.quantizers.awq_moe import ExpertsAWQ
from infer_tool.calib.quantizers.awq_screen import SCREEN_DTYPE, low_precision_block, native_low_precision
from infer_tool.calib.quantizers.base import LayerContext, LayerOutputs, LayerQuantizer, Needs, record
from infer_tool.calib.result import PipelineResult
from infer_tool.calib.stats import StatsAccumulator
from infer_tool.packers.awq import apply_awq_clip, awq_search_clip, awq_search_scale, unimodal
from infer_tool.packers.rtn import quantize_rtn
from infer_tool.schemes.integer import AWQScheme


@dataclass
class MappingResult:
    """One AWQ mapping of one layer: the chosen ratio α and its block-output losses, or why
    it was skipped. ratio None with no `skipped`: no scaling beat plain RTN."""

    layer: str
    smooth: str
    balance: list[str]
    ratio: float | None = None
    loss: float | None = None
    rtn_loss: float | None = None
    skipped: str | None = None
    search: dict[str, Any] | None = None  # `AWQScaleResult.summary()`: grid losses, evaluations, fast vs full

    def to_dict(self) -> dict[str, Any]:
        head = {"layer": self.layer, "smooth": self.smooth, "balance": self.balance}
        if self.skipped is not None:
            return {**head, "skipped": self.skipped}
        return {**head, "ratio": self.ratio, "loss": self.loss, "rtn_loss": self.rtn_loss, **(self.search or {})}


@dataclass
class Folded:
    """A decoder layer after AWQ's search and fold (`AWQQuantizer.search_and_fold`)."""

    Y: list[torch.Tensor]  # the fp layer's outputs per chunk (b, T, D), measured before the fold
    x: dict[
        str, torch.Tensor | None
    ]  # per linear group: its kept search inputs (t, K) divided by s; None off process 0
    experts: ExpertsAWQ | None  # the MoE block's AWQ state (its scales folded), or None
    s: dict[str, torch.Tensor]  # per linear group (its first linear): the scale (K,) its inputs are now divided by


@register_quantizer(AWQScheme)
class AWQQuantizer(LayerQuantizer[AWQScheme]):
    def needs(self, scheme: AWQScheme) -> Needs:
        return Needs(activation_stats=True, live_blocks=True)

    def stats_refusal(self, scheme: AWQScheme) -> str | None:
        return "--stats works with --method gptq or rtn: AWQ's scale search needs block outputs on live activations"

    def notes(self, result: PipelineResult, scheme: AWQScheme) -> list[str]:
        """One line on the ratio search: with the full grid, how often the loss over alpha was
        unimodal and how often the fast search would choose the same ratio; with the fast one,
        the evaluations it spent and its fallbacks (per mapping: the report's "awq" entries)."""
        searched = [e for e in result.method_report.get("awq", []) if "losses" in e]
        if not searched:
            return []
        n, grid = len(searched), len(searched[0]["losses"])
        if scheme.search == "full":
            curves = sum(unimodal(e["losses"]) for e in searched)
            same = sum(e["fast_ratio"] == e["ratio"] for e in searched)
            return [
                f"AWQ full grid search: the loss over alpha was unimodal on {curves} of {n} mappings; the fast "
                f"search (--awq-search fast) would choose the same ratio on {same} of {n}"
            ]
        spent = sum(e["evaluated"] for e in searched)
        fell = sum(e.get("fell_back", False) for e in searched)
        if scheme.search == "screen":
            screened = [e for e in searched if e["search"] == "screen"]
            others = " (the others were scored in full, exactly)" if len(screened) < n else ""
            return [
                f"AWQ screened search: {len(screened)} of {n} mappings screened in bfloat16{others}; {spent} of "
                f"{n * grid} grid points scored in float32; the whole grid on {fell} whose screen erred too much "
                "near the minimum"
            ]
        return [
            f"AWQ fast search: {spent} of {n * grid} grid evaluations; the full grid on the {fell} of {n} mappings "
            "whose loss over alpha was not unimodal where it looked"
        ]

    def quantize_layer(self, ctx: LayerContext, scheme: AWQScheme) -> LayerOutputs:
        folded = self.search_and_fold(ctx, scheme)
        self.clip_and_quantize(ctx, scheme, folded)
        return LayerOutputs(folded.Y[: ctx.error_chunks], run_layer(ctx.layer, ctx.X, ctx.calls))

    def search_and_fold(self, ctx: LayerContext, scheme: AWQScheme) -> Folded:
        """AWQ's scale search for every mapping on the fp block, then every scale folded into
        the block (as AutoAWQ: all searches first). The layer computes the same function
        afterwards, with its balanced linears' weights multiplied by s; nothing is quantized.
        Returns the fp block outputs (measured before any change) and the kept search inputs
        divided by s."""
        layer, arch, result = ctx.layer, ctx.arch, ctx.result
        heads = group_modules(layer, arch)
        accs = {k: StatsAccumulator(weight_nk(m, arch.conv1d).shape[1], hessian=False) for k, m in heads.items()}
        keep: dict[str, list[torch.Tensor]] = {k: [] for k in heads}
        experts = ExpertsAWQ(ctx, scheme) if ctx.moe is not None else None
        mappings = arch.mappings + ((experts.mapping,) if experts else ())
        inspect = {m.inspect: get_submodule(layer, m.inspect) for m in mappings}
        icalls: dict[str, list[LayerCall]] = {k: [] for k in inspect}
        iouts: dict[str, list[torch.Tensor]] = {k: [] for k in inspect}
        with (
            capturing_inputs(heads, accs=accs, keep=keep, keep_chunks=ctx.search_chunks),
            capturing_calls(inspect, icalls, iouts, ctx.search_chunks),
            experts.measuring() if experts else nullcontext(),
        ):
            Y = run_layer(layer, ctx.X, ctx.calls)
        stats = {k: a.result() for k, a in accs.items()}
        for group in arch.groups:
            for n in group:
                result.stats[ctx.full(n)] = stats[group[0]]
        # (t, K) per group; None on a process without search chunks (the searches run on process 0)
        x_sub = {k: torch.cat([x.reshape(-1, x.shape[-1]) for x in v]) if v else None for k, v in keep.items()}

        found: list[tuple[AWQMapping, torch.Tensor]] = []
        entries = result.method_report.setdefault("awq", [])
        for m in arch.mappings:
            s = self.search_mapping(
                ctx,
                m,
                scheme,
                lambda m=m: stats[group_of(arch, m.balance[0])].act_abs_mean,
                icalls,
                iouts,
                entries=entries,
            )
            if s is not None:
                found.append((m, s))
        if experts:
            experts.search(self.search_mapping, icalls, iouts, entries)
        divided: dict[str, torch.Tensor] = {}
        for m, s in found:
            fold_scales(get_submodule(layer, m.smooth), [get_submodule(layer, b) for b in m.balance], s, m, arch)
            key = group_of(arch, m.balance[0])
            divided[key] = s
            if x_sub[key] is not None:
                x_sub[key] = x_sub[key] / s.to(x_sub[key].device).view(1, -1)
        if experts:
            experts.fold()
        return Folded(Y, x_sub, experts, divided)

    def clip_and_quantize(self, ctx: LayerContext, scheme: AWQScheme, folded: Folded) -> None:
        """The clip search, then RTN, of every target linear of a folded layer."""
        for group in ctx.arch.groups:
            for n in group:
                if ctx.is_target(n):
                    self.clip_and_record(ctx, n, scheme, folded.x[group[0]])
        if folded.experts:
            folded.experts.quantize(self.clip_and_record)

    def search_mapping(
        self,
        ctx: LayerContext,
        m: AWQMapping,
        scheme: AWQScheme,
        x_abs_mean: Callable[[], torch.Tensor],
        icalls: dict[str, list[LayerCall]],
        iouts: dict[str, list[torch.Tensor]],
        *,
        entries: list[dict[str, Any]],
    ) -> torch.Tensor | None:
        """The scale search of one mapping on the fp block (its entry appended to `entries`):
        s (K,), or None when the mapping is skipped. `icalls` / `iouts`: the inspected
        module's calls and outputs on the search chunks; `x_abs_mean()`: mean |x| of the
        balance layers' input."""
        layer, arch = ctx.layer, ctx.arch
        entry = MappingResult(ctx.prefix, m.smooth, list(m.balance))
        if not all(ctx.is_target(b) for b in m.balance):
            entry.skipped = "a balance layer is not quantized (--ignore)"
            entries.append(entry.to_dict())
            return None
        smooth = get_submodule(layer, m.smooth)
        balance = [get_submodule(layer, b) for b in m.balance]
        K = int(weight_nk(balance[0], arch.conv1d).shape[1])
        need = K * (m.part[1] if m.part else 1)
        if smooth_channels(smooth, arch) != need:
            entry.skipped = f"{m.smooth} has {smooth_channels(smooth, arch)} outputs, {m.balance[0]} reads {K} (GQA)"
            entries.append(entry.to_dict())
            return None
        originals = [weight_nk(b, arch.conv1d).detach().clone() for b in balance]
        module = get_submodule(layer, m.inspect)

        def forward(effective: list[torch.Tensor]) -> torch.Tensor:
            for b, w in zip(balance, effective):
                set_weight_nk(b, w, arch.conv1d)
            with torch.no_grad():
                return torch.cat([first(module(*c.args, **c.kwargs)) for c in icalls[m.inspect]])

        def search() -> Any:
            gram = None
            if m.balance == (m.inspect,):  # the block is the linear: its output MSE from XᵀX
                T = sum(c.args[0].numel() // K for c in icalls[m.inspect])
                N, n = sum(int(o.shape[0]) for o in originals), scheme.grid + 1
                if n * T * N * K > n * N * K * K + T * K * K:  # flops: running X·Wᵀ vs forming XᵀX once
                    x = torch.cat([c.args[0].reshape(-1, K) for c in icalls[m.inspect]]).float()
                    gram = (x.T @ x, T)
            screen, gram_lo = None, None
            if gram is None and scheme.search == "screen":
                forward_lo = low_precision_block(module, balance, icalls[m.inspect], arch.conv1d)
                if forward_lo is not None:
                    screen = (forward_lo, forward_lo(originals))
            elif gram is not None and scheme.search == "screen" and native_low_precision(gram[0].device):
                gram_lo = gram[0].to(SCREEN_DTYPE)
            return awq_search_scale(
                x_abs_mean().to(originals[0].device),
                originals,
                forward,
                None if gram else torch.cat(iouts[m.inspect]),
                scheme,
                gram=gram,
                screen=screen,
                gram_lo=gram_lo,
                qdq=self.qdq(ctx, m, scheme),
            )

        try:
            found_scale = on_first(search)  # process 0 holds the search chunks
        finally:
            for b, w in zip(balance, originals):
                set_weight_nk(b, w, arch.conv1d)
        entry.ratio, entry.loss, entry.rtn_loss = found_scale.ratio, found_scale.best_loss, found_scale.rtn_loss
        entry.search = found_scale.summary()
        entries.append(entry.to_dict())
        return found_scale.scales

    def qdq(
        self, ctx: LayerContext, m: AWQMapping, scheme: AWQScheme
    ) -> Callable[[list[torch.Tensor]], list[torch.Tensor]] | None:
        """How the scale search quantize-dequantizes mapping `m`'s scaled balance weights
        (`awq_search_scale`'s `qdq`); None: the scheme's INT RTN of each."""
        return None

    def clip_and_record(self, ctx: LayerContext, n: str, scheme: AWQScheme, x: torch.Tensor | None) -> None:
        """The clip search of linear `n` on its (scaled) inputs x (t, K), then RTN; x None or
        empty: RTN only."""
        module = ctx.module(n)
        W = weight_nk(module, ctx.arch.conv1d).detach().float()
        clip = on_first(
            lambda: (
                awq_search_clip(W, x, scheme).cpu()
                if scheme.clip and n not in ctx.arch.no_clip and x is not None and x.shape[0]
                else None
            )
        )
        if clip is not None:
            W = apply_awq_clip(W, clip)
        record(ctx.result, ctx.full(n), module, quantize_rtn(W, None, scheme), ctx.arch, None)
