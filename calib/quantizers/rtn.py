"""RTN in the pipeline: every linear alone, no calibration statistics (the solver is
`packers/rtn.quantize_rtn`)."""

from __future__ import annotations

import torch

from infer_tool.calib.quantizers import register_quantizer
from infer_tool.calib.quantizers.base import LayerQuantizer
from infer_tool.calib.stats import LayerStats
from infer_tool.packers.quantized import QuantizedWeight
from infer_tool.packers.rtn import quantize_rtn
from infer_tool.schemes.integer import RTNScheme


@register_quantizer(RTNScheme)
class RTNQuantizer(LayerQuantizer[RTNScheme]):
    def solve(self, W: torch.Tensor, stats: LayerStats | None, scheme: RTNScheme, name: str) -> QuantizedWeight:
        return quantize_rtn(W, stats, scheme)
