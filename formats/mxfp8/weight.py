"""`Mxfp8Weight`: one linear layer in MXFP8, the solvers' result and the codec's.

Layout (the `nn.Linear` orientation):
- `values`       float8_e4m3fn `(N, K)`;
- `scale_exp`    uint8 `(N, K/32)`: E8M0 exponents u, the group's scale `2 ** (u - 127)`;
- `activations`  "none" (MXFP8A16) or "mxfp8" (W8A8, dynamic per-32 inputs).
Dequantized weight: `value * 2 ** (u - 127)` (`numerics.dequantize`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from infer_tool.formats.mxfp8 import numerics
from infer_tool.packers.deploy import Deploy


@dataclass
class Mxfp8Weight:
    values: torch.Tensor  # (N, K) float8_e4m3fn
    scale_exp: torch.Tensor  # (N, K/32) uint8
    activations: str = "none"
    info: dict[str, Any] = field(default_factory=dict)  # solver report (fallback, damp, ...)

    label = "MXFP8"

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) = (out_features, in_features)."""
        return (int(self.values.shape[0]), int(self.values.shape[1]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(N, K) weight in `dtype`."""
        return numerics.dequantize(self.values, self.scale_exp, dtype)

    def rows(self, rows: slice) -> Mxfp8Weight:
        """The weight of rows `rows` (one linear of a stacked solve)."""
        return replace(self, values=self.values[rows], scale_exp=self.scale_exp[rows], info=dict(self.info))

    def to(self, device: torch.device | str) -> Mxfp8Weight:
        """A copy with every tensor on `device`."""
        return replace(self, values=self.values.to(device), scale_exp=self.scale_exp.to(device))

    def takes_int8_activations(self, deploy: Deploy) -> bool:
        return False

    def to_linear(self, bias: torch.Tensor | None, dtype: torch.dtype, deploy: Deploy, where: str) -> Any:
        """The MXFP8 evaluation module (`linear.Mxfp8Linear`): MXFP8 activations as the checkpoint
        says, unless activations are "none"."""
        from infer_tool.formats.mxfp8.linear import Mxfp8Linear

        w8a8 = self.activations == "mxfp8" and deploy.activations != "none"
        return Mxfp8Linear(self.values, self.scale_exp, bias, w8a8=w8a8)

    @classmethod
    def activations_note(
        cls, layers: Mapping[str, Mxfp8Weight], deploy: Deploy, kernels: set[str], dtype: torch.dtype
    ) -> str:
        if deploy.activations != "none" and any(w.activations == "mxfp8" for w in layers.values()):
            return "activations MXFP8 as the checkpoint says (E4M3, a dynamic E8M0 scale per 32, as vLLM rounds them)"
        return "activations unquantized"
