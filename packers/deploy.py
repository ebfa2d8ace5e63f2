"""`Deploy`: how a checkpoint's quantized linears run when it is evaluated, the one argument
every weight type's `to_linear(bias, dtype, deploy, where)` takes (`evals/load_quantized.py`).

A weight type (`QuantizedWeight`, `Fp8Weight`, `Fp4Weight`, ...) answers for itself:
- `to_linear(bias, dtype, deploy, where)`: the kernels' evaluation module it becomes
  (BadInput naming `where` when the kernels cannot run it);
- `label`: what its weights are, in a refusal ("4-bit", "FP8");
- `takes_int8_activations(deploy)`: whether `--activations int8` applies to it;
- `activations_note(layers, deploy, kernels, dtype)` (a classmethod): what the evaluation did
  to the activations of a checkpoint of such weights, for the report.
"""

from __future__ import annotations

from dataclasses import dataclass

ACTIVATIONS = ("auto", "none", "int8")
INT8_KERNELS = ("auto", "onednn", "sgl", "cuda")


@dataclass(frozen=True)
class Deploy:
    """activations: "auto" (as the checkpoint is served), "none" (weights only) or "int8" (INT4
    served W4A8); int8_kernel: whose rounding int8 activations follow ("auto": vLLM's choice
    per linear on `device_type`); quantized_activations: the checkpoint's config quantizes
    activations (W8A8, FP8 W8A8: its codec's `activations_quantized`)."""

    activations: str = "auto"
    int8_kernel: str = "auto"
    device_type: str = "cpu"
    quantized_activations: bool = False
