"""Weight bytes of a model in a given storage dtype, from its parameter count.

- bf16 / fp16: 2 bytes per parameter.
- fp8 / int8: quantizable linears 1 byte per weight + one fp32 scale per output channel
  (exactly the int8 `weight` and `weight_scale` of the W8A8 `int-quantized` checkpoints
  `quantize` writes; a static `input_scale` adds 4 bytes per linear, not counted);
  everything else (embeddings, lm_head, norms, routers) stays 16-bit.
- int4: quantizable linears 4 bits per weight + per group of `group_size` inputs an
  fp16 scale and a 4-bit zero point (AWQ/GPTQ store zeros packed 8 per int32);
  `group_size` -1 means one group per output channel. Everything else 16-bit.
"""

from __future__ import annotations

from dataclasses import dataclass

from infer_tool.common.errors import BadInput
from infer_tool.sizing.shape import ParamCount

WEIGHT_DTYPES = ("bf16", "fp16", "fp8", "int8", "int4")
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
        else:
            groups = 1 if group_size == -1 else -(-k // group_size)
            one = -(-(n * k) // 2) + n * groups * 2 + -(-(n * groups) // 2)  # int4 + fp16 scale + 4-bit zero
        quant += one * lin.count
    unq = kept * UNQUANTIZED_BYTES
    detail = "channel scales" if dtype != "int4" else f"group {group_size} fp16 scales + 4-bit zeros"
    return WeightBytes(quant + unq, quant, unq, f"{dtype} linears ({detail}), rest 16-bit")
