"""The layer-quantizer interface every method implements, and the one step that records a
solved linear (`record`).

A quantizer is called once per decoder layer with a `LayerContext` (the layer on the
calibration device, its input chunks X and calls, the architecture entry, the linears to
quantize, the run's `PipelineResult`). It returns `LayerOutputs` (Y, Ŷ): the fp layer
outputs on the first `error_chunks` chunks and the quantized layer's outputs on every
chunk (the next layer's inputs). The default `quantize_layer` quantizes every target
linear alone with `solve` (no statistics); methods that read activations override it.

In an MoE layer, `ctx.arch` holds the attention's groups and mappings only and `ctx.moe`
the MoE block: its experts' (and shared expert's) linears are each method's to handle,
one expert at a time (`calib/moe.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any, Generic, NamedTuple, TypeVar

import torch
from torch import nn

from infer_tool.calib.architectures import Architecture, get_submodule
from infer_tool.calib.layers import (
    LayerCall,
    capturing_inputs,
    group_modules,
    run_layer,
    run_until_all,
    set_weight_nk,
    weight_nk,
)
from infer_tool.calib.moe import ExpertTokens, MoeLayer, Routing, capturing_routing
from infer_tool.calib.result import Fallback, PipelineResult
from infer_tool.calib.stats import LayerStats, StatsAccumulator, relative_output_error
from infer_tool.common.errors import BadInput
from infer_tool.packers.int8_activations import int8_input_scale
from infer_tool.packers.rtn import quantize_rtn
from infer_tool.schemes.base import Scheme

S = TypeVar("S", bound=Scheme)


@dataclass(frozen=True)
class Needs:
    """What a quantizer reads besides the weights."""

    hessian: bool = False  # H = 2XXᵀ/T of each linear group's input
    activation_stats: bool = False  # mean and max |x| of each linear group's input
    live_blocks: bool = False  # block outputs on live activations (cannot come from saved statistics)
    layer_pass: bool = False  # one more pass over the quantized layer (e.g. KV-cache amax)
    fp_chain: bool = False  # the fp layer's outputs on the fp model's own inputs (`LayerContext.Y_fp`)
    fp_inputs: bool = False  # with fp_chain: each linear group's inputs there too (`LayerContext.fp_inputs`)
    channel_max: bool = False  # max |x_j| per input channel (SmoothQuant); saved statistics need it stored

    @property
    def data_free(self) -> bool:
        """True when only the reported error reads calibration activations."""
        return not (
            self.hessian
            or self.activation_stats
            or self.live_blocks
            or self.layer_pass
            or self.fp_chain
            or self.fp_inputs
            or self.channel_max
        )


class LayerOutputs(NamedTuple):
    """What a quantizer returns for one decoder layer: the fp outputs Y on the first
    `error_chunks` chunks, and the quantized layer's outputs Ŷ on every chunk (the next
    layer's inputs), each a list of (b, T, D) chunks."""

    Y: list[torch.Tensor]
    Y_hat: list[torch.Tensor]


@dataclass
class LayerContext:
    """One decoder layer being quantized."""

    layer: nn.Module  # on the calibration device
    prefix: str  # its full name, e.g. model.layers.3
    X: list[torch.Tensor]  # input chunks (b, T, D)
    calls: list[LayerCall]  # the layer's other arguments per chunk
    _: KW_ONLY
    arch: Architecture
    targets: set[str]  # full names of the linears to quantize
    result: PipelineResult
    error_chunks: int  # chunks the reported error is measured on
    search_chunks: int  # chunks searches (AWQ) run on
    moe: MoeLayer | None = None  # the layer's MoE block; None for a dense layer
    spill: Path | None = None  # a directory for activations kept only to be read back (`calib/spill.py`)
    # With `Needs.fp_chain`: the fp layer's outputs per chunk (b, T, D) on the fp model's own
    # inputs (the fp chain, which never went through a quantized layer), the targets a
    # method can train the quantized layer toward (AutoRound); None otherwise.
    Y_fp: list[torch.Tensor] | None = None
    # With `Needs.fp_inputs`: {first linear of each group: its inputs per chunk (b, T, K) in that
    # fp pass}, each store read back once in chunk order (`calib/spill.drain`); None otherwise.
    fp_inputs: dict[str, Any] | None = None
    rtn: Callable[[torch.Tensor, str], Any] | None = None  # (W, full name) -> the method's RTN weight; None: INT RTN

    @property
    def linears(self) -> tuple[str, ...]:
        """Every linear of the layer: the table's groups, then the MoE block's."""
        if self.moe is None:
            return self.arch.linears
        shared = self.moe.shared or ()
        return self.arch.linears + tuple(shared) + tuple(n for j in range(len(self.moe)) for n in self.moe.expert(j))

    def full(self, name: str) -> str:
        return f"{self.prefix}.{name}"

    def count_tokens(self, routing: Routing) -> None:
        """Report the tokens routed to each expert (`routing` saw every chunk of X)."""
        self.result.expert_tokens.append(
            ExpertTokens.of(self.prefix, routing.counts, routing.total, self.moe.calibration.min_tokens)
        )

    def starved(self, routing: Routing, j: int) -> str | None:
        """Why expert j falls back to RTN (routed mode, too few tokens), or None."""
        cal = self.moe.calibration
        n = routing.tokens(j, cal.mode)
        if cal.mode == "routed" and n < max(cal.min_tokens, 1):
            return (
                f"routed {n} calibration tokens, fewer than --moe-min-tokens {cal.min_tokens} "
                "(--moe-calibration routed)"
            )
        return None

    def is_target(self, name: str) -> bool:
        return self.full(name) in self.targets

    def module(self, name: str) -> nn.Module:
        return get_submodule(self.layer, name)


