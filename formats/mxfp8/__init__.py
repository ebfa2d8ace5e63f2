"""MXFP8: E4M3 weights with an E8M0 (power-of-two) scale per 32 inputs, weights only (MXFP8A16)
or with dynamic MXFP8 activations (MXFP8), as compressed-tensors 0.20 defines
`mxfp8-quantized`. Everything of the format is here: `scheme.py` (its schemes: RTN, GPTQ),
`numerics.py` (the grid), `solve.py` (its solvers), `weight.py` (`Mxfp8Weight`), `codec.py`
(the checkpoint format), `quantizer.py` (the pipeline's drivers), `deployed.py` (`--eval`),
`linear.py` (the evaluation module, on the FP8 GEMM `kernels/fp8.py` with (1, 32) blocks).
"""

from infer_tool.formats.base import NumberFormat, Preset
from infer_tool.formats.mxfp8.scheme import KIND, SCHEMES

FORMAT = NumberFormat(
    name="mxfp8",
    kinds=(KIND,),
    schemes=SCHEMES,
    presets=(
        Preset(
            "MXFP8A16",
            "rtn",
            {"mxfp8_activations": "none"},
            "fp8 e4m3 weights, an e8m0 (power of two) scale per 32 inputs; activations unquantized",
        ),
        Preset(
            "MXFP8",
            "rtn",
            {"mxfp8_activations": "mxfp8"},
            "MXFP8A16's weights; fp8 e4m3 activations with a dynamic e8m0 scale per 32",
        ),
    ),
    codecs={("compressed-tensors", KIND): "infer_tool.formats.mxfp8.codec:FORMAT"},
    quantizers=("infer_tool.formats.mxfp8.quantizer",),
    deployed="infer_tool.formats.mxfp8.deployed",
    kernel="infer_tool.kernels.fp8",
)
