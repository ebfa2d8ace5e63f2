"""W4AFP8 schemes: INT4 weights, symmetric, groups of 128 (any INT method's solve), with FP8
e4m3 activations quantized per token at run time, `kind = "w4afp8"` (compressed-tensors' and
llm-compressor's `W4AFP8` preset). Standard library only.

The format is a composition: each INT method's scheme (`schemes/integer.py`: its options and
defaults, unchanged) with `Fp8Activations`, one more option, `activations` (the `--fp8-activations`
flag FP8 schemes take): "dynamic", the only form vLLM's W4A8-FP8 kernel runs. The registry
picks these classes when that option is given with an INT method.
"""

from __future__ import annotations

from dataclasses import dataclass

from infer_tool.common.errors import BadInput
from infer_tool.schemes.integer import AutoRoundScheme, AWQGPTQScheme, AWQScheme, GPTQScheme, RTNScheme

KIND = "w4afp8"
GROUP_SIZE = 128  # vLLM's W4A8-FP8 kernel takes groups of 128 only


@dataclass(frozen=True)
class Fp8Activations:
    """FP8 per-token dynamic activations on an INT method's INT4 weights (see the module doc)."""

    activations: str = "dynamic"

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc]  # the INT method's checks
        if self.activations != "dynamic":
            raise BadInput(
                f"--fp8-activations {self.activations} with INT4 weights (W4AFP8) is not supported; use dynamic "
                "(per token, the only form vLLM's W4A8-FP8 kernel runs)"
            )
        got = (self.bits, self.group_size, self.symmetric)  # type: ignore[attr-defined]
        if got != (4, GROUP_SIZE, True):
            raise BadInput(
                f"W4AFP8 (FP8 activations on INT weights) needs 4-bit symmetric weights in groups of {GROUP_SIZE} "
                f"(--bits 4 --group-size {GROUP_SIZE} --sym, or --scheme W4AFP8), got bits={got[0]} "
                f"group_size={got[1]} {'sym' if got[2] else 'asym'}: vLLM's W4A8-FP8 kernel takes no other"
            )
        if self.int8_activations != "none" or self.smoothquant is not None:  # type: ignore[attr-defined]
            raise BadInput("W4AFP8's activations are FP8: drop --int8-activations / --smoothquant")

    @property
    def kind(self) -> str:
        return KIND

    def describe(self) -> str:
        return f"{super().describe()}, fp8 dynamic activations (W4AFP8)"  # type: ignore[misc]


@dataclass(frozen=True)
class W4Afp8RTNScheme(Fp8Activations, RTNScheme):
    """RTN's INT4 weights with FP8 activations."""


@dataclass(frozen=True)
class W4Afp8GPTQScheme(Fp8Activations, GPTQScheme):
    """GPTQ's INT4 weights with FP8 activations."""


@dataclass(frozen=True)
class W4Afp8AWQScheme(Fp8Activations, AWQScheme):
    """AWQ's INT4 weights with FP8 activations."""


@dataclass(frozen=True)
class W4Afp8AWQGPTQScheme(Fp8Activations, AWQGPTQScheme):
    """AWQ's scales and GPTQ's rounding of INT4 weights, with FP8 activations."""


@dataclass(frozen=True)
class W4Afp8AutoRoundScheme(Fp8Activations, AutoRoundScheme):
    """AutoRound's INT4 weights with FP8 activations."""


SCHEMES = (W4Afp8RTNScheme, W4Afp8GPTQScheme, W4Afp8AWQScheme, W4Afp8AWQGPTQScheme, W4Afp8AutoRoundScheme)
