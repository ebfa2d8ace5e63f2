"""W4AFP8: INT4 weights (symmetric, groups of 128, any INT method) with FP8 e4m3 activations per
token, as compressed-tensors 0.20 and llm-compressor define the `W4AFP8` preset and vLLM serves
it (CUTLASS W4A8-FP8 on Hopper). Composed, not restated: `scheme.py` (each INT method's scheme
with FP8 activations), `codec.py` (INT pack-quantized with FP8 input activations), `weight.py`
and `linear.py` (the INT4 weight and module, run as vLLM runs them: `numerics.py`),
`quantizer.py` (the INT quantizers), `deployed.py` (`--eval`).
"""

from infer_tool.formats.base import NumberFormat, Preset
from infer_tool.formats.w4afp8.scheme import GROUP_SIZE, KIND, SCHEMES

FORMAT = NumberFormat(
    name="w4afp8",
    kinds=(KIND,),
    schemes=SCHEMES,
    presets=(
        Preset(
            "W4AFP8",
            None,
            {"bits": 4, "group_size": GROUP_SIZE, "symmetric": True, "activations": "dynamic"},
            "int4 symmetric weights, one scale per 128 inputs; fp8 e4m3 activations per token, dynamic",
        ),
    ),
    codecs={("compressed-tensors", KIND): "infer_tool.formats.w4afp8.codec:FORMAT"},
    quantizers=("infer_tool.formats.w4afp8.quantizer",),
    deployed="infer_tool.formats.w4afp8.deployed",
    kernel="infer_tool.kernels.w4a16",
)
