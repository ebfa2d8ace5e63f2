"""Weight bytes of a model in a given storage dtype, from its parameter count.

- bf16 / fp16: 2 bytes per parameter.
- fp8 / int8: quantizable linears 1 byte per weight + one fp32 scale per output channel
  (exactly the int8 `weight` and `weight_scale` of the W8A8 `int-quantized` checkpoints
  `quantize` writes; a static `input_scale` adds 4 bytes per linear, not counted);
  everything else (embeddings, lm_head, norms, routers) stays 16-bit.
- int4: quantizable linears 4 bits per weight + per group of `group_size` inputs an
  fp16 scale and a 4-bit zero point (AWQ/GPTQ store zeros packed 8 per int32);
  `group_size` -1 means one group per output channel. Everything else 16-bit.
- nvfp4 / nvfp4a16 (compressed-tensors NVFP4, W4A4 / weights only): quantizable linears
  4 bits per weight (`weight_packed`) + one E4M3 byte per 16 inputs (`weight_scale`) + a
  float32 `weight_global_scale`, and for W4A4 a float32 `input_global_scale`;
  mxfp4 / mxfp4a16: 4 bits per weight + one E8M0 byte per 32 inputs, nothing per tensor.
  K not a multiple of the group is rounded up (FP4 quantizers refuse such linears). Everything
  else 16-bit.
"""

from __future__ import annotations

from dataclasses import dataclass

from infer_tool.common.errors import BadInput
from infer_tool.sizing.shape import ParamCount

WEIGHT_DTYPES = ("bf16", "fp16", "fp8", "int8", "int4", "nvfp4", "nvfp4a16", "mxfp4", "mxfp4a16")
# FP4 dtype -> (inputs per 1-byte scale, float32 scalars per linear)
FP4_LAYOUT = {"nvfp4": (16, 2), "nvfp4a16": (16, 1), "mxfp4": (32, 0), "mxfp4a16": (32, 0)}
UNQUANTIZED_BYTES = 2  # serving dtype of what is not quantized


@dataclass(frozen=True)
class WeightBytes:
    total: int
    quantized: int  # bytes of the packed linears incl. their scales / zero points
    unquantized: int
    how: str


def weight_bytes(params: ParamCount, dtype: str, group_size: int = 128) -> WeightBytes:
    """Bytes of all weights of one model replica stored as `dtype`."""
    dtype = dtype.lower()
    if dtype not in WEIGHT_DTYPES:
        raise BadInput(f"--weights {dtype!r} not known; accepted: {', '.join(WEIGHT_DTYPES)}")
    if dtype in ("bf16", "fp16"):
        total = params.total * UNQUANTIZED_BYTES
        return WeightBytes(total, 0, total, f"{params.total:,} params x 2 B")
    if group_size == 0 or group_size < -1:
        raise BadInput(f"--group-size {group_size} not valid; accepted: a positive integer or -1 (per channel)")
    quant = 0
    kept = params.other
    for lin in params.linears:
        n, k = lin.out_features, lin.in_features
        if not lin.quantizable:
            kept += n * k * lin.count
            continue
        if dtype in ("fp8", "int8"):
            one = n * k + 4 * n  # 1 B weights + fp32 channel scales
        elif dtype in FP4_LAYOUT:
            group, scalars = FP4_LAYOUT[dtype]
            one = n * -(-k // 2) + n * -(-k // group) + 4 * scalars  # E2M1 pairs + 1 B group scales + fp32 scalars
        else:
            groups = 1 if group_size == -1 else -(-k // group_size)
            one = -(-(n * k) // 2) + n * groups * 2 + -(-(n * groups) // 2)  # int4 + fp16 scale + 4-bit zero
        quant += one * lin.count
    unq = kept * UNQUANTIZED_BYTES
    detail = "channel scales" if dtype != "int4" else f"group {group_size} fp16 scales + 4-bit zeros"
    if dtype in FP4_LAYOUT:
        group, scalars = FP4_LAYOUT[dtype]
        scale = "E4M3" if dtype.startswith("nv") else "E8M0"
        per_tensor = {2: ", fp32 weight and input global scales", 1: ", fp32 global scale", 0: ""}[scalars]
        detail = f"E2M1 values, {scale} scale per {group}{per_tensor}"
    return WeightBytes(quant + unq, quant, unq, f"{dtype} linears ({detail}), rest 16-bit")
