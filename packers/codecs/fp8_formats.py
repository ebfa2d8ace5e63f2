"""FP8 checkpoint formats: tensor names, shapes and config.json `quantization_config`,
written and read back.

compressed-tensors `float-quantized` (what llm-compressor writes; vLLM and transformers
load it), per quantized linear `L`:
- `L.weight`        float8_e4m3fn `(N, K)`
- `L.weight_scale`  `(1,)` tensor | `(N, 1)` channel | `(ceil(N/bn), ceil(K/bk))` block
- `L.input_scale`   `(1,)` only for static activations
config: `quant_method: "compressed-tensors"`, `format: "float-quantized"`, one config
group with weights `{num_bits: 8, type: "float", strategy, block_structure, symmetric:
true, dynamic: false}` and input_activations `{dynamic: true, strategy: "token"}` or
`{dynamic: false, strategy: "tensor"}`, `ignore`, and `kv_cache_scheme` (8-bit float,
per tensor, static) when the KV cache is FP8.

native `quant_method: "fp8"` (vLLM's Fp8Config; AutoFP8 / DeepSeek-V3 style):
- per tensor: `L.weight` e4m3, `L.weight_scale` fp32 scalar `()`, `L.input_scale` fp32
  scalar when `activation_scheme: "static"`; config `weight_block_size: null`;
- per block: `L.weight` e4m3, `L.weight_scale_inv` fp32 `(ceil(N/bn), ceil(K/bk))` — a
  multiplier despite the name, W ~ weight * weight_scale_inv — and config
  `weight_block_size: [bn, bk]`, dynamic activations only.
- per channel: not expressible (vLLM's Fp8Config has no channel scales) -> refused.
transformers' FineGrainedFP8 reads the block layout; for per-tensor it expects other names
(`weight_scale_inv`, `activation_scale`), so per-tensor native checkpoints are for vLLM.

KV cache (both formats): `<attention>.k_scale`, `<attention>.v_scale` = amax / 448 of the
post-RoPE keys / values, e.g. `model.layers.0.self_attn.k_scale`; `(1,)` in
compressed-tensors, scalar in native. vLLM reads these names for `kv_cache_dtype=fp8`.

This module knows nothing about models beyond tensor names, or about writing directories
(packers/checkpoint.py does that; `CT_FORMAT` and `NATIVE_FORMAT` plug into its registry).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch

from infer_tool.common.errors import BadInput
from infer_tool.packers.checkpoint import CheckpointFormat, group_quantizes_inputs
from infer_tool.packers.fp8 import Fp8Scheme, Fp8Weight, scale_from_amax

FP8_FORMATS = ("compressed-tensors", "fp8")
CT_FLOAT_FORMAT = "float-quantized"
KV_SCALE_NAMES = ("k_scale", "v_scale")


class KvAmaxLike(Protocol):
    k_amax: float
    v_amax: float


def check_fp8_format(scheme: Fp8Scheme, fmt: str) -> None:
    """Refuse, before any work, a scheme the format cannot carry."""
    if fmt not in FP8_FORMATS:
        raise BadInput(f"FP8 format {fmt!r} is not supported; use one of {', '.join(FP8_FORMATS)}")
    if fmt == "fp8" and scheme.granularity == "channel":
        raise BadInput(
            "per-channel FP8 weights are carried only by --format compressed-tensors; "
            "native --format fp8 holds per-tensor or 128x128 block scales (--fp8-granularity tensor|block)"
        )


# ---------------------------------------------------------------- config


def quant_args(**kw: Any) -> dict[str, Any]:
    """A compressed-tensors QuantizationArgs dict with every field spelled out (8-bit float
    unless `kw` says otherwise)."""
    base = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "group_size": None,
        "strategy": "tensor",
        "block_structure": None,
        "dynamic": False,
        "actorder": None,
        "observer": None,
        "observer_kwargs": {},
    }
    base.update(kw)
    return base


def ct_weight_args(scheme: Fp8Scheme) -> dict[str, Any]:
    block = list(scheme.block_size) if scheme.granularity == "block" else None
    return quant_args(strategy=scheme.granularity, block_structure=block, observer="minmax")


def ct_input_args(scheme: Fp8Scheme) -> dict[str, Any]:
    if scheme.activations == "dynamic":
        return quant_args(strategy="token", dynamic=True)
    return quant_args(strategy="tensor", dynamic=False, observer="minmax")


def ct_kv_cache_args() -> dict[str, Any]:
    return quant_args(strategy="tensor", dynamic=False, observer="minmax")


def quantization_config(scheme: Fp8Scheme, fmt: str, ignore: Iterable[str]) -> dict[str, Any]:
    """config.json `quantization_config` for `fmt`; `ignore` lists the linear modules left
    unquantized (full names, e.g. `lm_head`)."""
    check_fp8_format(scheme, fmt)
    ignore = sorted(set(ignore))
    if fmt == "compressed-tensors":
        return {
            "quant_method": "compressed-tensors",
            "format": CT_FLOAT_FORMAT,
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": ct_weight_args(scheme),
                    "input_activations": ct_input_args(scheme),
                    "output_activations": None,
                    "format": CT_FLOAT_FORMAT,
                }
            },
            "ignore": ignore,
            "kv_cache_scheme": ct_kv_cache_args() if scheme.kv_cache == "fp8" else None,
            "sparsity_config": {},
            "global_compression_ratio": None,
        }
    return {
        "quant_method": "fp8",
        "activation_scheme": scheme.activations,
        "weight_block_size": list(scheme.block_size) if scheme.granularity == "block" else None,
        "ignored_layers": ignore,
    }


# ---------------------------------------------------------------- tensors


def layer_tensors(
    name: str, w: Fp8Weight, fmt: str, scale_dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """The tensors of one quantized linear `name` (module path, no `.weight`).

    scale_dtype: compressed-tensors scales may be stored in the model dtype (llm-compressor
    does); fp32 keeps them exact. Native FP8 scales are always fp32.
    """
    out = {f"{name}.weight": w.weight.contiguous()}
    if fmt == "compressed-tensors":
        out[f"{name}.weight_scale"] = w.weight_scale.to(scale_dtype).contiguous()
        if w.input_scale is not None:
            out[f"{name}.input_scale"] = w.input_scale.reshape(1).to(scale_dtype).clone()  # never shared
        return out
    if fmt != "fp8":
        raise BadInput(f"FP8 format {fmt!r} is not supported; use one of {', '.join(FP8_FORMATS)}")
    if w.granularity == "block":
        out[f"{name}.weight_scale_inv"] = w.weight_scale.float().contiguous()
        if w.input_scale is not None:
            raise BadInput(f"{name}: block-wise FP8 weights go with dynamic activations only in the native format")
    elif w.granularity == "tensor":
        out[f"{name}.weight_scale"] = w.weight_scale.float().reshape(()).clone()
        if w.input_scale is not None:
            out[f"{name}.input_scale"] = w.input_scale.float().reshape(()).clone()
    else:
        raise BadInput(f"{name}: per-channel FP8 weights are carried only by --format compressed-tensors")
    return out


def kv_scale_tensors(kv: Mapping[str, KvAmaxLike], fmt: str) -> dict[str, torch.Tensor]:
    """`{attention}.k_scale` / `.v_scale` = amax / 448 for every attention module name."""
    shape = (1,) if fmt == "compressed-tensors" else ()
    out = {}
    for attn, a in kv.items():
        out[f"{attn}.k_scale"] = scale_from_amax(torch.tensor(a.k_amax)).reshape(shape)
        out[f"{attn}.v_scale"] = scale_from_amax(torch.tensor(a.v_amax)).reshape(shape)
    return out


def block_alignment_notes(shapes: Mapping[str, tuple[int, int]], block_size: tuple[int, int]) -> list[str]:
    """Warnings for block-FP8 layers whose (N, K) are not multiples of the block: our
    writers and readers handle partial edge blocks (as compressed-tensors does), but
    transformers' native-FP8 dequantizer needs N and K divisible by the block, and vLLM
    needs every shard of a fused layer (q/k/v, gate/up) divisible by bn, and K by bk
    under tensor parallelism."""
    bn, bk = block_size
    bad = {n: s for n, s in shapes.items() if s[0] % bn or s[1] % bk}
    if not bad:
        return []
    listed = ", ".join(f"{n} {s[0]}x{s[1]}" for n, s in sorted(bad.items())[:4])
    more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
    return [
        f"block FP8: {listed}{more} are not multiples of {bn}x{bk}; partial edge blocks load in "
        "compressed-tensors and our reader, but vLLM refuses fused q/k/v or gate/up shards not "
        f"divisible by {bn} and transformers' native FP8 loader needs N, K divisible by the block"
    ]


def fp8_state_dict(
    state: Mapping[str, torch.Tensor],
    layers: Mapping[str, Fp8Weight],
    fmt: str,
    kv: Mapping[str, KvAmaxLike] | None = None,
    scale_dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: `state` (the model's, in its dtype) with each quantized
    linear's `.weight` replaced by its FP8 tensors, plus KV-cache scales."""
    out = {k: v for k, v in state.items()}
    for name, w in layers.items():
        if f"{name}.weight" not in out:
            raise BadInput(f"quantized layer {name!r} has no weight in the model's state dict")
        out.update(layer_tensors(name, w, fmt, scale_dtype))
    if kv:
        out.update(kv_scale_tensors(kv, fmt))
    return out


