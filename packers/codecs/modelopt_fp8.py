"""NVIDIA ModelOpt FP8 checkpoints (`export_hf_checkpoint`, quant_algo `FP8`: per-tensor weights
with static per-tensor activation scales), read by vLLM's `modelopt` method (`ModelOptFp8Config`)
and by TensorRT-LLM. Read only: eval loads them, `convert` rewrites them as compressed-tensors.

Config: as NVFP4's (`modelopt_nvfp4.settings`: `hf_quant_config.json` `{"quantization":
{"quant_algo": "FP8", "kv_cache_quant_algo", "exclude_modules"}}` and / or config.json
`quantization_config` with `quant_method: "modelopt"`, nested or flat). Other FP8 algos
(`FP8_PER_CHANNEL_PER_TOKEN`, `FP8_PB_WO`) are not read.

Per quantized linear `L` (weight (N, K)):
- `L.weight`        float8_e4m3fn `(N, K)`;
- `L.weight_scale`  float32 scalar: a MULTIPLIER, `amax / 448` (W = float(weight) · weight_scale);
- `L.input_scale`   float32 scalar: `amax(x) / 448`, the static activation scale (a multiplier too).
KV-cache scales (`kv_cache_quant_algo: FP8`: `k_proj.k_scale`, `v_proj.v_scale`) are not linears'.
compressed-tensors `float-quantized` with tensor strategy and static activations stores the same
numbers (`weight_scale` `(1,)`, `input_scale` `(1,)`, both multipliers), so the conversion is
a copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from infer_tool.common.errors import BadInput
from infer_tool.packers.checkpoint import CheckpointFormat
from infer_tool.packers.fp8 import Fp8Weight

ALGO = "FP8"
SUFFIXES = ("weight", "weight_scale", "input_scale")


def matches(quant_config: Mapping[str, Any]) -> bool:
    from infer_tool.packers.codecs.modelopt_nvfp4 import settings

    method = str(quant_config.get("quant_method", "")).lower()
    return method.startswith("modelopt") and settings(quant_config)[0] == ALGO


def _scalar(t: torch.Tensor | None, what: str) -> torch.Tensor:
    from infer_tool.packers.codecs.modelopt_nvfp4 import positive_scalar

    if t is None:
        raise BadInput(f"{what} is missing: ModelOpt FP8 stores a weight_scale and an input_scale per linear")
    return positive_scalar(t, what)


def read_layers(tensors: Mapping[str, torch.Tensor], quant_config: Mapping[str, Any]) -> dict[str, Fp8Weight]:
    """{linear name: Fp8Weight} (per tensor, static input scale) for every float8_e4m3fn `*.weight`."""
    out = {}
    for key in sorted(tensors):
        t = tensors[key]
        if not key.endswith(".weight") or t.dtype != torch.float8_e4m3fn:
            continue
        name = key[: -len(".weight")]
        if t.dim() != 2:
            raise BadInput(f"{name}: a {t.dim()}-D ModelOpt FP8 weight {tuple(t.shape)}; linears (2-D) are read")
        out[name] = Fp8Weight(
            weight=t,
            weight_scale=_scalar(tensors.get(f"{name}.weight_scale"), f"{name}.weight_scale"),
            granularity="tensor",
            input_scale=_scalar(tensors.get(f"{name}.input_scale"), f"{name}.input_scale"),
        )
    return out


def _read_only(*args: Any) -> Any:
    raise BadInput(
        "ModelOpt FP8 is read (eval, convert), not written; use --format compressed-tensors or fp8 (vLLM serves both)"
    )


FORMAT = CheckpointFormat(
    name="modelopt",
    kind="fp8",
    suffixes=SUFFIXES,
    config=_read_only,
    tensors=_read_only,
    read=read_layers,
    matches=matches,
    check=_read_only,
    activations_quantized=lambda qc: True,
)
