"""What a calibration run returns: `PipelineResult` and the records it holds.

Plain data: every quantizer fills the same fields; method-specific report entries go in
`method_report` (e.g. AWQ's per-mapping search results under "awq"), which the quantize
job copies into its report as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from infer_tool.calib.stats import LayerStats


@dataclass
class LayerError:
    """‖Ŷ − Y‖/‖Y‖ of one decoder layer's output, quantized vs fp, on the error samples."""

    layer: str
    relative_output_error: float


@dataclass
class Fallback:
    """A linear its solver could not quantize as asked (e.g. GPTQ's Cholesky failed: RTN)."""

    layer: str
    fallback: str
    reason: str | None


@dataclass
class PipelineResult:
    quantized: dict[str, Any] = field(default_factory=dict)  # full linear name -> QuantizedWeight / Fp8Weight
    stats: dict[str, LayerStats] = field(default_factory=dict)  # full linear name -> stats (shared per group)
    layer_errors: list[LayerError] = field(default_factory=list)  # per decoder layer
    linear_errors: dict[str, float] = field(default_factory=dict)  # ‖ΔW X‖/‖W X‖ where H is known
    fallbacks: list[Fallback] = field(default_factory=list)
    kv_amax: dict[str, Any] = field(default_factory=dict)  # KV cache: attention name -> KvAmax (calib/kv_scales.py)
    expert_tokens: list[Any] = field(default_factory=list)  # per MoE layer: ExpertTokens (calib/moe.py)
    method_report: dict[str, Any] = field(default_factory=dict)  # the method's own report entries (JSON-able)
    ignored: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    samples_per_process: list[int] = field(default_factory=list)  # calibration sequences each process ran (rank order)
