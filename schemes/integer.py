"""Integer weight schemes: `QuantScheme`, the number format every INT solver rounds to, and one
class per method composing it with that method's config (`schemes/methods.py`: RTN, GPTQ,
AWQ, AWQ then GPTQ, AutoRound).

A group of `group_size` consecutive input columns (along K) shares one scale and one zero
point; `group_size=-1` means one group per output row (per-channel). An INT scheme is
`kind = "int"` (weights only: the compressed-tensors `pack-quantized`, AWQ GEMM and GPTQ v1
formats carry it) unless its activations are quantized too: with `int8_activations` it is
W8A8, `kind = "w8a8"` (int8 weights per output channel and int8 activations; compressed-tensors
`int-quantized` carries it, as llm-compressor writes its W8A8 scheme).

`smoothquant` (Xiao et al. 2023) migrates activation outliers into the weights before RTN or
GPTQ quantizes them (`calib/quantizers/smoothquant.py`); it composes with any bit width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from infer_tool.common.errors import BadInput
from infer_tool.schemes.base import SCALE_DTYPES, Scheme, check_group_size
from infer_tool.schemes.methods import (
    AWQ_SEARCH_FIELDS,
    AutoRoundConfig,
    AWQClipConfig,
    AWQSearchConfig,
    GPTQConfig,
    ObserverConfig,
)
from infer_tool.schemes.options import option

# their names in compressed-tensors configs: llm-compressor's memoryless weight observers
OBSERVER_NAMES = {"minmax": "memoryless_minmax", "mse": "memoryless_mse"}
INT8_ACTIVATIONS = ("none", "dynamic", "static")  # none: weights only; dynamic: per token; static: per tensor
W8A8_KIND = "w8a8"


def observer_name(scheme: object) -> str:
    """The compressed-tensors `observer` of a scheme's weights (min-max for schemes without one)."""
    return OBSERVER_NAMES[getattr(scheme, "observer", "minmax")]


