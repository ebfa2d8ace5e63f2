"""AWQ on an MoE block (Lin et al. 2023, §3.2, with the block's experts as balance layers),
driven by `awq.py` for one decoder layer:

1. `measuring`, during the layer's statistics pass: mean |x| of the block input and of each
   expert's down_proj input over every chunk (in "all" mode every expert computes on every
   token), the block input and the router's choices on the search chunks, and the tokens
   routed to each expert.
2. `search`, on the fp block: the norm the block reads (`post_attention_layernorm`) against
   the gate/up of every expert and of the shared expert, one scale s (H,) shared by all,
   scored on the MoE block output (routed experts only, as the model computes it); then
   each expert's up -> down, one expert at a time, scored from XᵀX of that expert's
   intermediate activations (its rows of the search chunks: every row in "all" mode, its
   routed rows in "routed" mode).
3. `fold`: the norm's s also goes into the router's and the shared-expert gate's weights
   (not quantized), so routing is unchanged.
4. `quantize`: the clip search of each expert's linears on its (scaled) inputs, then RTN.
   An expert with too few routed tokens ("routed" mode) gets plain RTN, named as a fallback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from infer_tool.calib.architectures import AWQMapping
from infer_tool.calib.distributed import on_first
from infer_tool.calib.layers import LayerCall, capturing_inputs
from infer_tool.calib.moe import Routing, all_tokens, capturing_routing, run_until_down
from infer_tool.calib.quantizers.awq_fold import fold_scales
from infer_tool.calib.quantizers.base import LayerContext, record_rtn_fallback
from infer_tool.calib.stats import LayerStats, StatsAccumulator
from infer_tool.schemes.integer import AWQScheme


def clip_rows(x: torch.Tensor, scheme: AWQScheme) -> torch.Tensor:
    """The evenly spaced tokens the clip search reads (`awq_search_clip` subsamples alike)."""
    return x[:: max(1, x.shape[0] // scheme.clip_tokens)][: scheme.clip_tokens]


class ExpertsAWQ:
    """AWQ's state for the MoE block of one layer (`ctx.moe`); see the module docstring."""

    def __init__(self, ctx: LayerContext, scheme: AWQScheme) -> None:
        self.ctx, self.scheme, self.moe = ctx, scheme, ctx.moe
        self.jobs = self.moe.order()  # None: the shared expert
        gate_ups = tuple(n for j in self.jobs for n in self.moe.expert(j)[:2])
        self.mapping = AWQMapping(self.moe.smooth or "", gate_ups, self.moe.spec.block)
        self.routing: Routing | None = None
        self.stats: dict[str, LayerStats] = {}  # "in": the block input; f"{j}": expert j's down_proj input
        self.found: list[tuple[AWQMapping, torch.Tensor, int | None]] = []  # (mapping, s, expert) to fold
        self.x_down: dict[int | None, torch.Tensor] = {}  # the clip search's rows of each down_proj input

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        ctx = self.ctx
        downs = {str(j): ctx.module(self.moe.expert(j)[2]) for j in self.jobs}
        heads = {"in": self.moe.experts, **downs}
        width = ctx.module(self.moe.expert(self.jobs[0])[0]).in_features  # H
        accs = {k: StatsAccumulator(width if k == "in" else m.in_features, hessian=False) for k, m in heads.items()}
        with (
            capturing_inputs(heads, accs=accs),
            capturing_routing(self.moe, keep_chunks=ctx.search_chunks) as routing,
            all_tokens(self.moe, self.moe.calibration.mode == "all"),
        ):
            yield
        self.routing = routing
        self.stats = {k: st for k, a in accs.items() if (st := a.result(empty_ok=True)) is not None}
        ctx.count_tokens(routing)

    def rows(self, j: int | None) -> list[torch.Tensor]:
        """Expert j's rows of the block input on the search chunks (the shared expert: all)."""
        return self.routing.x if j is None else self.routing.rows(j, self.moe.calibration.mode)

    def starved(self, j: int | None) -> str | None:
        return None if j is None else self.ctx.starved(self.routing, j)

    def search(
        self,
        search_mapping: Callable[..., torch.Tensor | None],
        icalls: dict[str, list[LayerCall]],
        iouts: dict[str, list[torch.Tensor]],
        entries: list[dict[str, Any]],
    ) -> None:
        """The norm -> every gate/up search, then each expert's up -> down (fp weights); on
        process 0, which holds the search chunks: the scales and entries reach every process."""
        before = len(entries)

        def run() -> tuple[list[tuple[AWQMapping, torch.Tensor, int | None]], list[dict[str, Any]]]:
            self._search(search_mapping, icalls, iouts, entries)
            return self.found, entries[before:]

        self.found, found_entries = on_first(run)
        entries[before:] = found_entries

    def _search(
        self,
        search_mapping: Callable[..., torch.Tensor | None],
        icalls: dict[str, list[LayerCall]],
        iouts: dict[str, list[torch.Tensor]],
        entries: list[dict[str, Any]],
    ) -> None:
        ctx = self.ctx
        if self.moe.smooth:
            s = search_mapping(
                ctx, self.mapping, self.scheme, lambda: self.stats["in"].act_abs_mean, icalls, iouts, entries=entries
            )
            if s is not None:
                self.found.append((self.mapping, s, None))
        for j in self.jobs:
            gate, up, down = self.moe.expert(j)
            if self.starved(j):
                continue
            x = self._down_inputs(j)  # (t, I) per chunk
            if not sum(int(c.shape[0]) for c in x):
                continue
            self.x_down[j] = clip_rows(torch.cat(x), self.scheme)
            head = ctx.module(down)
            mapping = AWQMapping(up, (down,), down)
            calls = {down: [LayerCall((c,), {}) for c in x]}
            outs = {down: [head(c) for c in x]}
            s = search_mapping(
                ctx, mapping, self.scheme, lambda j=j: self.stats[str(j)].act_abs_mean, calls, outs, entries=entries
            )
            if s is not None:
                self.found.append((mapping, s, j))

    def _down_inputs(self, j: int | None) -> list[torch.Tensor]:
        """Expert j's down_proj inputs on its search rows, through its current gate/up."""
        keep: list[torch.Tensor] = []
        run_until_down(self.ctx.module(self.moe.module_name(j)), [r for r in self.rows(j) if r.shape[0]], keep=keep)
        return keep

    def fold(self) -> None:
        """Fold every scale found; the norm's also into the router (and the shared gate)."""
        ctx = self.ctx
        for m, s, j in self.found:
            extra = [ctx.module(n) for n in self.moe.unquantized] if m == self.mapping else []
            fold_scales(ctx.module(m.smooth), [ctx.module(b) for b in m.balance] + extra, s, m, ctx.arch)
            if m == self.mapping:
                self.s_in = s
            elif j in self.x_down:  # process 0 only
                self.x_down[j] = self.x_down[j] / s.to(self.x_down[j].device).view(1, -1)

    def quantize(self, clip_and_record: Callable[[LayerContext, str, Any, torch.Tensor | None], None]) -> None:
        """Clip + RTN of every expert's linears; starved experts: RTN, counted as fallbacks."""
        ctx, scheme = self.ctx, self.scheme
        s_in = getattr(self, "s_in", None)
        every_row = None
        for j in self.jobs:
            names = self.moe.expert(j)
            reason = self.starved(j)
            if reason:
                for n in names:
                    if ctx.is_target(n):
                        record_rtn_fallback(ctx, n, scheme, f"expert {j} {reason}")
                continue
            if j is None or self.moe.calibration.mode == "all":
                every_row = every_row if every_row is not None else self._scaled(self.routing.x, s_in)
                x_in = every_row
            else:
                x_in = self._scaled(self.rows(j), s_in)
            for n, x in zip(names, (x_in, x_in, self.x_down.get(j))):
                if ctx.is_target(n):
                    clip_and_record(ctx, n, scheme, x)

    def _scaled(self, rows: list[torch.Tensor], s: torch.Tensor | None) -> torch.Tensor | None:
        rows = [r for r in rows if r.shape[0]]
        if not rows:
            return None
        x = clip_rows(torch.cat(rows), self.scheme)
        return x if s is None else x / s.to(x.device).view(1, -1)