def check_solved(name: str, W: torch.Tensor, W_hat: torch.Tensor, weight: Any) -> None:
    """Refuse a linear whose weight W, dequantized result Ŵ or scales hold NaN or Inf (or a
    zero scale), naming it. (RTN maps a NaN group's scale to 1: the scale alone would pass.)"""
    for what, t in (("weight", W), ("dequantized weight", W_hat)):
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise BadInput(f"{name}: its {what} holds {bad} NaN or Inf values (--ignore it to leave it unquantized)")
    for attr in ("scale", "weight_scale", "input_scale"):
        s = getattr(weight, attr, None)
        if isinstance(s, torch.Tensor):
            bad = int((~torch.isfinite(s) | (s == 0)).sum())
            if bad:
                raise BadInput(
                    f"{name}: {bad} of its {s.numel()} {attr} values are NaN, Inf or zero; "
                    "its weights or calibration inputs are not finite (--ignore it to leave it unquantized)"
                )


def record(
    result: PipelineResult, full: str, module: nn.Module, weight: Any, arch: Architecture, stats: LayerStats | None
) -> None:
    """Store a solved linear (`QuantizedWeight` or `Fp8Weight`) in `result`, on the CPU, and
    replace the module's weight by its dequantized value; with a Hessian, record the
    linear's relative output error; a solver's fallback is counted. A NaN, Inf or zero
    scale is an error naming the linear."""
    W = weight_nk(module, arch.conv1d).detach().float()
    W_hat = weight.dequantize(torch.float32).to(W.device)
    check_solved(full, W, W_hat, weight)
    if stats is not None and stats.H is not None:
        result.linear_errors[full] = relative_output_error(W, W_hat, stats.H.to(W.device))
    set_weight_nk(module, W_hat, arch.conv1d)
    result.quantized[full] = weight.to("cpu")
    if weight.info.get("fallback"):
        result.fallbacks.append(Fallback(full, weight.info["fallback"], weight.info.get("reason")))


def with_input_scale(weight: Any, stats: LayerStats | None, scheme: Scheme, name: str) -> Any:
    """A solved INT weight with its static int8 activation scale (act_abs_max / 127 of its
    input) when the scheme's activations are static int8; else as it is."""
    if getattr(scheme, "int8_activations", None) != "static":
        return weight
    if stats is None:
        raise ValueError(f"{name}: static int8 activations need calibration statistics")
    weight.input_scale = int8_input_scale(stats.act_abs_max)
    return weight


def measure_groups(
    ctx: LayerContext, hessian: bool = False, only: Collection[str] | None = None
) -> dict[str, LayerStats]:
    """{first linear of each group: the statistics of the group's input} over every chunk, in
    one pass of the layer as it is (its outputs are discarded). With `only` (first linears of
    groups), those groups alone, each chunk's pass ending once all of them have read it."""
    heads = group_modules(ctx.layer, ctx.arch)
    if only is not None:
        heads = {k: heads[k] for k in only}
    accs = {k: StatsAccumulator(weight_nk(m, ctx.arch.conv1d).shape[1], hessian=hessian) for k, m in heads.items()}
    with capturing_inputs(heads, accs=accs):
        if only is None:
            run_layer(ctx.layer, ctx.X, ctx.calls)
        elif heads:
            run_until_all(ctx.layer, ctx.X, ctx.calls, list(heads.values()))
    return {k: a.result() for k, a in accs.items()}