@dataclass(frozen=True)
class QuantScheme(Scheme):
    """Integer weight quantization shared by every INT solver.

    `bits` in 2..8; `symmetric` stores no zero point (zero 2^(bits-1) implied).
    `scale_dtype`: the dtype the checkpoint stores scales in; solvers round every scale to
    it before computing codes, so the stored checkpoint dequantizes to exactly the weights
    the solver produced and evaluated.
    `int8_activations`: "none" (weights only), "dynamic" (int8 per token at run time, as
        llm-compressor's W8A8) or "static" (one calibrated per-tensor `input_scale` per
        linear); either needs 8-bit symmetric per-channel weights (what vLLM's W8A8 kernels take).
    `smoothquant`: the migration strength α in [0, 1] of SmoothQuant before quantizing, or
        None (off).
    `full_range`: symmetric groups on the signed full-range grid (llama.cpp's Q4_0,
        auto-round's `int_sym`: the larger side of a group at level −2^(bits−1), all 2^bits
        levels, negative scales; `packers/rtn.qparams`) instead of ±(2^(bits−1) − 1); weights only.
    """

    method: ClassVar[str] = "rtn"
    bits: int = option(4, "Weight bits.", panel="Method")
    group_size: int = option(128, "Columns per scale group, -1 per channel.", panel="Method")
    symmetric: bool = option(
        True, "Symmetric (no zero point) or asymmetric.", flag="--sym/--asym", panel="Method switches"
    )
    scale_dtype: str = "float32"
    int8_activations: str = option(
        "none",
        "INT8 activations (W8A8; 8-bit symmetric per-channel weights, gptq or rtn): none, dynamic (per token at "
        "run time) or static (a calibrated per-tensor input_scale).",
        panel="INT8",
    )
    smoothquant: float | None = option(
        None,
        "SmoothQuant's migration strength alpha in [0, 1] (0.5 the paper's, 0.8 llm-compressor's examples): "
        "s = max|x|^alpha / max|w|^(1-alpha) per input channel, folded into the norm before the layers it feeds; "
        "gptq or rtn. Off when not given.",
        kind=float,
        panel="INT8",
    )
    full_range: bool = option(
        False,
        "Symmetric INT groups on the full-range grid: the larger side of each group at -2^(bits-1), all 2^bits "
        "levels, signed scales (llama.cpp's Q4_0, auto-round's default) instead of +-(2^(bits-1)-1). When not "
        "given: on for --method autoround with --sym (as auto-round), off otherwise.",
        flag="--full-range/--no-full-range",
        panel="Method switches",
    )

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 8:
            raise BadInput(f"bits={self.bits} is not supported; use 2..8 (4 for the INT4 formats)")
        if self.int8_activations not in INT8_ACTIVATIONS:
            raise BadInput(
                f"int8 activations {self.int8_activations!r} are not supported; "
                f"use one of {', '.join(INT8_ACTIVATIONS)}"
            )
        if self.int8_activations != "none" and (self.bits, self.group_size, self.symmetric) != (8, -1, True):
            raise BadInput(
                f"int8 activations (W8A8) need 8-bit symmetric per-channel weights (--bits 8 --group-size -1 "
                f"--sym, or --scheme W8A8), got bits={self.bits} group_size={self.group_size} "
                f"{'sym' if self.symmetric else 'asym'}: vLLM's W8A8 kernels take no group or zero-point weights"
            )
        if self.smoothquant is not None and (isinstance(self.smoothquant, bool) or not 0.0 <= self.smoothquant <= 1.0):
            raise BadInput(
                f"--smoothquant {self.smoothquant} is not supported; use a migration strength in [0, 1] "
                "such as 0.5 (the paper's) or 0.8 (llm-compressor's examples)"
            )
        if self.full_range and not self.symmetric:
            raise BadInput(
                "--full-range is a grid of symmetric groups; drop --asym (an asymmetric group already uses every "
                "level) or --full-range"
            )
        if self.full_range and self.int8_activations != "none":
            raise BadInput(
                f"--full-range does not go with int8 activations ({self.int8_activations}): it is a grid for "
                "weight-only groups, W8A8 keeps the per-channel -127..127 weights llm-compressor writes; "
                "drop --full-range"
            )
        if self.scale_dtype not in SCALE_DTYPES:
            raise BadInput(f"scale dtype {self.scale_dtype!r} is not supported; use one of {', '.join(SCALE_DTYPES)}")
        if self.group_size != -1 and self.group_size <= 0:
            raise BadInput(
                f"group_size={self.group_size} is not supported; use a positive size "
                "dividing the input features, or -1 for per-channel"
            )

    def _activation_options(self) -> str:
        """The activation options set, as a refusal names them."""
        parts = [f"int8 activations ({self.int8_activations})"] if self.int8_activations != "none" else []
        return " and ".join(parts + ([f"--smoothquant {self.smoothquant}"] if self.smoothquant is not None else []))

    @property
    def kind(self) -> str:  # type: ignore[override]
        """ "w8a8" with int8 activations, else "int" (weights only)."""
        return W8A8_KIND if self.int8_activations != "none" else "int"

    @property
    def torch_scale_dtype(self) -> torch.dtype:  # noqa: F821
        import torch

        return getattr(torch, self.scale_dtype)

    def group_for(self, in_features: int) -> int:
        """The group size in columns for a layer with `in_features` (K) inputs."""
        return in_features if self.group_size == -1 else self.group_size

    def check_shapes(self, shapes: Mapping[str, tuple[int, int]]) -> None:
        """Refuse layers ({name: (N, K)}) this scheme cannot quantize, before any work."""
        check_group_size(shapes, self.group_size)

    def for_storage(self, scale_dtype: str) -> QuantScheme:
        """This scheme with scales rounded to `scale_dtype`, the dtype the checkpoint stores."""
        return dataclasses.replace(self, scale_dtype=scale_dtype)

    def describe(self) -> str:
        """'awq w4 g64 asym' (+ ' act-order', ', int8 dynamic activations', ', smoothquant 0.5')
        for the report table."""
        order = " act-order" if getattr(self, "act_order", False) else ""
        text = f"{self.method} w{self.bits} g{self.group_size} {'sym' if self.symmetric else 'asym'}{order}"
        if self.int8_activations != "none":
            text += f", int8 {self.int8_activations} activations"
        if self.smoothquant is not None:
            text += f", smoothquant {self.smoothquant:g}"
        if self.full_range:
            text += ", full-range"
        if getattr(self, "observer", "minmax") != "minmax":
            text += f", {self.observer} scales"
        return text


@dataclass(frozen=True)
class RTNScheme(ObserverConfig, QuantScheme):
    """Round-to-nearest: min/max (asymmetric) or absmax (symmetric) per group, or the MSE
    observer's shrink of that range (`observer`)."""

    method: ClassVar[str] = "rtn"


