"""MXFP8 in the layer pipeline: RTN (every linear alone, no statistics: MXFP8's activation
scales are dynamic), GPTQ (the INT quantizer's true-sequential driver, `calib/quantizers/
gptq.py`, with this format's solver; what falls back rounds with MXFP8 RTN) and AutoRound (the
INT quantizer's descent, `calib/quantizers/autoround.py`, on this format's grid)."""

from __future__ import annotations

from typing import Any

import torch

from infer_tool.calib.layers import weight_nk
from infer_tool.calib.quantizers import register_quantizer
from infer_tool.calib.quantizers.autoround import AutoRoundQuantizer
from infer_tool.calib.quantizers.base import LayerContext, LayerOutputs, LayerQuantizer, Needs
from infer_tool.calib.quantizers.gptq import GPTQQuantizer
from infer_tool.calib.result import PipelineResult
from infer_tool.calib.stats import LayerStats
from infer_tool.formats.mxfp8.autoround import Mxfp8Grouped, fake_quantize_rounding, quantize_rounding
from infer_tool.formats.mxfp8.scheme import Mxfp8AutoRoundScheme, Mxfp8GPTQScheme, Mxfp8Scheme
from infer_tool.formats.mxfp8.solve import quantize_gptq, quantize_rtn
from infer_tool.formats.mxfp8.weight import Mxfp8Weight
from infer_tool.packers.autoround import Rounding

SERVED = (
    "{preset} (mxfp8-quantized): vLLM 0.32 serves it on NVIDIA GPUs from sm75 (its W8A8 MXFP8 scheme: "
    "FlashInfer / Marlin kernels, or a bfloat16 emulation that dequantizes the weights at load) and its CPU "
    "build has no MXFP8 kernel; transformers + compressed-tensors 0.20 read it"
)


@register_quantizer(Mxfp8Scheme)
class Mxfp8RTNQuantizer(LayerQuantizer[Mxfp8Scheme]):
    def solve(self, W: torch.Tensor, stats: LayerStats | None, scheme: Mxfp8Scheme, name: str) -> Mxfp8Weight:
        return quantize_rtn(W, stats, scheme)

    def notes(self, result: PipelineResult, scheme: Mxfp8Scheme) -> list[str]:
        return [SERVED.format(preset=scheme.preset)]


@register_quantizer(Mxfp8GPTQScheme)
class Mxfp8GPTQQuantizer(GPTQQuantizer):
    """GPTQ's driver on the MXFP8 grid: no SmoothQuant, GPTAQ or int8 input scales (INT's options)."""

    def needs(self, scheme: Any) -> Needs:
        return Needs(hessian=True)

    def stats_refusal(self, scheme: Any) -> str | None:
        return None

    def smoothing(self, scheme: Any) -> float | None:
        return None

    def static_int8(self, scheme: Any) -> bool:
        return False

    def solve(
        self, W: torch.Tensor, stats: LayerStats | None, scheme: Any, name: str, parts: list[int] | None = None
    ) -> Mxfp8Weight:
        return quantize_gptq(W, stats, scheme, parts=parts)

    def quantize_layer(self, ctx: LayerContext, scheme: Any) -> LayerOutputs:
        ctx.rtn = lambda W, name: quantize_rtn(W, None, scheme)  # starved experts fall back to MXFP8 RTN
        return super().quantize_layer(ctx, scheme)

    def notes(self, result: PipelineResult, scheme: Any) -> list[str]:
        return [SERVED.format(preset=scheme.preset)]


@register_quantizer(Mxfp8AutoRoundScheme)
class Mxfp8AutoRoundQuantizer(AutoRoundQuantizer):
    """AutoRound's descent on the MXFP8 grid (`formats/mxfp8/autoround.py`); MXFP8 activations are
    dynamic, so the output pass measures nothing more."""

    def grouped(self, ctx: LayerContext, n: str, scheme: Any) -> Mxfp8Grouped:
        return Mxfp8Grouped.of(weight_nk(ctx.module(n), ctx.arch.conv1d))

    def fake(self, W: Mxfp8Grouped, p: Rounding, scheme: Any) -> torch.Tensor:
        return fake_quantize_rounding(W, p, scheme)

    def rounded(self, W: Mxfp8Grouped, p: Rounding, scheme: Any) -> Mxfp8Weight:
        return quantize_rounding(W, p, scheme)

    def notes(self, result: PipelineResult, scheme: Any) -> list[str]:
        return [SERVED.format(preset=scheme.preset), *super().notes(result, scheme)]
