"""GPTQ v1 checkpoints (AutoGPTQ / GPTQModel `checkpoint_format: "gptq"`, read by vLLM's
gptq / gptq_marlin). `quantize --format gptq` writes symmetric only (vLLM's fast path needs
`sym: true`); `convert --to gptq` also carries an asymmetric compressed-tensors checkpoint
whose zero points are all >= 1 (v1's "zero minus one" storage cannot hold a zero point of 0).

Per quantized linear `name` (weight (N, K), G groups), b in {2, 4, 8}:
- `name.qweight` int32 (K·b/32, N): packed along the INPUT dim, row k in word k·b//32 at
                 bits (k·b) % 32 (sequential).
- `name.qzeros`  int32 (G, N·b/32): (zero - 1) packed along the output dim, sequential.
- `name.scales`  fp16 (G, N).
- `name.g_idx`   int32 (K,): the group of input row k (k // g unless dynamic act-order).
Dequantization: W[n, k] = (q[k, n] - (qz[g_idx[k], n] + 1)) · s[g_idx[k], n].
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from infer_tool.common.errors import BadInput
from infer_tool.packers.checkpoint import CheckpointFormat
from infer_tool.packers.int_weight import QuantizedWeight
from infer_tool.packers.packing import pack_int32, unpack_int32
from infer_tool.schemes.integer import QuantScheme

SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


def check(scheme: QuantScheme, quantized: Mapping[str, QuantizedWeight]) -> None:
    if not scheme.symmetric:
        raise BadInput(
            "--format gptq writes symmetric weights only (vLLM's fast GPTQ path needs sym); "
            "for asymmetric use --format awq or --format compressed-tensors"
        )
    if scheme.bits not in (2, 4, 8):
        raise BadInput(f"bits={scheme.bits}: our GPTQ writer packs 2, 4 or 8 bits")
    for name, qw in quantized.items():
        if qw.zero is not None:
            raise BadInput(
                f"{name}: asymmetric result cannot be written as GPTQ v1; use --format awq or compressed-tensors"
            )
        if (qw.shape[1] * qw.bits) % 32:
            raise BadInput(f"{name}: K={qw.shape[1]} input features do not fill whole int32 words")


def _desc_act(scheme: QuantScheme) -> bool:
    return bool(getattr(scheme, "act_order", False)) and not bool(getattr(scheme, "static_groups", True))


def quantization_config(scheme: QuantScheme, ignore: Sequence[str]) -> dict[str, Any]:
    return {
        "quant_method": "gptq",
        "checkpoint_format": "gptq",
        "bits": scheme.bits,
        "group_size": scheme.group_size,
        "sym": bool(scheme.symmetric),  # the writer refuses asymmetric; convert carries it
        "desc_act": _desc_act(scheme),
        "static_groups": bool(getattr(scheme, "act_order", False)) and not _desc_act(scheme),
        "damp_percent": getattr(scheme, "damp", None),
        "true_sequential": True,
        "lm_head": "lm_head" not in ignore,
        "modules_to_not_convert": list(ignore),
    }


def layer_tensors(name: str, qw: QuantizedWeight, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of one quantized linear `name` (scales are fp16 whatever the model dtype)."""
    b = qw.bits
    return {
        f"{name}.qweight": pack_int32(qw.q.T, b, dim=0),  # (K·b/32, N)
        f"{name}.qzeros": pack_int32((qw.zero_points() - 1).T, b, dim=1),  # (G, N·b/32)
        f"{name}.scales": qw.scale.T.to(torch.float16),  # (G, N)
        f"{name}.g_idx": qw.group_index().to(torch.int32),  # (K,)
    }


def read_layers(tensors: Mapping[str, torch.Tensor], quant_config: Mapping[str, Any]) -> dict[str, QuantizedWeight]:
    """{linear name: QuantizedWeight} for every `*.qweight` in `tensors`."""
    bits = int(quant_config["bits"])
    out = {}
    for key in sorted(tensors):
        if not key.endswith(".qweight"):
            continue
        name = key[: -len(".qweight")]
        scales = tensors[f"{name}.scales"].float()  # (G, N)
        G, n = scales.shape
        k = tensors[key].shape[0] * 32 // bits
        zero = unpack_int32(tensors[f"{name}.qzeros"], bits, dim=1, size=n).to(torch.int32) + 1  # (G, N)
        g_idx = tensors.get(f"{name}.g_idx")
        group_size = k // G
        qw = QuantizedWeight(
            q=unpack_int32(tensors[key], bits, dim=0, size=k).T.contiguous(),
            scale=scales.T.contiguous(),
            zero=None,
            g_idx=None if g_idx is None else g_idx.to(torch.int32),
            bits=bits,
            group_size=group_size,
        )
        if not bool((zero == 1 << (bits - 1)).all()):
            if bool((zero > (1 << bits) - 1).any()):
                raise BadInput(f"{name}: a zero point of 0 is stored as -1 in GPTQ v1 and cannot be read back")
            qw.zero = zero.T.to(torch.uint8).contiguous()
        if qw.has_trivial_g_idx():
            qw.g_idx = None
        out[name] = qw
    return out


def matches(quant_config: Mapping[str, Any]) -> bool:
    return quant_config.get("quant_method") == "gptq" and quant_config.get("checkpoint_format", "gptq") == "gptq"


FORMAT = CheckpointFormat(
    name="gptq",
    kind="int",
    suffixes=SUFFIXES,
    config=quantization_config,
    tensors=layer_tensors,
    read=read_layers,
    matches=matches,
    check=check,
    scale_dtype="float16",
)
