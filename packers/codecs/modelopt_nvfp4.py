"""NVIDIA ModelOpt NVFP4 checkpoints (`export_hf_checkpoint`, quant_algo `NVFP4` or
`W4A16_NVFP4`), read by vLLM's `modelopt_fp4` method and by TensorRT-LLM. Read only: eval loads
them, `convert` rewrites them as compressed-tensors; nothing here writes one.

Config: `hf_quant_config.json` `{"quantization": {"quant_algo": "NVFP4", "group_size": 16,
"kv_cache_quant_algo", "exclude_modules": [wildcards]}}` and/or config.json `quantization_config`
with `quant_method: "modelopt"` and either that nested `quantization` dict or the same keys flat
(`quant_algo`, `group_size`, `ignore`).

Per quantized linear `L` (weight (N, K), K a multiple of 16):
- `L.weight`          uint8 `(N, K/2)`: code 2j in the low nibble of byte j, 2j+1 in the high one
                      (ModelOpt `NVFP4QTensor.quantize`: `(q[..., 1::2] << 4) | q[..., 0::2]`);
                      E2M1 codes, bit 3 the sign, magnitudes (0, .5, 1, 1.5, 2, 3, 4, 6);
- `L.weight_scale`    float8_e4m3fn `(N, K/16)`;
- `L.weight_scale_2`  float32 scalar: a MULTIPLIER, `amax / (6 · 448)`;
- `L.input_scale`     float32 scalar (W4A4 `NVFP4` only): `amax(x) / (6 · 448)`, a multiplier too.
Dequantization (`NVFP4QTensor.dequantize`; vLLM's emulation the same): `W = value(code) ·
(float32(weight_scale) · weight_scale_2)`, float32 products.

compressed-tensors stores the DIVISOR instead (`weight_global_scale = 448 · 6 / amax`, W =
value · (s / global_scale)) and vLLM serves it with the multiplier `1 / global_scale`. The codes
and the E4M3 scales carry over byte for byte; the global scale is the one float32 number `g`
chosen by `carried_divisor`: among the floats nearest `1 / weight_scale_2`, one whose reciprocal
is `weight_scale_2` exactly (vLLM then dequantizes the very same weights) and, where float32 has
one, whose quotients `s / g` equal the products `s · weight_scale_2` for every block scale the
tensor holds (compressed-tensors' and transformers' dequantization bit for bit too). Float32
has such a `g` for only some multipliers; `Fp4Weight.info` says which equalities hold.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from infer_tool.common.errors import BadInput
from infer_tool.kernels.fp4_layout import unpack_fp4
from infer_tool.packers.checkpoint import CheckpointFormat
from infer_tool.packers.fp4_weight import Fp4Weight

ALGOS = ("NVFP4", "W4A16_NVFP4")
GROUP = 16
SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale")
ANCHOR = "weight_scale_2"


def settings(quant_config: Mapping[str, Any]) -> tuple[str, int, list[str]]:
    """(quant_algo upper-cased, group_size, exclude wildcards) of a ModelOpt config, nested or flat."""
    inner = quant_config.get("quantization")
    q = inner if isinstance(inner, Mapping) else quant_config
    algo = str(q.get("quant_algo") or "").upper()
    group = q.get("group_size", GROUP)
    if isinstance(group, str) and re.fullmatch(r"[0-9]+", group, re.ASCII):
        group = int(group)
    if not isinstance(group, int) or isinstance(group, bool):
        raise BadInput(f"ModelOpt group_size {group!r} is not an integer")
    exclude = q.get("exclude_modules", q.get("ignore", [])) or []
    return algo, group, [str(e) for e in exclude]


def w4a4(quant_config: Mapping[str, Any]) -> bool:
    """True when activations are FP4 too: quant_algo NVFP4, unless every config group says
    `input_activations: null` (vLLM's `ModelOptNvFp4Config` reads those as W4A16)."""
    groups = quant_config.get("config_groups")
    if isinstance(groups, Mapping) and groups:
        if all(isinstance(g, Mapping) and g.get("input_activations") is None for g in groups.values()):
            return False
    return settings(quant_config)[0] == "NVFP4"


def matches(quant_config: Mapping[str, Any]) -> bool:
    method = str(quant_config.get("quant_method", "")).lower()
    return method.startswith("modelopt") and settings(quant_config)[0] in ALGOS


def _candidates(multiplier: torch.Tensor, spread: int = 2) -> list[torch.Tensor]:
    """float32 values nearest 1 / multiplier, the nearest first."""
    g0 = (1.0 / multiplier.double()).float()
    out = [g0]
    up, down = g0.clone(), g0.clone()
    for _ in range(spread):
        up = torch.nextafter(up, torch.tensor(float("inf")))
        down = torch.nextafter(down, torch.tensor(0.0))
        out += [up, down]
    return out


def carried_divisor(multiplier: torch.Tensor, block_scales: torch.Tensor) -> tuple[torch.Tensor, bool, bool]:
    """(g float32 `(1,)`, reciprocal_exact, division_exact) for a ModelOpt multiplier (module
    docstring): reciprocal_exact when float32 `1 / g == multiplier`, division_exact when
    `s / g == s · multiplier` in float32 for every distinct block scale `s` in `block_scales`.
    Preference: both, then the reciprocal (vLLM's serving path), then the division, then the
    nearest."""
    m = multiplier.float().reshape(1)
    s = block_scales.float().unique()
    best = None
    for g in _candidates(m):
        recip = bool((1.0 / g == m).all())
        div = bool(torch.equal(s / g, s * m))
        rank = (recip and div, recip, div)
        if best is None or rank > best[0]:
            best = (rank, g)
    (_, recip, div), g = best
    return g.reshape(1).clone(), recip, div


def positive_scalar(t: torch.Tensor, what: str) -> torch.Tensor:
    """A ModelOpt per-tensor scale as float32 (1,); BadInput unless one positive finite float."""
    if t.numel() != 1 or not t.dtype.is_floating_point:
        raise BadInput(f"{what}: expected a float scalar, got {t.dtype} of shape {tuple(t.shape)}")
    v = t.float().reshape(1)
    if not bool(torch.isfinite(v).all()) or float(v) <= 0:
        raise BadInput(f"{what}: {float(v)} is not a positive finite scale")
    return v


def read_layers(tensors: Mapping[str, torch.Tensor], quant_config: Mapping[str, Any]) -> dict[str, Fp4Weight]:
    """{linear name: Fp4Weight} for every `*.weight_scale_2` in `tensors`; `info` records
    `modelopt_weight_scale_2` and which equalities the carried global scale keeps."""
    algo, group, _ = settings(quant_config)
    acts = w4a4(quant_config)
    if group != GROUP:
        raise BadInput(f"ModelOpt {algo} with group_size {group!r}: NVFP4 groups are 16 wide")
    out = {}
    for key in sorted(tensors):
        if not key.endswith("." + ANCHOR):
            continue
        name = key[: -len(ANCHOR) - 1]
        packed, scale = tensors.get(f"{name}.weight"), tensors.get(f"{name}.weight_scale")
        if packed is None or scale is None or packed.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn:
            raise BadInput(
                f"{name}: ModelOpt NVFP4 needs a uint8 {name}.weight and a float8_e4m3fn {name}.weight_scale"
            )
        if packed.dim() != 2:
            raise BadInput(f"{name}: a {packed.dim()}-D ModelOpt weight {tuple(packed.shape)}; linears (2-D) are read")
        n, half = packed.shape
        if tuple(scale.shape) != (n, 2 * half // GROUP) or (2 * half) % GROUP:
            raise BadInput(f"{name}: weight_scale {tuple(scale.shape)} does not cover a weight {n}x{2 * half} by 16")
        ws2 = positive_scalar(tensors[key], key)
        g, recip, div = carried_divisor(ws2, scale)
        inp = tensors.get(f"{name}.input_scale")
        igs = None
        if acts:
            if inp is None:
                raise BadInput(f"{name}: quant_algo NVFP4 quantizes activations, but {name}.input_scale is missing")
            igs, _, _ = carried_divisor(positive_scalar(inp, f"{name}.input_scale"), torch.ones(1))
        out[name] = Fp4Weight(
            codes=unpack_fp4(packed),
            w_scale=scale,
            global_scale=g,
            input_global_scale=igs,
            activations="fp4" if acts else "none",
            info={"modelopt_weight_scale_2": float(ws2), "reciprocal_exact": recip, "division_exact": div},
        )
    return out


def _read_only(*args: Any) -> Any:
    raise BadInput(
        "ModelOpt NVFP4 is read (eval, convert), not written; use --format compressed-tensors "
        "(vLLM serves its NVFP4 checkpoints)"
    )


FORMAT = CheckpointFormat(
    name="modelopt",
    kind="fp4",
    suffixes=SUFFIXES,
    config=_read_only,
    tensors=_read_only,
    read=read_layers,
    matches=matches,
    check=_read_only,
)
