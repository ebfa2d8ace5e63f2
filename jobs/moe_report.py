"""The quantize report's mixture-of-experts entry, and the `MoeCalibration` the options ask for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infer_tool.calib.recipe import QuantizeOptions


@dataclass
class MoeSummary:
    """Mixture-of-experts models: how experts were calibrated and what they saw."""

    calibration: str  # "all" or "routed"
    min_tokens: int
    moe_layers: int
    experts: int  # routed experts over every MoE layer
    expert_linears_quantized: int
    experts_below_min_tokens: list[str]  # "layer expert j (n tokens)"
    fallback_experts: list[str]  # experts quantized with a fallback (routed mode), by name
    tokens: list[Any]  # per MoE layer: ExpertTokens (counts, min / median / max, experts below)


def moe_calibration(opts: QuantizeOptions) -> Any:
    """The `MoeCalibration` the options ask for (its own defaults where they are unset)."""
    from infer_tool.calib.moe import MoeCalibration

    given = {"mode": opts.moe_calibration, "min_tokens": opts.moe_min_tokens}
    return MoeCalibration(**{k: v for k, v in given.items() if v is not None})


def moe_summary(result: Any, opts: QuantizeOptions) -> MoeSummary | None:
    """The report's MoE entry from the pipeline's per-layer routed token counts."""
    if not result.expert_tokens:
        return None
    cal = moe_calibration(opts)
    below = [f"{t.layer} expert {j} ({t.counts[j]} tokens)" for t in result.expert_tokens for j in t.below]
    fallen = sorted({f.layer.rsplit(".", 1)[0] for f in result.fallbacks if ".experts." in f.layer})
    return MoeSummary(
        cal.mode,
        cal.min_tokens,
        len(result.expert_tokens),
        sum(len(t.counts) for t in result.expert_tokens),
        sum(".experts." in n for n in result.quantized),
        below,
        fallen,
        result.expert_tokens,
    )
