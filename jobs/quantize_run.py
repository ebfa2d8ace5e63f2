"""The quantize job's middle and end: the layer loop with its `LayerStream`, the --eval
scores, and the checkpoint assembled from the finished layers' parts.

1. The tensors outside the decoder layers are loaded (streamed: read from the files) and
   written as the run's first part; the calibration batch and the --eval windows go
   through the embeddings (capture); then those tensors are freed.
2. The pipeline runs layer by layer with `jobs/layer_stream.LayerStream` around each layer.
3. With --eval, the head scores the windows' fp and quantized hidden states.
4. The parts become the checkpoint (`packers/checkpoint.write_from_parts`), renamed into
   place; then the progress directory is removed.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from infer_tool.jobs.layer_stream import EvalStreams, LayerStream, StreamedWeights, ppl_of_streams


def _labelled(progress: Any, label: str) -> Any:
    return lambda task, done, total, **info: progress(label, done, total, **info)


def as_deployed(module: nn.Module, quantized: dict[str, Any], scheme: Any,
                kv_scales: dict[str, tuple[float, float]]) -> AbstractContextManager:
    """Where `--eval` measures ppl after quantizing (names relative to `module`): for FP8,
    as deployed (kernels' Fp8Linear W8A8, FP8 KV cache rounded with the calibrated scales);
    for INT, the module as it is (its weights are exactly the checkpoint's dequantized values)."""
    if scheme.kind == "fp8":
        from infer_tool.evals.fp8_in_memory import fp8_runtime

        return fp8_runtime(module, quantized, kv_scales or None)
    return nullcontext(module)


def kv_scales_of(kv_amax: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """{attention name: (k_scale, v_scale)} from the calibrated KV amax."""
    from infer_tool.packers.fp8 import scale_from_amax

    def s(amax: float) -> float:
        return float(scale_from_amax(torch.tensor(amax)))

    return {n: (s(a.k_amax), s(a.v_amax)) for n, a in kv_amax.items()}


def kv_tensors(kv_amax: dict[str, Any], fmt_name: str) -> dict[str, Any] | None:
    """The k_scale / v_scale tensors to store, or None without a calibrated KV cache."""
    if not kv_amax:
        return None
    from infer_tool.packers.fp8_formats import kv_scale_tensors

    return kv_scale_tensors(kv_amax, fmt_name)


def run_layers(
    lm: nn.Module, arch: Any, loaded: Any, run: Any, opts: Any, scheme: Any, fmt: Any, store_dtype: torch.dtype,
    calib_ids: torch.Tensor | None, eval_ids: torch.Tensor | None, dev: str, progress: Any, seconds: dict[str, float],
    spill: bool = False,
) -> tuple[Any, tuple[Any, Any] | None, dict[str, Any] | None]:
    """Steps 1-3 (module docstring). Returns (the pipeline result, (ppl before, its `CacheUse`,
    ppl after) or None, the saved statistics' metadata with --stats or None). The fp baseline
    comes from the ppl cache when this model, text and window protocol were evaluated before
    (`jobs/baseline.py`); its windows then skip the fp layers. `spill`: GPTQ's replayed
    activations go to a file in the run directory (`jobs/preflight.plan` decides; a process
    without one keeps them in memory)."""
    from infer_tool.calib.layers import capture_inputs, decoder_layers
    from infer_tool.calib.pipeline import quantize_from_stats, quantize_model
    from infer_tool.evals.ppl import make_windows
    from infer_tool.evals.ppl_cache import CacheUse, stored
    from infer_tool.jobs.baseline import from_state, lookup, to_state
    from infer_tool.packers.checkpoint import checkpoint_tensors

    device = torch.device(dev)
    layers = decoder_layers(lm, arch)
    weights = None
    if loaded.stream_plan is not None:
        round_dtype = None if store_dtype == torch.float32 else store_dtype
        weights = StreamedWeights(lm, loaded.files, loaded.stream_plan, round_dtype)
        weights.load(weights.names(None, arch.layers), torch.device("cpu"))  # the capture runs on the CPU, as before

    def part_tensors(prefix: str | None, quantized: dict[str, Any]) -> dict[str, torch.Tensor]:
        if prefix is None:
            return checkpoint_tensors(lm, {}, fmt, dtype=store_dtype, within=lambda n: not n.startswith(f"{arch.layers}."))
        fmt.check(scheme, quantized)
        return checkpoint_tensors(lm, quantized, fmt, dtype=store_dtype, within=lambda n: n.startswith(f"{prefix}."))

    def read_part(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        return fmt.read(tensors, fmt.config(scheme, []))

    def deployed(layer: nn.Module, prefix: str, result: Any) -> AbstractContextManager:
        strip = len(prefix) + 1
        mine = {n[strip:]: w for n, w in result.quantized.items() if n.startswith(f"{prefix}.")}
        kv = {n[strip:]: s for n, s in kv_scales_of(result.kv_amax).items() if n.startswith(f"{prefix}.")}
        return as_deployed(layer, mine, scheme, kv)

    evals = None
    seq_len = 0
    ident, baseline = None, None  # the ppl cache's key; (PplResult, CacheUse) of the fp baseline when known
    baseline_use = CacheUse(False, None)
    if eval_ids is not None:
        context = getattr(lm.config, "max_position_embeddings", None)
        seq_len = min(opts.eval_seq_len, context or opts.eval_seq_len)
        if run.state.get("baseline") is not None:
            baseline = from_state(run.state["baseline"])
        elif run.layers_done == 0:
            t = time.perf_counter()
            ident, cached, use = lookup(lm, weights, arch.layers, eval_ids, seq_len, device, opts.eval)
            seconds["eval_cache_lookup"] = time.perf_counter() - t
            baseline = (cached, use) if cached is not None else None
            if baseline is not None:
                run.remember("baseline", to_state(cached, use))
            elif use.skipped:
                baseline_use = use
        windows = torch.stack([eval_ids[w.begin : w.end] for w in make_windows(eval_ids.numel(), seq_len)])
        X, calls = capture_inputs(lm, arch, windows, 1, device)
        evals = EvalStreams(calls, None if baseline else X, list(X))
    stream = LayerStream(lm, arch.layers, run, part_tensors, read_part, weights, evals, deployed)
    stream.write_rest()
    t = time.perf_counter()
    meta = None
    if opts.stats is not None:
        from infer_tool.calib.stats import load_stats

        saved, meta = load_stats(Path(opts.stats))
        stream.release_rest()  # no capture: the tensors outside the layers are not needed
        result = quantize_from_stats(lm, saved, scheme, ignore=opts.ignore, device=dev, progress=progress, layer_io=stream)
    else:
        from infer_tool.jobs.moe_report import moe_calibration

        result = quantize_model(lm, calib_ids, scheme, ignore=opts.ignore, device=dev, moe=moe_calibration(opts),
                                progress=progress, layer_io=stream,
                                spill=run.path if spill and run.path.is_dir() else None)
    seconds["quantize"] = time.perf_counter() - t
    seconds.update({f"quantize.{k}": v for k, v in result.seconds.items()})
    seconds.update({f"stream.{k}": v for k, v in stream.seconds_spent.items()})
    if evals is None:
        return result, None, meta
    t = time.perf_counter()
    if weights is not None:
        weights.load(weights.names(None, arch.layers), torch.device("cpu"))
    try:
        if baseline is None:
            before = ppl_of_streams(lm, layers, eval_ids, seq_len, evals.fp, device, _labelled(progress, "ppl before"))
            baseline = (before, stored(ident, before) if ident is not None else baseline_use)
        after = ppl_of_streams(lm, layers, eval_ids, seq_len, evals.q, device, _labelled(progress, "ppl after"))
    finally:
        if weights is not None:
            weights.release(weights.names(None, arch.layers))
    seconds["eval"] = time.perf_counter() - t + seconds.get("stream.eval_layers", 0.0)
    return result, (*baseline, after), meta


def write_output(run: Any, lm: nn.Module, quantized: dict[str, Any], fmt: Any, scheme: Any, opts: Any, src_dir: Any,
                 overwrite: bool, store_dtype: torch.dtype, extra_files: dict[str, str],
                 extra_tensors: dict[str, torch.Tensor] | None, rename: Any = None, unquantized: Any = ()) -> None:
    """Step 4: the checkpoint from the run's parts, renamed to --out; the progress removed."""
    from infer_tool.jobs.run_dir import REST
    from infer_tool.packers.checkpoint_parts import write_from_parts
    from infer_tool.packers.shards import parse_size

    parts = [run.file(REST)] + [run.layer_file(i) for i in range(run.state["layers"])]
    write_from_parts(parts, opts.out, lm, quantized, fmt.name, scheme, dtype=store_dtype, tmp=run.file("checkpoint"),
                     src_dir=src_dir, overwrite=overwrite, extra_files=extra_files, extra_tensors=extra_tensors,
                     max_shard_bytes=parse_size(opts.max_shard_size, "--max-shard-size"), rename=rename,
                     unquantized=unquantized)
    run.remove()