def record_rtn_fallback(
    ctx: LayerContext, name: str, scheme: Scheme, reason: str, stats: LayerStats | None = None
) -> None:
    """RTN-quantize linear `name` of the layer (`ctx.rtn`, or the scheme's INT RTN) and record
    it as a fallback (`reason`); `stats` give a static int8 activation scale its input's max |x|."""
    module = ctx.module(name)
    W = weight_nk(module, ctx.arch.conv1d).detach().float()
    weight = ctx.rtn(W, ctx.full(name)) if ctx.rtn is not None else quantize_rtn(W, None, scheme)
    weight = with_input_scale(weight, stats, scheme, ctx.full(name))
    weight.info.update(fallback="rtn", reason=reason)
    record(ctx.result, ctx.full(name), module, weight, ctx.arch, None)


class LayerQuantizer(Generic[S]):
    """One method's driver over a decoder layer, for schemes of type S (registered with
    `calib/quantizers.register_quantizer`). Subclasses declare `needs`, and implement
    `solve` or override `quantize_layer`."""

    def needs(self, scheme: S) -> Needs:
        return Needs()

    def stats_refusal(self, scheme: S) -> str | None:
        """Why `quantize --stats` cannot run this scheme, or None when it can."""
        return None

    def prepare_stats(
        self,
        layer: nn.Module,
        prefix: str,
        arch: Architecture,
        stats: dict[str, LayerStats],
        *,
        targets: set[str],
        result: PipelineResult,
        scheme: S,
    ) -> dict[str, LayerStats]:
        """From saved statistics (`quantize --stats`), before layer `prefix`'s linears are solved:
        `stats` {linear name in the layer: its statistics} -> the statistics to solve with. A
        method that changes the layer first (SmoothQuant's fold) returns those of the changed
        inputs; the default changes nothing."""
        return stats

    def notes(self, result: PipelineResult, scheme: S) -> list[str]:
        """Notes for the report about what was written (e.g. shapes a runtime refuses)."""
        return []

    def solve(self, W: torch.Tensor, stats: LayerStats | None, scheme: S, name: str) -> Any:
        """Quantize one linear's weight W (N, K); `name` is its full name (for messages)."""
        raise NotImplementedError

    def shares_fused(self, scheme: S) -> bool:
        """True when the shards vLLM fuses into one linear (q/k/v, gate/up) share a parameter
        (NVFP4's global scale): `fused_share` computes it."""
        return False

    def fused_share(self, weights: list[torch.Tensor], scheme: S) -> Any:
        """What the fused shards `weights` (each (N_i, K)) share when solved without data, or None."""
        return None

    def solve_data_free(self, W: torch.Tensor, scheme: S, name: str, shared: Any = None) -> Any:
        """A data-free scheme's weight for W (N, K), with its fused group's `fused_share`: the
        tensors the layer pipeline writes for it (`quantize --model-free`)."""
        return self.solve(W, None, scheme, name)

    def quantize_linear(
        self,
        result: PipelineResult,
        full: str,
        module: nn.Module,
        arch: Architecture,
        stats: LayerStats | None,
        scheme: S,
    ) -> None:
        """Solve one linear and record it."""
        weight = self.solve(weight_nk(module, arch.conv1d).detach(), stats, scheme, full)
        record(result, full, module, weight, arch, stats)

    def quantize_weights(self, ctx: LayerContext, scheme: S) -> None:
        """Every target linear alone (each expert's too), without statistics: all a data-free
        method does to a layer (`Needs.data_free`); reads neither `ctx.X` nor `ctx.calls`."""
        for n in ctx.linears:
            if ctx.is_target(n):
                self.quantize_linear(ctx.result, ctx.full(n), ctx.module(n), ctx.arch, None, scheme)

    def quantize_layer(self, ctx: LayerContext, scheme: S) -> LayerOutputs:
        """`quantize_weights` between the fp and the quantized runs. Returns (Y on the error
        chunks, Ŷ); the routed tokens are counted on Ŷ's run."""
        e = ctx.error_chunks
        Y = run_layer(ctx.layer, ctx.X[:e], ctx.calls[:e])  # fp outputs, for the error only
        self.quantize_weights(ctx, scheme)
        return LayerOutputs(Y, run_counting(ctx))


def run_counting(ctx: LayerContext) -> list[torch.Tensor]:
    """The layer's outputs on every chunk; in an MoE layer, the routed tokens are counted."""
    if ctx.moe is None:
        return run_layer(ctx.layer, ctx.X, ctx.calls)
    with capturing_routing(ctx.moe) as routing:
        Y = run_layer(ctx.layer, ctx.X, ctx.calls)
    ctx.count_tokens(routing)
    return Y
