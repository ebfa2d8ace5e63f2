"""AWQ followed by GPTQ, per decoder block: AWQ's scale search on the fp block and the fold
(`AWQQuantizer.search_and_fold`), then GPTQ's true-sequential rounding of the folded block
(`GPTQQuantizer.quantize_layer`). AWQ's clip search does not run: GPTQ chooses the rounding.

The fold leaves the block's function unchanged, so GPTQ measures each group's Hessian on the
folded block's own inputs, which are the smoothed x / s of the weights it rounds (W·diag(s)).
llm-compressor 0.14's AWQ → GPTQ chain accumulates GPTQ's Hessians in the same calibration
pass that feeds AWQ, before the smoothing is applied, so it solves W·diag(s) against the
Hessian of x rather than of x / s (diag(1/s)·H·diag(1/s)).

The same quantizer composes the FP4 steps (`Fp4AWQGPTQScheme`: AWQ scored by the FP4 quantizer,
GPTQ rounding to the E2M1 grid; the global scales of fused shards from the folded weights).

With `--gptaq`, the fp model's inputs the pipeline kept are divided by the same s as the
live ones, so GPTQ pairs the two in the folded layer's basis.

The report keeps AWQ's per-mapping entries ("awq") and GPTQ's per-linear errors. In an MoE
layer the routed tokens are counted once, by GPTQ's pass (the fold does not change routing).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields
from typing import Any

import torch

from infer_tool.calib.quantizers import quantizer_for, register_quantizer
from infer_tool.calib.quantizers.awq import AWQQuantizer
from infer_tool.calib.quantizers.base import LayerContext, LayerOutputs, LayerQuantizer, Needs
from infer_tool.calib.quantizers.gptq import GPTQQuantizer
from infer_tool.calib.result import PipelineResult
from infer_tool.calib.spill import drain
from infer_tool.schemes.fp4 import Fp4AWQGPTQScheme
from infer_tool.schemes.integer import AWQGPTQScheme

AnyAWQGPTQ = AWQGPTQScheme | Fp4AWQGPTQScheme


def _steps(scheme: AnyAWQGPTQ) -> tuple[AWQQuantizer, GPTQQuantizer]:
    """The registered AWQ and GPTQ quantizers of the scheme's number format (the two steps)."""
    return quantizer_for(scheme.awq()), quantizer_for(scheme.gptq())  # type: ignore[return-value]


@register_quantizer(Fp4AWQGPTQScheme)
@register_quantizer(AWQGPTQScheme)
class AWQGPTQQuantizer(LayerQuantizer[AnyAWQGPTQ]):
    def needs(self, scheme: AnyAWQGPTQ) -> Needs:
        awq, gptq = _steps(scheme)
        a, g = awq.needs(scheme.awq()), gptq.needs(scheme.gptq())
        return Needs(**{f.name: getattr(a, f.name) or getattr(g, f.name) for f in fields(Needs)})

    def stats_refusal(self, scheme: AnyAWQGPTQ) -> str | None:
        return _steps(scheme)[0].stats_refusal(scheme.awq())

    def notes(self, result: PipelineResult, scheme: AnyAWQGPTQ) -> list[str]:
        awq, gptq = _steps(scheme)
        return list(dict.fromkeys(awq.notes(result, scheme.awq()) + gptq.notes(result, scheme.gptq())))

    def quantize_layer(self, ctx: LayerContext, scheme: AnyAWQGPTQ) -> LayerOutputs:
        awq, gptq = _steps(scheme)
        counted = len(ctx.result.expert_tokens)
        folded = awq.search_and_fold(ctx, scheme.awq())
        Y = folded.Y[: ctx.error_chunks]  # measured before the fold
        if ctx.fp_inputs is not None:  # --gptaq: the fp model's inputs in the folded layer's basis, x / s
            for key, s in folded.s.items():
                ctx.fp_inputs[key] = _divided(ctx.fp_inputs[key], s)
        del ctx.result.expert_tokens[counted:]  # GPTQ's pass counts them again
        return LayerOutputs(Y, gptq.quantize_layer(ctx, scheme.gptq()).Y_hat)


def _divided(store: Any, s: torch.Tensor) -> Iterator[torch.Tensor]:
    """The chunks of `store` (`calib/spill.drain`) divided by s (K,) along their last axis."""
    for x in drain(store):
        yield x / s.to(x.device, x.dtype)
