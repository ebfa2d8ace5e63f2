"""The model-free path's one door to the number formats: every solver, weight type and format
writer `quantize --model-free` (and `convert`) calls is imported here and nowhere else in
those jobs, so that a change in `packers/` (formats by composition) is met in this module.

`TensorCodec` quantizes one weight `(N, K)` into its checkpoint tensors, as the layer pipeline
would (the same solver, the same scheme with scales rounded to the checkpoint dtype, the same
format writer): INT RTN -> compressed-tensors pack-quantized, FP8 -> float-quantized, FP4 RTN
-> nvfp4- / mxfp4-pack-quantized. What it does not know: tensor names beyond a module name,
files, shards, models.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from infer_tool.calib.quantizers import quantizer_for
from infer_tool.common.errors import BadInput
from infer_tool.packers.checkpoint import CheckpointFormat, get_format
from infer_tool.packers.fp8 import expand_scale
from infer_tool.schemes.base import Scheme
from infer_tool.schemes.fp8 import Fp8Scheme

FORMAT_NAME = "compressed-tensors"
EXACT_IN_FLOAT32 = (torch.float32, torch.bfloat16, torch.float16)


# What a quantizer's `Needs` reads from calibration text, in a refusal's words.
NEEDS_WORDS = {
    "hessian": "a Hessian",
    "activation_stats": "activation statistics (static input scales)",
    "live_blocks": "live block outputs",
    "layer_pass": "a pass over the quantized layer (KV-cache scales)",
    "fp_chain": "the fp model's layer outputs",
    "fp_inputs": "the fp model's layer inputs",
    "channel_max": "per-channel activation maxima",
}


def refusal(scheme: Scheme) -> str | None:
    """Why `scheme` cannot run without the model (its quantizer reads calibration text), or None."""
    needs = quantizer_for(scheme).needs(scheme)
    if needs.data_free:
        return None
    reads = [words for field, words in NEEDS_WORDS.items() if getattr(needs, field)]
    return f"{scheme.describe()} reads {', '.join(reads)} from calibration text"


@dataclass(frozen=True)
class TensorCodec:
    """One scheme, stored in one checkpoint dtype: quantize a weight into its tensors with the
    scheme's own layer quantizer (`solve_data_free`, the pipeline's solve without statistics)."""

    scheme: Scheme
    fmt: CheckpointFormat
    dtype: torch.dtype
    quantizer: Any

    @classmethod
    def open(cls, scheme: Scheme, dtype_name: str) -> TensorCodec:
        fmt = get_format(FORMAT_NAME, scheme.kind)
        fmt.check(scheme, {})
        stored = scheme.for_storage(fmt.scale_dtype or dtype_name)
        return cls(stored, fmt, getattr(torch, dtype_name), quantizer_for(stored))

    @property
    def kind(self) -> str:
        return self.scheme.kind

    @property
    def shares_global_scale(self) -> bool:
        """True when fused shards share a parameter (NVFP4's global scale)."""
        return self.quantizer.shares_fused(self.scheme)

    def shape_refusal(self, n: int, k: int) -> str | None:
        """Why a weight (N, K) cannot take this scheme (the scheme's own `check_shapes`), or None."""
        try:
            self.scheme.check_shapes({"weight": (n, k)})
        except BadInput as e:
            return str(e)
        return None

    def global_scale(self, weights: Sequence[torch.Tensor]) -> Any:
        """What the fused shards `weights` (each (N_i, K)) share (NVFP4's global scale); else None."""
        # bfloat16 / float16 / float32 convert to float32 exactly: the quantizer's own cast of them
        # (to its amax dtype) gives what it gives from float32, without a float32 copy first.
        return self.quantizer.fused_share(
            [w if w.dtype in EXACT_IN_FLOAT32 else w.float() for w in weights], self.scheme
        )

    def quantize(self, module: str, weight: torch.Tensor, global_scale: Any = None) -> dict:
        """{tensor name: tensor} of the quantized linear `module` from its weight (N, K)."""
        q = self.quantizer.solve_data_free(weight.float(), self.scheme, module, global_scale)
        return self.fmt.tensors(module, q, self.dtype)

    def config(self, ignore: Sequence[str]) -> dict[str, Any]:
        """The checkpoint's `quantization_config`."""
        return self.fmt.config(self.scheme, sorted(set(ignore)))

    def describe(self) -> str:
        return self.scheme.describe()


# ---------------------------------------------------------------- already-quantized inputs


def fp8_source(quant_config: Mapping[str, Any] | None) -> tuple[int, int] | None:
    """The block (bn, bk) of a native FP8 block checkpoint's config (`quant_method: fp8`,
    `weight_block_size`); (0, 0) for native per-tensor FP8; None when not quantized; BadInput
    for other quantized inputs."""
    if not quant_config:
        return None
    if quant_config.get("quant_method") != "fp8":
        raise BadInput(
            f"the source is already quantized (quant_method {quant_config.get('quant_method')!r}); --model-free "
            "reads unquantized weights and native FP8 (quant_method fp8) checkpoints"
        )
    block = quant_config.get("weight_block_size")
    if block is None:
        return (0, 0)
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise BadInput(f"the source's weight_block_size {block!r} is not two positive integers")
    return (block[0], block[1])


def dequantize_fp8(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """A native FP8 weight (N, K) e4m3 times its `weight_scale_inv` `(ceil(N/bn), ceil(K/bk))`
    (block) or scalar `weight_scale` (block (0, 0)), in float32, cast to `dtype`."""
    n, k = weight.shape
    if block == (0, 0):
        return (weight.float() * scale.float().reshape(())).to(dtype)
    want = (math.ceil(n / block[0]), math.ceil(k / block[1]))
    if tuple(scale.shape) != want:
        raise BadInput(f"an FP8 block scale of shape {tuple(scale.shape)} does not cover a weight {n}x{k} ({want})")
    full = expand_scale(scale.float(), "block", (n, k), block)
    return (weight.float() * full).to(dtype)


# ---------------------------------------------------------------- convert: other formats -> compressed-tensors

SOURCE_SCALE_DTYPE = torch.float16  # AutoAWQ's and GPTQ v1's scales: kept as they are (lossless)


@dataclass(frozen=True)
class Conversion:
    """A source checkpoint format read linear by linear and written as compressed-tensors.

    suffixes: the tensor suffixes one source linear owns; anchor: the suffix whose tensor marks
    a linear (`qweight`, or `weight` of dtype float8_e4m3fn)."""

    source: CheckpointFormat
    target: CheckpointFormat
    scheme: Scheme
    quant_config: Mapping[str, Any]
    anchor: str
    scale_dtype: torch.dtype
    normalize: Callable[[str, Any, Any], Any] = lambda module, w, scheme: w  # source weight -> what the target carries
    tally: dict[str, int] = field(default_factory=dict)  # what `notes` reports, counted by `normalize`

    @property
    def suffixes(self) -> tuple[str, ...]:
        return self.source.suffixes

    def convert(self, module: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The compressed-tensors tensors of source linear `module` from its source tensors."""
        layers = self.source.read(tensors, self.quant_config)
        if module not in layers:
            raise BadInput(f"{module}: its tensors do not make a {self.source.name} linear")
        w = self.normalize(module, layers[module], self.scheme)
        return self.target.tensors(module, w, self.scale_dtype)

    def config(self, ignore: Sequence[str]) -> dict[str, Any]:
        return self.target.config(self.scheme, sorted(set(ignore)))

    def notes(self) -> list[str]:
        """What the report says beyond the counts (ModelOpt's global scales: which equalities hold)."""
        t = self.tally
        if not t.get("linears"):
            return []
        n = t["linears"]
        return [
            f"ModelOpt weight_scale_2 (a multiplier) carried as compressed-tensors' divisor weight_global_scale: "
            f"codes and E4M3 block scales byte for byte in all {n} linears; 1 / global_scale equals weight_scale_2 "
            f"exactly (vLLM dequantizes the same weights) in {t['reciprocal_exact']} of {n}; s / global_scale equals "
            f"s * weight_scale_2 for every block scale (compressed-tensors' dequantization bit for bit) in "
            f"{t['division_exact']} of {n}; float32 has no divisor doing so for the others, whose effective "
            "scales s / global_scale differ from ModelOpt's by float32 rounding (at most 2^-22 relative)"
        ]


def _fp4_for_ct(tally: dict[str, int]) -> Callable[[str, Any, Any], Any]:
    """Count which equalities a ModelOpt NVFP4 weight's carried global scale keeps."""

    def normalize(module: str, w: Any, scheme: Any) -> Any:
        tally["linears"] = tally.get("linears", 0) + 1
        for key in ("reciprocal_exact", "division_exact"):
            tally[key] = tally.get(key, 0) + int(bool(w.info.get(key)))
        return w

    return normalize


def _int_for_ct(module: str, w: Any, scheme: Any) -> Any:
    """An INT source weight as compressed-tensors carries it: static groups only; asymmetric
    configs store every zero point, symmetric ones none."""
    if not w.has_trivial_g_idx():
        raise BadInput(
            f"{module}: act-order with a g_idx that reorders groups cannot be carried by compressed-tensors "
            "pack-quantized (compressed-tensors no longer loads dynamic-group checkpoints); keep the GPTQ checkpoint"
        )
    w.g_idx = None
    if scheme.symmetric and w.zero is not None:
        if not bool((w.zero == 1 << (w.bits - 1)).all()):
            raise BadInput(f"{module}: the config says symmetric, but its zero points are not all {1 << (w.bits - 1)}")
        w.zero = None
    if not scheme.symmetric and w.zero is None:
        w.zero = torch.full(w.scale.shape, 1 << (w.bits - 1), dtype=torch.uint8)
    return w


TARGETS = ("compressed-tensors", "awq", "gptq", "fp8")  # `convert --to`
BACK_TARGETS = {"awq": "AutoAWQ GEMM", "gptq": "GPTQ v1", "fp8": "native FP8 (quant_method fp8)"}


def conversion(quant_config: Mapping[str, Any] | None, target: str) -> Conversion:
    """The conversion of a checkpoint with `quant_config` to format `target`; BadInput naming
    why when it cannot be carried."""
    from infer_tool.packers.checkpoint import format_of
    from infer_tool.schemes.registry import make_scheme

    if target not in TARGETS:
        raise BadInput(f"--to {target!r} is not supported; use --to {', '.join(TARGETS)}")
    if not quant_config:
        raise BadInput("the source is not quantized (config.json has no quantization_config); use quantize")
    method = quant_config.get("quant_method")
    if target != "compressed-tensors":
        return _back_conversion(quant_config, target)
    if method == "compressed-tensors":
        raise BadInput("the source is already compressed-tensors")
    if method not in ("awq", "gptq", "fp8", "modelopt"):
        raise BadInput(
            f"quant_method {method!r} is not a format convert reads; it reads awq (GEMM), gptq (v1), fp8 (native) "
            "and modelopt (NVFP4, FP8)"
        )
    if method == "modelopt":
        from infer_tool.packers.codecs import modelopt_fp8
        from infer_tool.packers.codecs.modelopt_nvfp4 import ALGOS, ANCHOR, matches, settings, w4a4

        if modelopt_fp8.matches(quant_config):  # per-tensor e4m3 weights, static input scales: a copy
            scheme = Fp8Scheme(granularity="tensor", activations="static")
            return Conversion(
                format_of(quant_config), get_format(FORMAT_NAME, "fp8"), scheme, quant_config, "weight", torch.float32
            )
        if not matches(quant_config):
            raise BadInput(
                f"ModelOpt quant_algo {settings(quant_config)[0]!r} is not one convert reads; it reads "
                f"{', '.join((*ALGOS, modelopt_fp8.ALGO))}"
            )
    source = format_of(quant_config)
    if method == "modelopt":
        scheme = make_scheme("rtn", fp4="nvfp4", fp4_activations="fp4" if w4a4(quant_config) else "none")
        tally: dict[str, int] = {}
        return Conversion(
            source,
            get_format(FORMAT_NAME, "fp4"),
            scheme,
            quant_config,
            ANCHOR,
            torch.float32,
            _fp4_for_ct(tally),
            tally,
        )
    if method == "fp8":
        block = quant_config.get("weight_block_size")
        act = quant_config.get("activation_scheme", "dynamic")
        scheme = Fp8Scheme(
            granularity="block" if block else "tensor",
            block_size=tuple(block) if block else (128, 128),
            activations=act,
        )
        return Conversion(source, get_format(FORMAT_NAME, "fp8"), scheme, quant_config, "weight", torch.float32)
    bits = int(quant_config.get("bits", quant_config.get("w_bit", 4)))
    group = int(quant_config.get("group_size", quant_config.get("q_group_size", 128)))
    if method == "awq":
        symmetric = not bool(quant_config.get("zero_point", True))
    else:
        symmetric = bool(quant_config.get("sym", True))
    if bits not in (2, 4, 8):
        raise BadInput(f"{method} with {bits}-bit weights: compressed-tensors pack-quantized holds 2, 4 or 8 bits")
    scheme = make_scheme("rtn", bits=bits, group_size=group, symmetric=symmetric)
    return Conversion(
        source, get_format(FORMAT_NAME, "int"), scheme, quant_config, "qweight", SOURCE_SCALE_DTYPE, _int_for_ct
    )


# ---------------------------------------------------------------- convert back: compressed-tensors -> AWQ, GPTQ, FP8


def _ct_weight_group(quant_config: Mapping[str, Any], target: str) -> dict[str, Any]:
    """The one weight group of a compressed-tensors source, refused naming why when `target`
    cannot carry it (several groups, quantized activations the target does not run)."""
    groups = list((quant_config.get("config_groups") or {}).values())
    if len(groups) != 1 or not isinstance(groups[0], Mapping):
        raise BadInput(
            f"the source has {len(groups)} compressed-tensors config groups (mixed precision); "
            f"{BACK_TARGETS[target]} holds one scheme for every linear"
        )
    return dict(groups[0])


def _fp16_scales(module: str, scale: torch.Tensor, target: str) -> None:
    """AutoAWQ and GPTQ v1 store float16 scales: refuse a scale float16 does not hold exactly."""
    back = scale.to(torch.float16).float()
    bad = ~((back == scale) & torch.isfinite(back))
    if bool(bad.any()):
        v = float(scale[bad][0])
        raise BadInput(
            f"{module}: scale {v!r} is not a float16 value, and {BACK_TARGETS[target]} stores float16 scales; "
            "converting would round it (keep compressed-tensors, or quantize again with --dtype float16)"
        )


def _int_for_back(target: str) -> Callable[[str, Any, Any], Any]:
    """A compressed-tensors INT weight as AutoAWQ GEMM or GPTQ v1 carries it, or BadInput naming why."""

    def normalize(module: str, w: Any, scheme: Any) -> Any:
        n, k = w.shape
        _fp16_scales(module, w.scale, target)
        if target == "awq":
            if n % 8:
                raise BadInput(f"{module}: N={n} output features is not a multiple of 8, which AWQ GEMM packs")
            return w
        if (k * w.bits) % 32:
            raise BadInput(f"{module}: K={k} input features do not fill whole int32 words of {w.bits}-bit codes")
        if w.zero is not None and bool((w.zero == 0).any()):
            raise BadInput(
                f"{module}: a zero point of 0, which GPTQ v1 stores as zero - 1 = -1 and cannot hold "
                "(keep compressed-tensors, or --to awq for 4 bits)"
            )
        return w

    return normalize


def _back_conversion(quant_config: Mapping[str, Any], target: str) -> Conversion:
    """compressed-tensors -> AutoAWQ GEMM (4-bit groups), GPTQ v1 (2/4/8-bit groups or channels,
    symmetric or not) or native FP8 (per tensor or per block); BadInput naming what the target
    cannot carry."""
    from infer_tool.packers.checkpoint import format_of
    from infer_tool.schemes.registry import make_scheme

    method = quant_config.get("quant_method")
    if method != "compressed-tensors":
        raise BadInput(
            f"--to {target} converts compressed-tensors checkpoints; the source is quant_method {method!r} "
            "(convert it --to compressed-tensors first)"
        )
    group = _ct_weight_group(quant_config, target)
    weights = group.get("weights") or {}
    source = format_of(quant_config)
    fmt = quant_config.get("format")
    wtype, bits = weights.get("type"), weights.get("num_bits")
    if target == "fp8":
        if source.kind != "fp8":
            raise BadInput(
                f"native FP8 holds e4m3 weights with float32 scales; the source's weights are {bits}-bit "
                f"{wtype} ({fmt})"
            )
        strategy = weights.get("strategy")
        acts = group.get("input_activations") or {}
        activations = "static" if acts and not acts.get("dynamic", True) else "dynamic"
        if strategy == "channel":
            raise BadInput(
                "the source's FP8 weights have one scale per output channel; native FP8 (vLLM's Fp8Config) "
                "holds one scale per tensor or per 128x128-style block only (keep compressed-tensors)"
            )
        if strategy not in ("tensor", "block"):
            raise BadInput(f"FP8 weight strategy {strategy!r} has no native FP8 layout; it holds tensor or block")
        if strategy == "block" and activations == "static":
            raise BadInput(
                "the source has block FP8 weights with static activation scales; native FP8 blocks go with "
                "dynamic activations only"
            )
        block = weights.get("block_structure") or [128, 128]
        scheme = Fp8Scheme(granularity=strategy, block_size=tuple(block), activations=activations)
        return Conversion(source, get_format("fp8", "fp8"), scheme, quant_config, "weight", torch.float32)
    name = BACK_TARGETS[target]
    if group.get("input_activations"):
        raise BadInput(f"the source quantizes activations too; {name} is a weight-only format")
    if source.kind != "int" or wtype != "int" or fmt != "pack-quantized":
        what = f"{bits}-bit {wtype} weights ({fmt})"
        if fmt and "fp4" in str(fmt):
            what += ": E2M1 codes with E4M3 (or E8M0) block scales, no integer grid"
        raise BadInput(f"{name} holds integer codes with float16 group scales; the source has {what}")
    bits = int(bits)
    if weights.get("strategy") not in ("group", "channel"):
        raise BadInput(f"INT weight strategy {weights.get('strategy')!r}: {name} holds group or per-channel scales")
    channel = weights.get("strategy") == "channel"
    size = -1 if channel else int(weights.get("group_size") or 0)
    symmetric = bool(weights.get("symmetric", True))
    if target == "awq":
        if bits != 4:
            raise BadInput(f"AutoAWQ GEMM holds 4-bit weights; the source's are {bits}-bit (use --to gptq)")
        if channel:
            raise BadInput(
                "AutoAWQ GEMM holds group scales; the source has one scale per output channel (use --to gptq)"
            )
    elif bits not in (2, 4, 8):
        raise BadInput(f"GPTQ v1 holds 2, 4 or 8-bit weights; the source's are {bits}-bit")
    if weights.get("actorder") not in (None, "weight", "static"):
        raise BadInput(f"actorder {weights.get('actorder')!r}: only static groups convert")
    scheme = make_scheme("rtn", bits=bits, group_size=size, symmetric=symmetric)
    return Conversion(
        source, get_format(target, "int"), scheme, quant_config, "weight_packed", torch.float16, _int_for_back(target)
    )
