"""compressed-tensors `pack-quantized` with FP8 activations: W4AFP8 as llm-compressor writes it
(compressed-tensors 0.20 `quantization/quant_scheme.py` `W4AFP8`) and vLLM reads it (its
`CompressedTensorsW4A8Fp8` on sm90, whose parameters are `weight_packed`). The tensors are INT
pack-quantized's (`packers/codecs/compressed_tensors.py`, written and read by it); the config's group
adds input activations `{num_bits: 8, type: "float", strategy: "token", dynamic: true,
symmetric: true}` and names its format, pack-quantized: compressed-tensors 0.20 otherwise infers
its unpacked `int-quantized` for INT weights with float activations, which vLLM's W4A8-FP8
scheme does not load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from infer_tool.common.errors import BadInput
from infer_tool.formats.w4afp8.scheme import KIND
from infer_tool.formats.w4afp8.weight import W4Afp8Weight
from infer_tool.packers.checkpoint import CheckpointFormat
from infer_tool.packers.codecs import compressed_tensors as pack_quantized

INPUTS = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "strategy": "token",
    "group_size": None,
    "dynamic": True,
    "observer": None,
}


def quantization_config(scheme: Any, ignore: Sequence[str]) -> dict[str, Any]:
    config = pack_quantized.quantization_config(scheme, ignore)
    group = config["config_groups"]["group_0"]
    group["input_activations"] = dict(INPUTS)
    group["format"] = pack_quantized.FORMAT_NAME  # compressed-tensors 0.20 would infer int-quantized
    return config


def fp8_inputs(quant_config: Mapping[str, Any]) -> bool:
    """True when a config group's input activations are FP8 (type float, 8 bits)."""
    groups = list(quant_config.get("config_groups", {}).values())
    inputs = [g.get("input_activations") or {} for g in groups]
    return any(i.get("type") == "float" and i.get("num_bits") == 8 for i in inputs)


def read_layers(tensors: Mapping[str, Any], quant_config: Mapping[str, Any]) -> dict[str, W4Afp8Weight]:
    inputs = list(quant_config["config_groups"].values())[0]["input_activations"]
    if (inputs.get("strategy"), inputs.get("dynamic")) != ("token", True):
        raise BadInput(
            f"FP8 input activations {inputs.get('strategy')!r} dynamic={inputs.get('dynamic')!r}: W4AFP8 is read "
            "with per-token dynamic ones (what vLLM's W4A8-FP8 kernel runs)"
        )
    return {n: W4Afp8Weight.of(w) for n, w in pack_quantized.read_layers(tensors, quant_config).items()}


def matches(quant_config: Mapping[str, Any]) -> bool:
    return (
        quant_config.get("quant_method") == "compressed-tensors"
        and quant_config.get("format") == pack_quantized.FORMAT_NAME
        and fp8_inputs(quant_config)
    )


FORMAT = CheckpointFormat(
    name="compressed-tensors",
    kind=KIND,
    suffixes=pack_quantized.SUFFIXES,
    config=quantization_config,
    tensors=pack_quantized.layer_tensors,
    read=read_layers,
    matches=matches,
    check=pack_quantized.check,
    activations_quantized=fp8_inputs,
)
