"""FP8 e4m3 weights per tensor, output channel or block, with e4m3 activations (dynamic per
token or static per tensor) and an optional FP8 KV cache.

Numerics and weight type: `packers/fp8.py` (`Fp8Weight`); codecs: compressed-tensors
`float-quantized` and native `fp8` (`packers/codecs/fp8_formats.py`); activations as deployed:
`deployed.py`; kernel: `kernels/fp8.py`.
"""

from infer_tool.formats.base import NumberFormat, Preset
from infer_tool.schemes.fp8 import Fp8Scheme

FORMAT = NumberFormat(
    name="fp8",
    kinds=("fp8",),
    schemes=(Fp8Scheme,),
    presets=(
        Preset(
            "FP8",
            "fp8",
            {"granularity": "tensor", "activations": "static"},
            "fp8 e4m3 weights per tensor; fp8 activations per tensor, static (calibrated)",
        ),
        Preset(
            "FP8_DYNAMIC",
            "fp8",
            {"granularity": "channel", "activations": "dynamic"},
            "fp8 e4m3 weights per output channel; fp8 activations per token, dynamic",
        ),
        Preset(
            "FP8_BLOCK",
            "fp8",
            {"granularity": "block", "activations": "dynamic"},
            "fp8 e4m3 weights per 128x128 block; fp8 activations dynamic "
            "(ours written per token, llm-compressor's per 128-channel group)",
        ),
    ),
    codecs={
        ("compressed-tensors", "fp8"): "infer_tool.packers.codecs.fp8_formats:CT_FORMAT",
        ("fp8", "fp8"): "infer_tool.packers.codecs.fp8_formats:NATIVE_FORMAT",
    },
    quantizers=("infer_tool.calib.quantizers.fp8",),
    deployed="infer_tool.formats.fp8.deployed",
    kernel="infer_tool.kernels.fp8",
)
