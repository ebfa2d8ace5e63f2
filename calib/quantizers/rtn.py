"""RTN in the pipeline: every linear alone, no calibration statistics (the solver is
`packers/rtn.quantize_rtn`)."""

from __future__ import annotations

from typing import Any

import torch

from infer_tool.calib.quantizers.base import LayerQuantizer
from infer_tool.calib.stats import LayerStats
from infer_tool.packers.quantized import QuantizedWeight
from infer_tool.packers.rtn import quantize_rtn


class RTNQuantizer(LayerQuantizer):
    def solve(self, W: torch.Tensor, stats: LayerStats | None, scheme: Any, name: str) -> QuantizedWeight:
        return quantize_rtn(W, stats, scheme)


QUANTIZER = RTNQuantizer()
