"""`Fp4Weight`: the canonical in-memory result of an FP4 solver for one linear layer (NVFP4 or
MXFP4, compressed-tensors' layout once packed; `kernels/fp4_layout.py` defines the bits).

Layout (unpacked, the `nn.Linear` orientation):
- `codes`              uint8 `(N, K)`: E2M1 codes 0..15 (bit 3 the sign);
- `w_scale`            `(N, K/g)`: NVFP4 float8_e4m3fn (g = 16), MXFP4 uint8 E8M0 exponents (g = 32);
- `global_scale`       NVFP4 float32 `(1,)`, the divisor `448·6 / amax` (fused shards share
                       it); while a stack of several linears' rows is solved at once, `(N, 1)`,
                       one per row (`rows` takes one linear's back); MXFP4 None;
- `input_global_scale` NVFP4 W4A4: float32 `(1,)` = `448·6 / max|x|` of the calibration
                       inputs; None otherwise (MXFP4 W4A4 scales activations dynamically);
- `activations`        "none" (weights only) or "fp4" (W4A4).
Dequantized weight: `value(code) * effective_scale` (float32 product), with the effective
scale `w_scale / global_scale` (NVFP4) or `2 ** (u - 127)` (MXFP4). This module knows
nothing about files.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from infer_tool.kernels.fp4_layout import dequantize_codes, effective_scale
from infer_tool.packers.deploy import Deploy


@dataclass
class Fp4Weight:
    codes: torch.Tensor  # (N, K) uint8
    w_scale: torch.Tensor  # (N, G) float8_e4m3fn | uint8
    global_scale: torch.Tensor | None  # (1,) | (N, 1) float32, NVFP4 only
    input_global_scale: torch.Tensor | None = None  # (1,) float32, NVFP4 W4A4 only
    activations: str = "none"
    info: dict[str, Any] = field(default_factory=dict)  # solver report (fallback, damp, ...)

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) = (out_features, in_features)."""
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))

    @property
    def fmt(self) -> str:
        """ "nvfp4" or "mxfp4", from the scale dtype."""
        return "nvfp4" if self.w_scale.dtype == torch.float8_e4m3fn else "mxfp4"

    @property
    def group_size(self) -> int:
        return self.shape[1] // int(self.w_scale.shape[1])

    def effective_scale(self) -> torch.Tensor:
        """(N, G) float32: what each group's codes are multiplied by."""
        gs = None if self.global_scale is None else self.global_scale.reshape(-1, 1)
        return effective_scale(self.w_scale, gs)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(N, K) weight in `dtype` (the float32 product, then cast)."""
        return dequantize_codes(self.codes, self.effective_scale(), dtype)

    def rows(self, rows: slice) -> Fp4Weight:
        """The weight of rows `rows` (one linear of a stacked solve), with its one global scale."""
        gs = self.global_scale
        if gs is not None and gs.numel() > 1:
            gs = gs.reshape(-1)[rows]
            if gs.numel() and not bool((gs == gs[0]).all()):
                raise ValueError("rows of one linear must share one global scale")
            gs = gs[:1].clone()
        return replace(self, codes=self.codes[rows], w_scale=self.w_scale[rows], global_scale=gs, info=dict(self.info))

    label = "FP4"

    def takes_int8_activations(self, deploy: Deploy) -> bool:
        return False

    def to_linear(self, bias: torch.Tensor | None, dtype: torch.dtype, deploy: Deploy, where: str) -> Any:
        """The kernels' `Fp4Linear`; W4A4 (activations quantized as vLLM's emulation does) when the
        weight says so, unless activations are "none"."""
        from infer_tool.kernels.fp4_layout import pack_fp4
        from infer_tool.kernels.quant_linear import Fp4Linear

        w4a4 = self.activations == "fp4" and deploy.activations != "none"
        return Fp4Linear(
            pack_fp4(self.codes),
            self.w_scale,
            self.global_scale,
            bias,
            w4a4=w4a4,
            input_global_scale=self.input_global_scale if w4a4 else None,  # --activations none: weights only
        )

    @classmethod
    def activations_note(
        cls, layers: Mapping[str, Fp4Weight], deploy: Deploy, kernels: set[str], dtype: torch.dtype
    ) -> str:
        w4a4 = any(w.activations == "fp4" for w in layers.values())
        if w4a4 and deploy.activations != "none":
            return "activations FP4 as the checkpoint says (W4A4, vLLM's emulation)"
        return "activations unquantized"

    def to(self, device: torch.device | str) -> Fp4Weight:
        """A copy with every tensor on `device`."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(
            self,
            codes=move(self.codes),
            w_scale=move(self.w_scale),
            global_scale=move(self.global_scale),
            input_global_scale=move(self.input_global_scale),
        )
