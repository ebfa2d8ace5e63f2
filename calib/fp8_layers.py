"""FP8 in the layer-by-layer calibration pipeline (`calib/pipeline.py` dispatches here).

FP8 needs no Hessian-based error feedback: each linear is quantized on its own (RTN-like).
Statistics are measured only when the scheme needs them, on the decoder layer's inputs
(which went through the already-quantized earlier layers):
- static activations: `act_abs_max` of each linear's input -> `input_scale`;
- clip search: the layer Hessian H of each linear group -> `search_fp8_clip`.
Within a layer, the statistics are taken in one fp pass (not true-sequential: o_proj's
inputs come from the unquantized q/k/v), which is what llm-compressor's FP8 presets do.

KV cache (`kv_cache="fp8"`): once a layer's linears are FP8, the layer is run once more
on its calibration inputs with the attention's cache recorded (`calib/kv_scales.py`), so
the per-layer post-RoPE key / value amax is measured on the device, layer by layer, on
the activations the deployed FP8 model produces (one extra layer pass; no full-model pass).

This module knows nothing about file formats; writing is `packers/checkpoint.py`'s.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from infer_tool.calib.kv_scales import KvAmax, recording_kv
from infer_tool.calib.stats import LayerStats, StatsAccumulator, relative_output_error
from infer_tool.common.progress import Progress
from infer_tool.packers.architectures import Architecture, get_submodule
from infer_tool.packers.fp8 import (
    Fp8Scheme,
    Fp8Weight,
    check_finite,
    quantize_fp8_weight,
    search_fp8_clip,
    static_input_scale,
)


def _move(w: Fp8Weight, device: torch.device | str) -> Fp8Weight:
    w.weight = w.weight.to(device)
    w.weight_scale = w.weight_scale.to(device)
    w.input_scale = None if w.input_scale is None else w.input_scale.to(device)
    w.clip_ratio = None if w.clip_ratio is None else w.clip_ratio.to(device)
    return w


def quantize_linear_fp8(
    result: Any, full: str, module: nn.Module, arch: Architecture, stats: LayerStats | None, scheme: Fp8Scheme
) -> Fp8Weight:
    """Quantize one linear, store it in `result.quantized`, replace its weight by the
    dequantized FP8 value and record its relative output error (when H is known)."""
    from infer_tool.calib.pipeline import set_weight_nk, weight_nk

    W = weight_nk(module, arch.conv1d).detach()  # (N, K)
    check_finite(W, f"{full}.weight")
    clip = None
    if scheme.clip_search:
        if stats is None or stats.H is None:
            raise ValueError(f"{full}: the FP8 clip search needs the layer Hessian")
        search = search_fp8_clip(W, stats.H.to(W.device), scheme, name=f"{full}.weight")
        clip = search.ratios
    input_scale = None
    if scheme.activations == "static":
        if stats is None:
            raise ValueError(f"{full}: static FP8 activations need calibration statistics")
        input_scale = static_input_scale(stats.act_abs_max)
    fw = quantize_fp8_weight(W, scheme, name=f"{full}.weight", clip=clip, input_scale=input_scale)
    W_hat = fw.dequantize(torch.float32)
    if stats is not None and stats.H is not None:
        result.linear_errors[full] = relative_output_error(W.float(), W_hat, stats.H.to(W.device))
    if clip is not None:
        fw.info["clip_ratio_min"] = float(clip.min())
        fw.info["clip_ratio_mean"] = float(clip.mean())
        fw.info["clip_loss_ratio"] = search.loss_chosen / max(search.loss_unclipped, 1e-30)
    set_weight_nk(module, W_hat, arch.conv1d)
    result.quantized[full] = _move(fw, "cpu")
    return fw


@torch.no_grad()
def fp8_layer(
    layer: nn.Module,
    prefix: str,
    X: list[torch.Tensor],
    calls: list[Any],
    arch: Architecture,
    targets: set[str],
    scheme: Fp8Scheme,
    result: Any,
) -> None:
    """Quantize the target linears of one decoder layer (`prefix`, e.g. model.layers.3)."""
    from infer_tool.calib.pipeline import _capture_inputs, run_layer, weight_nk

    groups = [g for g in arch.groups if any(f"{prefix}.{n}" in targets for n in g)]
    stats: dict[str, LayerStats] = {}
    if groups and (scheme.needs_activation_stats or scheme.needs_hessian):
        heads = {g[0]: get_submodule(layer, g[0]) for g in groups}
        accs = {k: StatsAccumulator(weight_nk(m, arch.conv1d).shape[1], hessian=scheme.needs_hessian) for k, m in heads.items()}
        with _capture_inputs(heads, accs=accs):
            run_layer(layer, X, calls)
        for g in groups:
            st = accs[g[0]].result()
            for n in g:
                stats[n] = result.stats[f"{prefix}.{n}"] = st
    for g in groups:
        for n in g:
            full = f"{prefix}.{n}"
            if full in targets:
                quantize_linear_fp8(result, full, get_submodule(layer, n), arch, stats.get(n), scheme)
    if scheme.kv_cache == "fp8":
        with recording_kv(layer, f"{prefix}.") as kv:
            run_layer(layer, X, calls)
        result.kv_amax.update(kv)


def quantize_model_fp8(
    model: nn.Module,
    input_ids: torch.Tensor,
    scheme: Fp8Scheme,
    *,
    ignore: tuple[str, ...] = (),
    device: str | torch.device | None = None,
    progress: Progress | None = None,
    **pipeline_options: Any,
) -> tuple[Any, dict[str, KvAmax]]:
    """Quantize `model`'s decoder linears to FP8 in place (weights become their dequantized
    values) on calibration tokens `input_ids` `(B, T)`.

    Returns (the pipeline's PipelineResult with `Fp8Weight`s in `.quantized`, {attention
    module name: KvAmax}, empty unless `scheme.kv_cache == "fp8"`).
    """
    from infer_tool.calib.pipeline import quantize_model

    result = quantize_model(model, input_ids, scheme, ignore=ignore, device=device, progress=progress, **pipeline_options)  # type: ignore[arg-type]
    return result, dict(result.kv_amax)