# ---------------------------------------------------------------- reading


def _ct_group_args(quant_config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    groups = list(quant_config.get("config_groups", {}).values())
    if len(groups) != 1 or (groups[0].get("weights") or {}).get("type") != "float":
        raise BadInput("this compressed-tensors checkpoint is not a single-group FP8 float-quantized one")
    return groups[0]["weights"], groups[0].get("input_activations")


def read_fp8_layers(tensors: Mapping[str, torch.Tensor], quant_config: Mapping[str, Any]) -> dict[str, Fp8Weight]:
    """{linear name: Fp8Weight} from a checkpoint's tensors and its `quantization_config`
    (either format); the layers are those whose `.weight` is float8_e4m3fn."""
    method = quant_config.get("quant_method")
    if method == "compressed-tensors":
        wargs, _ = _ct_group_args(quant_config)
        granularity = wargs["strategy"]
        block = tuple(wargs["block_structure"]) if granularity == "block" else None
    elif method == "fp8":
        bs = quant_config.get("weight_block_size")
        granularity, block = ("block", tuple(bs)) if bs else ("tensor", None)
    else:
        raise BadInput(f"quant_method {method!r} is not an FP8 format; expected one of {', '.join(FP8_FORMATS)}")
    if granularity not in ("tensor", "channel", "block"):
        raise BadInput(f"FP8 weight strategy {granularity!r} is not supported; expected tensor, channel or block")
    out = {}
    for key, t in tensors.items():
        if not key.endswith(".weight") or t.dtype != torch.float8_e4m3fn:
            continue
        name = key[: -len(".weight")]
        scale_key = f"{name}.weight_scale_inv" if (method == "fp8" and block) else f"{name}.weight_scale"
        if scale_key not in tensors:
            raise BadInput(f"checkpoint has FP8 {key} but no {scale_key}")
        scale = tensors[scale_key].float()
        n, k = t.shape
        if granularity == "tensor":
            scale = scale.reshape(1)
        elif granularity == "channel":
            scale = scale.reshape(n, 1)
        inp = tensors.get(f"{name}.input_scale")
        out[name] = Fp8Weight(
            weight=t,
            weight_scale=scale,
            granularity=granularity,
            block_size=block,
            input_scale=None if inp is None else inp.float().reshape(1),
        )
    return out


def read_kv_scales(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """{attention module name: (k_scale, v_scale)} from a checkpoint's tensors."""
    out = {}
    for key, t in tensors.items():
        if key.endswith(".k_scale"):
            attn = key[: -len(".k_scale")]
            v = tensors.get(f"{attn}.v_scale")
            if v is None:
                raise BadInput(f"checkpoint has {key} but no {attn}.v_scale")
            out[attn] = (float(t.reshape(-1)[0]), float(v.reshape(-1)[0]))
    return out


# ---------------------------------------------------------------- registry entries


def _check(fmt: str) -> Any:
    def check(scheme: Fp8Scheme, quantized: Mapping[str, Fp8Weight]) -> None:
        check_fp8_format(scheme, fmt)

    return check


def _matches_ct(quant_config: Mapping[str, Any]) -> bool:
    return quant_config.get("quant_method") == "compressed-tensors" and quant_config.get("format") == CT_FLOAT_FORMAT


def _matches_native(quant_config: Mapping[str, Any]) -> bool:
    return quant_config.get("quant_method") == "fp8"


def _ct_tensors(name: str, w: Fp8Weight, model_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return layer_tensors(name, w, "compressed-tensors")  # fp32 scales: exact, and what vLLM keeps


def _native_tensors(name: str, w: Fp8Weight, model_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return layer_tensors(name, w, "fp8")


def _ct_config(scheme: Fp8Scheme, ignore: Iterable[str]) -> dict[str, Any]:
    return quantization_config(scheme, "compressed-tensors", ignore)


def _native_config(scheme: Fp8Scheme, ignore: Iterable[str]) -> dict[str, Any]:
    return quantization_config(scheme, "fp8", ignore)


# Declared as codecs ("compressed-tensors", "fp8") and ("fp8", "fp8") of the FP8 format (formats/fp8).
CT_FORMAT = CheckpointFormat(
    name="compressed-tensors",
    kind="fp8",
    suffixes=("weight", "weight_scale", "input_scale"),
    config=_ct_config,
    tensors=_ct_tensors,
    read=read_fp8_layers,
    matches=_matches_ct,
    check=_check("compressed-tensors"),
    activations_quantized=group_quantizes_inputs,
)
NATIVE_FORMAT = CheckpointFormat(
    name="fp8",
    kind="fp8",
    suffixes=("weight", "weight_scale", "weight_scale_inv", "input_scale"),
    config=_native_config,
    tensors=_native_tensors,
    read=read_fp8_layers,
    matches=_matches_native,
    check=_check("fp8"),
    activations_quantized=lambda qc: qc.get("activation_scheme") in ("dynamic", "static"),
)