@dataclass(frozen=True)
class GPTQScheme(GPTQConfig, ObserverConfig, QuantScheme):
    """GPTQ on INT weights (`GPTQConfig`), with the INT-only options:

    static_groups: with act_order, compute each group's scale/zero on the ORIGINAL column
        groups before permuting, so g_idx stays k // g (vLLM's fast path; llm-compressor's
        actorder="weight"). False gives act-order groups (actorder="group", non-trivial g_idx).
    observer: how each group's scale and zero point are chosen (`ObserverConfig`), on the
        weights GPTQ groups them by.
    gptaq: asymmetric calibration's α (GPTAQ, Li et al. 2025: round toward the fp model's
        output from the quantized chain's inputs, `packers/gptq.gptaq_target`), in (0, 1];
        None: off (GPTQ's own target, the layer's output on the same inputs).
    """

    method: ClassVar[str] = "gptq"
    static_groups: bool = True
    gptaq: float | None = option(
        None,
        "GPTQ toward the fp model's output (GPTAQ's asymmetric calibration): round each linear toward "
        "W + alpha W dXX^T H^-1, with the fp model's own inputs beside the quantized chain's; alpha in (0, 1], "
        "0.25 the paper's; INT gptq and awq+gptq. Off when not given.",
        kind=float,
        panel="Method",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.gptaq is not None and (isinstance(self.gptaq, bool) or not 0.0 < self.gptaq <= 1.0):
            raise BadInput(
                f"--gptaq {self.gptaq} is not supported; use a strength in (0, 1] such as 0.25 (the paper's)"
            )
        if self.gptaq is not None and self.smoothquant is not None:
            raise BadInput(
                f"--gptaq {self.gptaq} does not go with --smoothquant: the fp model's inputs are taken before "
                "the smoothing; drop one of them"
            )


@dataclass(frozen=True)
class AWQScheme(AWQClipConfig, AWQSearchConfig, QuantScheme):
    """AWQ (Lin et al. 2023) on INT weights: the scale search (`AWQSearchConfig`), then the
    clipping search (`AWQClipConfig`). Asymmetric (zero point) by default, as in AutoAWQ."""

    method: ClassVar[str] = "awq"
    symmetric: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.int8_activations != "none" or self.smoothquant is not None:
            raise BadInput(
                f"{self._activation_options()} go{'es' if self.int8_activations == 'none' else ''} with --method "
                "gptq or rtn: AWQ searches its own scales for the weights alone"
            )


@dataclass(frozen=True)
class AWQGPTQScheme(AWQSearchConfig, GPTQScheme):
    """AWQ's scale search and fold, then GPTQ's rounding of the smoothed weights (the chain
    llm-compressor's recipes build from AWQModifier + GPTQModifier). AWQ's clip search is
    off: GPTQ chooses the rounding. GPTQ's Hessians are measured on the folded layer's
    inputs (x / s).
    """

    method: ClassVar[str] = "awq+gptq"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.awq()  # what AWQ refuses on INT (activations), raising its BadInput

    def awq(self) -> AWQScheme:
        """The AWQ step's scheme (clip search off)."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(QuantScheme)}
        own = {n: getattr(self, n) for n in AWQ_SEARCH_FIELDS}
        return AWQScheme(**shared, **own, clip=False)

    def gptq(self) -> GPTQScheme:
        """The GPTQ step's scheme."""
        return GPTQScheme(**{f.name: getattr(self, f.name) for f in dataclasses.fields(GPTQScheme)})


@dataclass(frozen=True)
class AutoRoundScheme(AutoRoundConfig, QuantScheme):
    """AutoRound on this project's INT grid (`AutoRoundConfig`): clip factors alpha, beta
    scale each group's min and max. `full_range`: None (not given) resolves to `symmetric`:
    symmetric groups take the full-range grid, auto-round's own `int_sym`. Symmetric by
    default (auto-round's W4A16).
    """

    method: ClassVar[str] = "autoround"
    full_range: bool | None = None

    def __post_init__(self) -> None:
        if self.full_range is None:  # the weight-only grid: int8 activations are refused below, not for it
            object.__setattr__(self, "full_range", self.symmetric and self.int8_activations == "none")
        super().__post_init__()
        if self.int8_activations != "none" or self.smoothquant is not None:
            raise BadInput(
                f"{self._activation_options()} go{'es' if self.int8_activations == 'none' else ''} with --method "
                "gptq or rtn: autoround learns the rounding of weight-only INT"
            )

    def describe(self) -> str:
        """'autoround w4 g64 sym, 200 iters' for the report table."""
        return f"{super().describe()}, {self.iters} iters"
