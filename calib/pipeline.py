"""The layer-by-layer calibration pipeline: plan, capture the first layer's inputs, then
for each decoder layer measure / solve / propagate, and the entry points.

1. Plan (`plan`): the model against the architecture table and the scheme's shape
   constraints, before any work.
2. Capture (`layers.capture_inputs`): the calibration batch through the embeddings only;
   every layer's call arguments are recorded.
3. For each decoder layer (`LayerLoop.run`), on the device: the layer quantizer registered
   for the scheme's type (`calib/quantizers/`) measures what it needs, solves, replaces
   the weights by their dequantized values, and returns the fp outputs Y on the first
   ERROR_SAMPLES sequences and the quantized layer's outputs Ŷ on all of them: Ŷ is the
   next layer's input, and ‖Ŷ − Y‖/‖Y‖ is the layer's reported error. Quantizers that
   read no activations (`Needs.data_free`) get only those sequences, or none at all when
   no layer error is asked for (`quantize --no-layer-error`). A quantizer that
   trains toward the fp model (`Needs.fp_chain`) also gets the fp layer's outputs on the
   fp model's own activations (the fp chain, carried beside Ŷ from layer to layer), and
   with `Needs.fp_inputs` every linear group's inputs in that fp pass.
4. `collect_stats` runs the same loop without quantizing (for `calibrate --out`): every
   layer's statistics are then measured on fp inputs. `quantize_from_stats` quantizes
   from saved statistics with no forward pass at all (`LayerLoop.run_without_data`).
   Neither covers MoE models yet.

Mixture-of-experts models: `plan` turns each MoE block's fused experts into one linear per
expert (`calib/moe.py`); each MoE layer's context then holds the attention part of the
table's entry and the MoE block, whose experts the quantizer handles one at a time under
the `MoeCalibration` mode (every expert on every token, or only on its routed tokens).

Where each layer's weights come from and go is the caller's `LayerIO` (`calib/layer_io.py`):
by default the whole model stays on the CPU and each layer visits the device; the quantize
job streams them from disk. Peak memory: the model's weights (or one layer, streamed), and
the calibration activations X, Y (B, T, D) on the device; GPTQ also keeps the current
layer's attention and MLP outputs (B, T, D) and, while down_proj is solved, its input (B, T, I).

Under `accelerate launch` / `torchrun`, each process runs its own contiguous chunks of the
calibration samples through every layer, and the statistics are reduced so that every
process, and the checkpoint, get the one-process bits (`calib/distributed.py`).

This module knows no quantization method by name, nothing about file formats or the CLI.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from infer_tool.calib.architectures import Architecture, architecture_for, check_model, get_submodule
from infer_tool.calib.distributed import Shard, fail_for_test, gather_counts, plan_shard, sharding
from infer_tool.calib.layer_io import LayerIO
from infer_tool.calib.layers import (
    LayerCall,
    capture_inputs,
    capturing_inputs,
    decoder_layers,
    group_modules,
    linear_shapes,
    matches,
    relative_error,
    run_layer,
    weight_nk,
)
from infer_tool.calib.moe import MoeCalibration, moe_layer, unfuse_experts
from infer_tool.calib.quantizers import quantizer_for
from infer_tool.calib.quantizers.base import LayerContext, LayerOutputs, LayerQuantizer
from infer_tool.calib.result import LayerError, PipelineResult
from infer_tool.calib.spill import chunk_store
from infer_tool.calib.stats import LayerStats, StatsAccumulator
from infer_tool.common.errors import BadInput
from infer_tool.common.progress import Progress, no_progress
from infer_tool.schemes.base import Scheme

# How the pipeline runs (not algorithm defaults: those live in the schemes, `schemes/`).
BATCH_SIZE = 16  # sequences per layer forward on an accelerator
CPU_BATCH_TOKENS = 2048  # tokens per layer forward on a CPU: the activations stay in cache
AWQ_SEARCH_SAMPLES = 16  # sequences the searches (AWQ's scale/clip) run on
ERROR_SAMPLES = 16  # sequences the reported per-layer output error is measured on

LayerStep = Callable[[LayerContext], LayerOutputs]
Captured = tuple[list[torch.Tensor], list[list[LayerCall]]]  # (X, calls): the first layer's inputs, every layer's calls


class Plan(NamedTuple):
    arch: Architecture
    names: list[str]  # the linears to quantize


def plan(model: nn.Module, scheme: Scheme | None, ignore: tuple[str, ...] = ()) -> Plan:
    """Check the model against the table and the scheme's shape constraints (the group size
    against every K), before any work; MoE experts become one linear each
    (`unfuse_experts`, idempotent)."""
    arch = architecture_for(getattr(model.config, "model_type", "?"), model.config)
    check_model(model, arch)
    unfuse_experts(model, arch)
    shapes = linear_shapes(model, arch)
    names = [n for n in shapes if not matches(n, ignore)]
    if scheme is not None:
        scheme.check_shapes({n: shapes[n] for n in names})
    return Plan(arch, names)


def _device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _batch_size(batch_size: int | None, dev: torch.device, seq_len: int) -> int:
    """Sequences per layer forward: BATCH_SIZE, or CPU_BATCH_TOKENS' worth on a CPU."""
    if batch_size is not None:
        return batch_size
    return max(1, CPU_BATCH_TOKENS // seq_len) if dev.type == "cpu" else BATCH_SIZE


def chunk_count(samples: int, batch_size: int) -> int:
    """Chunks of `batch_size` sequences that hold `samples` sequences (at least one)."""
    return max(1, -(-samples // batch_size))


@contextlib.contextmanager
def flushed_denormals() -> Iterator[None]:
    """Subnormal floats flushed to zero while active: tiny activations times tiny weights
    would otherwise take the CPU's slow subnormal path in every matmul."""
    flush = torch.set_flush_denormal(True)
    try:
        yield
    finally:
        if flush:
            torch.set_flush_denormal(False)


@dataclass
class LayerLoop:
    """One pass over the decoder layers, and what every layer's `LayerContext` shares.

    Each layer is brought in by `io`, handled, and handed back to `io`; `progress` hears
    `task` after each. `targets`, `error_chunks` / `search_chunks` (this process's share),
    `moe` and `spill` go into each layer's context as they are. With `fp_chain`, the fp
    model's activations are carried too: `io` sees the inputs as the quantized chain's
    chunks followed by the fp chain's (2C chunks), and saves and restores them as they are.
    """

    model: nn.Module
    arch: Architecture
    result: PipelineResult
    device: torch.device
    task: str
    _: KW_ONLY
    targets: set[str] = field(default_factory=set)
    error_chunks: int = 0
    search_chunks: int = 0
    moe: MoeCalibration = MoeCalibration()
    spill: Path | None = None
    io: LayerIO = field(default_factory=LayerIO)
    progress: Progress = no_progress
    fp_chain: bool = False
    fp_inputs: bool = False

    def capture(self, ids: torch.Tensor, batch_size: int, shard: Shard, t0: float) -> Captured:
        """This process's chunks through the embeddings; the samples each process runs, and the
        seconds since t0, go in `result`. Pass the pair straight to `run`: a name kept for it
        would hold the first layer's inputs through the whole loop."""
        mine = ids[shard.first * batch_size : shard.stop * batch_size]
        self.result.samples_per_process = gather_counts(int(mine.shape[0]))
        captured = capture_inputs(self.model, self.arch, mine, batch_size, self.device)
        self.result.seconds["capture"] = time.perf_counter() - t0
        return captured

    def context(
        self,
        layer: nn.Module,
        prefix: str,
        X: list[torch.Tensor],
        calls: list[LayerCall],
        Y_fp: list[torch.Tensor] | None = None,
        fp_inputs: dict[str, Any] | None = None,
    ) -> LayerContext:
        """Layer `prefix`'s context: the table's entry as it applies to it, and its MoE block."""
        return LayerContext(
            layer,
            prefix,
            X,
            calls,
            arch=self.arch.for_layer(layer),
            targets=self.targets,
            result=self.result,
            error_chunks=self.error_chunks,
            search_chunks=self.search_chunks,
            moe=moe_layer(layer, self.arch, self.moe),
            spill=self.spill,
            Y_fp=Y_fp,
            fp_inputs=fp_inputs,
        )

    def run(self, captured: Captured, step: LayerStep) -> None:
        """Every layer through `step`, which gives (Y, Ŷ); Ŷ feeds the next layer and ‖Ŷ − Y‖/‖Y‖
        is the layer's reported error. The first layer's inputs are freed once the second's exist.
        With `fp_chain`, the fp layer runs on the fp chain first (the layer is still fp then);
        its outputs are the context's `Y_fp` and the next layer's fp chain."""
        X, calls = captured
        del captured
        layers = decoder_layers(self.model, self.arch)
        t_layers = time.perf_counter()
        carried = X + X if self.fp_chain else X  # at the first layer both chains are the captured inputs
        del X
        start, carried = self.io.start(carried, len(layers), self.result)
        for i in range(start, len(layers)):
            layer, prefix = self._load(layers, i)
            X, X_fp = (carried[: len(carried) // 2], carried[len(carried) // 2 :]) if self.fp_chain else (carried, None)
            del carried
            Y_fp, fp_inputs = self._fp_layer(layer, X_fp, calls[i])
            del X_fp
            Y, Y_hat = step(self.context(layer, prefix, X, calls[i], Y_fp, fp_inputs))
            del fp_inputs
            del X
            fail_for_test(i)
            err = relative_error(Y_hat[: len(Y)], Y)
            if not math.isfinite(err):
                _refuse_non_finite(prefix, Y, Y_hat)
            self.result.layer_errors.append(LayerError(prefix, err))
            del Y
            carried = Y_hat + Y_fp if Y_fp is not None else Y_hat
            del Y_hat, Y_fp
            self.io.done(i, layer, carried, self.result)
            self.progress(self.task, i + 1, len(layers), rel_err=err)
        self.result.seconds["layers"] = time.perf_counter() - t_layers

    def _fp_layer(
        self, layer: nn.Module, X_fp: list[torch.Tensor] | None, calls: list[LayerCall]
    ) -> tuple[list[torch.Tensor] | None, dict[str, Any] | None]:
        """The fp layer on the fp chain: its outputs, and with `fp_inputs` every linear
        group's inputs, kept per chunk (in files under `spill` on a CPU run)."""
        if X_fp is None:
            return None, None
        if not self.fp_inputs:
            return run_layer(layer, X_fp, calls), None
        heads = group_modules(layer, self.arch.for_layer(layer))
        keep = {k: chunk_store(self.spill, X_fp[0].device) for k in heads}
        with capturing_inputs(heads, keep=keep, keep_chunks=len(X_fp)):
            Y_fp = run_layer(layer, X_fp, calls)
        return Y_fp, keep

    def run_without_data(self, step: Callable[[nn.Module, str], None]) -> None:
        """Every layer through `step(layer, prefix)`, with no activations at all."""
        layers = decoder_layers(self.model, self.arch)
        start, _ = self.io.start([], len(layers), self.result)
        for i in range(start, len(layers)):
            layer, prefix = self._load(layers, i)
            step(layer, prefix)
            self.io.done(i, layer, [], self.result)
            self.progress(self.task, i + 1, len(layers))

    def _load(self, layers: nn.ModuleList, i: int) -> tuple[nn.Module, str]:
        self.io.load(i, layers[i], self.device)
        return layers[i], f"{self.arch.layers}.{i}"


def _refuse_non_finite(prefix: str, Y: list[torch.Tensor], Y_hat: list[torch.Tensor]) -> None:
    """BadInput naming the first layer whose outputs on the calibration text are NaN or
    infinite: the fp layer's (the model overflows) or only the quantized layer's."""
    fp_bad = any(not bool(torch.isfinite(y).all()) for y in Y)
    which = "fp" if fp_bad else "quantized"
    why = "the model's weights or activations overflow" if fp_bad else "its quantized weights make it overflow"
    raise BadInput(
        f"{prefix}: the {which} layer's outputs on the calibration text are NaN or infinite ({why}); nothing past "
        "it can be calibrated"
    )


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    input_ids: torch.Tensor | None,
    scheme: Scheme,
    *,
    ignore: tuple[str, ...] = (),
    device: str | torch.device | None = None,
    batch_size: int | None = None,
    search_samples: int = AWQ_SEARCH_SAMPLES,
    moe: MoeCalibration = MoeCalibration(),
    progress: Progress | None = None,
    layer_io: LayerIO | None = None,
    spill: Path | None = None,
) -> PipelineResult:
    """Quantize `model`'s decoder linears in place (their weights become the dequantized
    values, AWQ scales folded) layer by layer on `input_ids` (B, T) calibration tokens;
    None: a data-free method with no forward pass at all, and no layer errors reported.

    Returns the per-linear weights (`QuantizedWeight` / `Fp8Weight`), statistics (not the
    experts'), per-layer relative output errors, fallbacks, per-expert routed token counts,
    the method's report entries and timings.
    batch_size: sequences per layer forward; None: BATCH_SIZE, or CPU_BATCH_TOKENS' worth on a CPU.
    layer_io: where the layers come from and go (`calib/layer_io.py`); default: all in memory.
    moe: how MoE experts are calibrated (every expert on every token, or routed only).
    spill: a directory where a quantizer keeps the activations it only reads back in order
        (GPTQ's replayed outputs), on a CPU run; None: in memory.
    """
    dev = _device(device)
    quantizer = quantizer_for(scheme)
    if input_ids is None:
        return _quantize_data_free(
            model, scheme, quantizer, ignore=ignore, dev=dev, moe=moe, progress=progress, layer_io=layer_io
        )
    bs = _batch_size(batch_size, dev, input_ids.shape[1])
    with flushed_denormals():
        t0 = time.perf_counter()
        arch, names = plan(model, scheme, ignore)
        needs = quantizer.needs(scheme)
        if needs.fp_inputs and arch.moe is not None:
            raise BadInput("--gptaq does not cover mixture-of-experts models yet: their experts see routed rows")
        result = PipelineResult(ignored=sorted(set(linear_shapes(model, arch)) - set(names)))
        model.eval()
        search_chunks, error_chunks = chunk_count(search_samples, bs), chunk_count(ERROR_SAMPLES, bs)
        ids = input_ids[: error_chunks * bs] if needs.data_free else input_ids
        result.tokens = int(ids.numel())
        shard = plan_shard(int(ids.shape[0]), bs, not needs.data_free, search_chunks if needs.live_blocks else 0)
        loop = LayerLoop(
            model,
            arch,
            result,
            dev,
            "quantize",
            targets=set(names),
            error_chunks=shard.local(error_chunks),
            search_chunks=shard.local(search_chunks),
            moe=moe,
            spill=spill,
            io=layer_io or LayerIO(),
            progress=progress or no_progress,
            fp_chain=needs.fp_chain or needs.fp_inputs,
            fp_inputs=needs.fp_inputs,
        )
        with sharding(shard):
            loop.run(loop.capture(ids, bs, shard, t0), lambda ctx: quantizer.quantize_layer(ctx, scheme))
        result.seconds["total"] = time.perf_counter() - t0
    return result


def _quantize_data_free(
    model: nn.Module,
    scheme: Scheme,
    quantizer: LayerQuantizer,
    *,
    ignore: tuple[str, ...],
    dev: torch.device,
    moe: MoeCalibration,
    progress: Progress | None,
    layer_io: LayerIO | None,
) -> PipelineResult:
    """`quantize_model` with no calibration tokens: every layer's `quantize_weights` alone,
    the same weights a run with tokens gives (those only measure the layer errors)."""
    if not quantizer.needs(scheme).data_free:
        raise BadInput(f"{scheme.describe()} reads calibration activations: it needs calibration tokens")
    t0 = time.perf_counter()
    arch, names = plan(model, scheme, ignore)
    result = PipelineResult(ignored=sorted(set(linear_shapes(model, arch)) - set(names)))
    loop = LayerLoop(
        model,
        arch,
        result,
        dev,
        "quantize",
        targets=set(names),
        moe=moe,
        io=layer_io or LayerIO(),
        progress=progress or no_progress,
    )
    loop.run_without_data(lambda layer, prefix: quantizer.quantize_weights(loop.context(layer, prefix, [], []), scheme))
    result.seconds["layers"] = result.seconds["total"] = time.perf_counter() - t0
    return result


def _measure_stats(ctx: LayerContext) -> LayerOutputs:
    """Every linear group's statistics (with Hessians) on the layer's fp inputs; Ŷ = Y."""
    heads = group_modules(ctx.layer, ctx.arch)
    accs = {k: StatsAccumulator(weight_nk(m, ctx.arch.conv1d).shape[1], hessian=True) for k, m in heads.items()}
    with capturing_inputs(heads, accs=accs):
        Y = run_layer(ctx.layer, ctx.X, ctx.calls)
    for group in ctx.arch.groups:
        st = accs[group[0]].result()
        for n in group:
            ctx.result.stats[ctx.full(n)] = st
    return LayerOutputs(Y, Y)


@torch.no_grad()
def collect_stats(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    device: str | torch.device | None = None,
    batch_size: int | None = None,
    progress: Progress | None = None,
    layer_io: LayerIO | None = None,
) -> PipelineResult:
    """Measure every decoder linear's statistics (Hessian, mean and max |x|) on the fp model,
    layer by layer on `input_ids` (B, T), quantizing nothing (`calibrate`)."""
    dev = _device(device)
    bs = _batch_size(batch_size, dev, input_ids.shape[1])
    with flushed_denormals():
        t0 = time.perf_counter()
        arch, _ = plan(model, None)
        _refuse_moe(arch, "calibrate")
        result = PipelineResult(tokens=int(input_ids.numel()))
        model.eval()
        shard = plan_shard(int(input_ids.shape[0]), bs, True, 0)
        every_chunk = shard.local(chunk_count(int(input_ids.shape[0]), bs))
        loop = LayerLoop(
            model,
            arch,
            result,
            dev,
            "calibrate",
            error_chunks=every_chunk,
            io=layer_io or LayerIO(),
            progress=progress or no_progress,
        )
        with sharding(shard):
            loop.run(loop.capture(input_ids, bs, shard, t0), _measure_stats)
        result.seconds["total"] = time.perf_counter() - t0
    return result


def _refuse_moe(arch: Architecture, what: str) -> None:
    if arch.moe is not None:
        raise BadInput(f"{what} does not cover mixture-of-experts models yet: quantize them live (without --stats)")


@torch.no_grad()
def quantize_from_stats(
    model: nn.Module,
    stats: dict[str, LayerStats],
    scheme: Scheme,
    *,
    ignore: tuple[str, ...] = (),
    device: str | torch.device | None = None,
    progress: Progress | None = None,
    layer_io: LayerIO | None = None,
) -> PipelineResult:
    """Quantize with saved statistics (`quantize --stats`): no forward pass at all.

    Every Hessian was measured on the fp model, so GPTQ no longer sees the quantization
    error of earlier layers and earlier groups (true-sequential is lost); methods that need
    live activations (AWQ's block outputs, the KV-cache pass) are refused."""
    quantizer = quantizer_for(scheme)
    refusal = quantizer.stats_refusal(scheme)
    if refusal:
        raise BadInput(refusal)
    dev = _device(device)
    t0 = time.perf_counter()
    arch, names = plan(model, scheme, ignore)
    _refuse_moe(arch, "--stats")
    missing = [n for n in names if n not in stats]
    if missing:
        raise BadInput(
            f"the statistics lack {len(missing)} layers (first: {missing[0]}); they were made for another model"
        )
    result = PipelineResult(ignored=sorted(set(linear_shapes(model, arch)) - set(names)))
    result.tokens = max((s.tokens for s in stats.values()), default=0)
    loop = LayerLoop(
        model,
        arch,
        result,
        dev,
        "quantize",
        targets=set(names),
        io=layer_io or LayerIO(),
        progress=progress or no_progress,
    )

    def solve(layer: nn.Module, prefix: str) -> None:
        mine = {n: stats[f"{prefix}.{n}"] for n in arch.linears if f"{prefix}.{n}" in stats}
        mine = quantizer.prepare_stats(layer, prefix, arch, mine, targets=loop.targets, result=result, scheme=scheme)
        for n in arch.linears:
            full = f"{prefix}.{n}"
            if full in loop.targets:
                st = mine[n]
                result.stats[full] = st
                if st.H is not None:
                    st = replace(st, H=st.H.to(dev), act_abs_mean=st.act_abs_mean.to(dev))
                quantizer.quantize_linear(result, full, get_submodule(layer, n), arch, st, scheme)

    loop.run_without_data(solve)
    result.seconds["layers"] = result.seconds["total"] = time.perf_counter() - t0
    return result
