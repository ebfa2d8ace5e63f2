"""The quantize job's report: `QuantizeReport` and the records it holds (`to_dict()` is
`quantize_report.json` and `--json`). Plain data; `jobs/quantize_run.report_of` fills it
from a finished run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from infer_tool.jobs.moe_report import MoeSummary


@dataclass
class Calibration:
    """What the statistics were measured on."""

    tokens: int
    corpus: str | None
    num_samples: int | None
    seq_len: int | None
    seed: int | None
    from_stats: str | None = None  # a `calibrate` directory, when reused
    note: str | None = None
    world_size: int | None = None  # processes the calibration ran on (accelerate launch / torchrun)
    samples_per_process: list[int] | None = None  # calibration sequences each process ran, in rank order

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None or k in ("corpus",)}


@dataclass
class EvalSummary:
    corpus: str
    tokens: int
    seq_len: int
    windows: int
    ppl_before: float
    ppl_after: float
    ratio: float
    evaluated: str
    ppl_before_cached: bool = False  # the fp baseline was read from the ppl cache (`evals/ppl_cache.py`)
    activations: str = "unquantized"  # what "ppl after" did to activations, e.g. "int8 per token (onednn, 14 linears)"
    # --kld: KL(fp ‖ quantized) per token on the same windows, `evals.kld.KldResult.to_dict()`
    # (its ppl fields are ppl_after and ppl_before again); None without --kld
    kld: dict[str, Any] | None = None


@dataclass
class QualityGate:
    max_increase: float  # a fraction: 0.05 = 5%
    increase: float
    passed: bool


@dataclass
class KldGate:
    max_kld: float  # nats per token
    kld: float | None  # the mean KL divergence measured; None: not measured (the gate fails)
    passed: bool


@dataclass
class QuantizeReport:
    """Everything a run measured; `to_dict()` is `quantize_report.json` and `--json`."""

    model: str
    model_path: str
    model_type: str
    method: str
    scheme: dict[str, Any]
    scheme_description: str
    format: str
    dtype: str
    out: str
    device: str
    recipe: str | None
    options: dict[str, Any]
    notes: list[str]
    calibration: Calibration | None = None
    eval: EvalSummary | None = None
    quality_gate: QualityGate | None = None
    kld_gate: KldGate | None = None
    quantized_layers: int = 0
    ignored: list[str] = field(default_factory=list)
    unmatched_ignore: list[str] = field(default_factory=list)  # --ignore patterns that matched no linear
    layer_errors: list[Any] = field(default_factory=list)
    linear_errors: dict[str, float] = field(default_factory=dict)
    fallbacks: list[Any] = field(default_factory=list)
    method_report: dict[str, Any] = field(default_factory=dict)  # the method's own entries (AWQ: "awq")
    kv_cache_scales: dict[str, dict[str, float]] | None = None
    moe: MoeSummary | None = None
    memory: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def layer_error_mean(self) -> float | None:
        errors = [e.relative_output_error for e in self.layer_errors]
        return sum(errors) / len(errors) if errors else None

    @property
    def layer_error_max(self) -> float | None:
        return max((e.relative_output_error for e in self.layer_errors), default=None)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "method_report":
                d.update(value)
                continue
            if value is None and f.name in (
                "calibration",
                "eval",
                "quality_gate",
                "kld_gate",
                "kv_cache_scales",
                "moe",
            ):
                continue
            if f.name == "calibration":
                value = value.to_dict()
            elif dataclasses.is_dataclass(value):
                value = dataclasses.asdict(value)
            elif f.name in ("layer_errors", "fallbacks"):
                value = [dataclasses.asdict(v) for v in value]
            d[f.name] = value
            if f.name == "layer_errors":
                d["layer_error_mean"], d["layer_error_max"] = self.layer_error_mean, self.layer_error_max
            if f.name == "fallbacks":
                d["fallback_count"] = len(value)
        return d
