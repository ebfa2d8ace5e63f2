"""FP8 schemes: `Fp8Scheme`, e4m3 weights with dynamic or static activations and an optional
FP8 KV cache. `kind = "fp8"`: the compressed-tensors `float-quantized` and the native `fp8`
formats carry it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from infer_tool.common.errors import BadInput
from infer_tool.schemes.base import Scheme
from infer_tool.schemes.options import option

GRANULARITIES = ("tensor", "channel", "block")
ACTIVATION_SCHEMES = ("dynamic", "static")
KV_CACHE_SCHEMES = ("fp8",)


@dataclass(frozen=True)
class Fp8Scheme(Scheme):
    """FP8 e4m3 weights (and activations, KV cache).

    granularity: weight scale per "tensor", output "channel" or "block" of `block_size`
        `(bn, bk)` (rows, columns). The default, per-channel weights with dynamic per-token
        activations, is llm-compressor's FP8_DYNAMIC scheme.
    activations: "dynamic" (per-token scales at run time, no calibration) or "static"
        (one calibrated per-tensor `input_scale`). Block weights go with dynamic only.
    kv_cache: None, or "fp8" for calibrated per-layer k_scale / v_scale.
    clip_search: search clipping ratios in [clip_min_ratio, 1] (clip_steps + 1 points)
        minimising output error on calibration data (needs the layer Hessian).
    """

    method: ClassVar[str] = "fp8"
    kind: ClassVar[str] = "fp8"
    granularity: str = option(
        "channel",
        "FP8 weight scales: tensor, channel or block (128x128).",
        name="fp8_granularity",
        panel="FP8",
    )
    block_size: tuple[int, int] = (128, 128)
    activations: str = option(
        "dynamic",
        "FP8 activations: dynamic (per token, no calibration) or static (calibrated per-tensor input_scale). "
        "With an INT method's 4-bit symmetric group-128 weights: W4AFP8 (dynamic only; --scheme W4AFP8).",
        name="fp8_activations",
        panel="FP8",
    )
    kv_cache: str | None = option(
        None,
        "fp8: calibrate per-layer k_scale / v_scale (post-RoPE keys, values) for an FP8 KV cache.",
        kind=str,
        panel="FP8",
    )
    clip_search: bool = option(
        False,
        "FP8: search weight clipping ratios minimising output error on calibration data.",
        flag="--fp8-clip-search/--no-fp8-clip-search",
        name="fp8_clip_search",
        panel="Method switches",
    )
    clip_min_ratio: float = 0.8
    clip_steps: int = 20

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise BadInput(
                f"FP8 granularity {self.granularity!r} is not supported; use one of {', '.join(GRANULARITIES)}"
            )
        if self.activations not in ACTIVATION_SCHEMES:
            raise BadInput(
                f"FP8 activations {self.activations!r} are not supported; use one of {', '.join(ACTIVATION_SCHEMES)}"
            )
        if self.kv_cache is not None and self.kv_cache not in KV_CACHE_SCHEMES:
            raise BadInput(f"kv cache {self.kv_cache!r} is not supported; use fp8 or leave it unset")
        if self.granularity == "block" and self.activations == "static":
            raise BadInput(
                "block-wise FP8 weights go with dynamic activations only (vLLM and transformers "
                "load no static input scale for them); use --fp8-activations dynamic or another granularity"
            )
        bs = tuple(self.block_size)
        if len(bs) != 2 or min(bs) <= 0:
            raise BadInput(f"block_size={self.block_size} is not supported; use two positive sizes such as (128, 128)")
        object.__setattr__(self, "block_size", (int(bs[0]), int(bs[1])))
        if not 0.0 < self.clip_min_ratio <= 1.0 or self.clip_steps < 1:
            raise BadInput(
                f"clip_min_ratio={self.clip_min_ratio}, clip_steps={self.clip_steps}: "
                "use a ratio in (0, 1] and at least 1 step"
            )

    @property
    def needs_activation_stats(self) -> bool:
        return self.activations == "static"

    @property
    def needs_hessian(self) -> bool:
        return self.clip_search

    def clip_grid(self) -> torch.Tensor:  # noqa: F821
        """(S+1,) fp32 ratios from 1 down to clip_min_ratio."""
        import torch

        return torch.linspace(1.0, self.clip_min_ratio, self.clip_steps + 1, dtype=torch.float32)

    def check_shapes(self, shapes: Mapping[str, tuple[int, int]]) -> None:
        """Any (N, K) works: edge blocks are partial."""

    def for_storage(self, scale_dtype: str) -> Fp8Scheme:
        """FP8 scales are stored in float32 whatever the model dtype."""
        return self

    def describe(self) -> str:
        """'fp8 e4m3 channel weights, dynamic activations, FP8 KV cache' for the report table."""
        text = f"fp8 e4m3 {self.granularity} weights"
        if self.granularity == "block":
            text += f" {self.block_size[0]}x{self.block_size[1]}"
        text += f", {self.activations} activations"
        if self.clip_search:
            text += ", clip search"
        if self.kv_cache:
            text += ", FP8 KV cache"
        return text
