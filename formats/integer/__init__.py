"""INT k-bit weights (2..8 bits, groups along K, symmetric or with zero points), and W8A8:
int8 weights per output channel with int8 activations per token or per tensor.

Numerics: `packers/rtn.py` (the grid and its qparams); weight type `packers/quantized.
QuantizedWeight`; codecs: compressed-tensors `pack-quantized` (`packers/codecs/compressed_tensors.py`)
and `int-quantized` for W8A8 (`packers/codecs/int_quantized.py`), AutoAWQ GEMM (`packers/codecs/awq_gemm.py`),
GPTQ v1 (`packers/codecs/gptq_v1.py`); activations as deployed: `deployed.py`; kernels: INT4
`kernels/w4a16.py`, int8 activations `kernels/int8_act.py`.
"""

from infer_tool.formats.base import NumberFormat, Preset
from infer_tool.schemes.integer import (
    W8A8_KIND,
    AutoRoundScheme,
    AWQGPTQScheme,
    AWQScheme,
    GPTQScheme,
    RTNScheme,
)

FORMAT = NumberFormat(
    name="int",
    kinds=("int", W8A8_KIND),
    schemes=(RTNScheme, GPTQScheme, AWQScheme, AWQGPTQScheme, AutoRoundScheme),
    presets=(
        Preset(
            "W4A16",
            None,
            {"bits": 4, "group_size": 128, "symmetric": True},
            "int4 symmetric weights, one scale per 128 inputs; activations unquantized",
        ),
        Preset(
            "W4A16_ASYM",
            None,
            {"bits": 4, "group_size": 128, "symmetric": False},
            "int4 asymmetric weights (scale and zero point per 128 inputs); activations unquantized",
        ),
        Preset(
            "W8A16",
            None,
            {"bits": 8, "group_size": 128, "symmetric": True},
            "int8 symmetric weights, one scale per 128 inputs; activations unquantized",
        ),
        Preset(
            "W8A8",
            "gptq",
            {"bits": 8, "group_size": -1, "symmetric": True, "int8_activations": "dynamic"},
            "int8 symmetric weights per output channel; int8 symmetric activations per token, dynamic",
        ),
        Preset(
            "INT8",
            "gptq",
            {"bits": 8, "group_size": -1, "symmetric": True, "int8_activations": "dynamic"},
            "llm-compressor's alias of W8A8",
        ),
    ),
    codecs={
        ("compressed-tensors", "int"): "infer_tool.packers.codecs.compressed_tensors:FORMAT",
        ("awq", "int"): "infer_tool.packers.codecs.awq_gemm:FORMAT",
        ("gptq", "int"): "infer_tool.packers.codecs.gptq_v1:FORMAT",
        ("compressed-tensors", W8A8_KIND): "infer_tool.packers.codecs.int_quantized:FORMAT",
    },
    quantizers=(
        "infer_tool.calib.quantizers.rtn",
        "infer_tool.calib.quantizers.gptq",
        "infer_tool.calib.quantizers.awq",
        "infer_tool.calib.quantizers.awq_gptq",
        "infer_tool.calib.quantizers.autoround",
    ),
    deployed="infer_tool.formats.integer.deployed",
    kernel="infer_tool.kernels.w4a16",
)
