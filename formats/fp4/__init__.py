"""FP4 E2M1 weights (and W4A4 activations) in NVFP4 (an E4M3 scale per 16 along K and a float32
global scale) and MXFP4 (an E8M0 scale per 32) form.

Numerics: `packers/fp4.py` and `packers/fp4_solve.py`; weight type `packers/fp4_weight.Fp4Weight`;
codec: compressed-tensors `nvfp4-pack-quantized` / `mxfp4-pack-quantized` (`packers/codecs/fp4_format.py`);
activations as deployed: `deployed.py`; kernel: `kernels/fp4.py` (activations `kernels/fp4_act.py`).
"""

from infer_tool.formats.base import NumberFormat, Preset
from infer_tool.schemes.fp4 import FP4_SCHEMES, KIND

FORMAT = NumberFormat(
    name="fp4",
    kinds=(KIND,),
    schemes=FP4_SCHEMES,
    presets=(
        Preset(
            "NVFP4A16",
            None,
            {"fp4": "nvfp4", "fp4_activations": "none"},
            "fp4 e2m1 weights, an e4m3 scale per 16 inputs and a float32 global scale; activations unquantized",
        ),
        Preset(
            "NVFP4",
            None,
            {"fp4": "nvfp4", "fp4_activations": "fp4"},
            "NVFP4A16's weights; fp4 activations per 16 inputs, dynamic, with a calibrated global scale",
        ),
        Preset(
            "MXFP4A16",
            None,
            {"fp4": "mxfp4", "fp4_activations": "none"},
            "fp4 e2m1 weights, an e8m0 (power of two) scale per 32 inputs; activations unquantized",
        ),
        Preset(
            "MXFP4",
            None,
            {"fp4": "mxfp4", "fp4_activations": "fp4"},
            "MXFP4A16's weights; fp4 activations per 32 inputs, dynamic",
        ),
    ),
    codecs={("compressed-tensors", KIND): "infer_tool.packers.codecs.fp4_format:FORMAT"},
    quantizers=("infer_tool.calib.quantizers.fp4", "infer_tool.calib.quantizers.awq_gptq"),
    deployed="infer_tool.formats.fp4.deployed",
    kernel="infer_tool.kernels.fp4",
)
