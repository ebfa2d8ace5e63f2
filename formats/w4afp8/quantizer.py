"""W4AFP8 in the layer pipeline: the INT methods' own quantizers (their weights are INT4), each
registered for its W4AFP8 scheme; the report notes where vLLM serves the checkpoint."""

from __future__ import annotations

from infer_tool.calib.quantizers import register_quantizer
from infer_tool.calib.quantizers.autoround import AutoRoundQuantizer
from infer_tool.calib.quantizers.awq import AWQQuantizer
from infer_tool.calib.quantizers.awq_gptq import AWQGPTQQuantizer
from infer_tool.calib.quantizers.gptq import GPTQQuantizer
from infer_tool.calib.quantizers.rtn import RTNQuantizer
from infer_tool.calib.result import PipelineResult
from infer_tool.formats.w4afp8.scheme import (
    W4Afp8AutoRoundScheme,
    W4Afp8AWQGPTQScheme,
    W4Afp8AWQScheme,
    W4Afp8GPTQScheme,
    W4Afp8RTNScheme,
)

SERVED = (
    "W4AFP8 (pack-quantized INT4, FP8 per-token activations): vLLM 0.32 serves it with its CUTLASS W4A8-FP8 "
    "kernel on Hopper (sm90) only; other GPUs and its CPU build find no scheme for it"
)


class Served:
    """The INT method's notes, and where the checkpoint runs."""

    def notes(self, result: PipelineResult, scheme: object) -> list[str]:
        return [*super().notes(result, scheme), SERVED]  # type: ignore[misc]


for scheme_type, quantizer in (
    (W4Afp8RTNScheme, RTNQuantizer),
    (W4Afp8GPTQScheme, GPTQQuantizer),
    (W4Afp8AWQScheme, AWQQuantizer),
    (W4Afp8AWQGPTQScheme, AWQGPTQQuantizer),
    (W4Afp8AutoRoundScheme, AutoRoundQuantizer),
):
    register_quantizer(scheme_type)(type(f"W4Afp8{quantizer.__name__}", (Served, quantizer), {}))
