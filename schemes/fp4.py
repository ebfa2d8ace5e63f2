"""FP4 schemes: E2M1 weights (and activations) in compressed-tensors' NVFP4 and MXFP4 formats,
`kind = "fp4"` (the `nvfp4-pack-quantized` / `mxfp4-pack-quantized` writer carries it).

`Fp4Scheme` is the number format, one class for all of it:
- `fp4`: "nvfp4" (groups of 16 along K, one E4M3 scale per group relative to one float32
  global scale per tensor, shared by fused shards) or "mxfp4" (groups of 32, one E8M0
  power-of-two scale per group, no global scale);
- `fp4_activations`: "none" (weights only: llm-compressor's NVFP4A16 / MXFP4A16) or "fp4"
  (W4A4, llm-compressor's NVFP4 / MXFP4: NVFP4 activations get a static `input_global_scale`
  from calibration and dynamic per-16 E4M3 scales at run time; MXFP4 activations dynamic
  per-32 E8M0 scales);
- `observer`: how each group's scale is chosen from its weights: "minmax" (the group's max
  |w|) or "mse" (llm-compressor's MSE observer grid: the shrink of the max minimising
  sum |Q(w) - w|^2.4 over the group, scored with the scale the checkpoint stores);
- `amax_dtype` (set by `for_storage`): the dtype the amax-derived scale arithmetic runs in,
  the checkpoint's, as compressed-tensors computes it in the model dtype.

Method × format: a method's FP4 class is its config (`schemes/methods.py`: fields, defaults,
checks and flags, not restated) composed with `Fp4Scheme`, as its INT class is with
`QuantScheme`; the class body holds only what the pair decides (GPTAQ refused, MXFP4's AWQ clip
default). The registry picks the FP4 class of a method when an FP4 option is given
(`registry.scheme_class`). What FP4 fixes and INT
chooses (bits, group size, symmetry, scale dtype) is not an option here: E2M1 is 4-bit and
symmetric, the group and the scale dtypes are the format's. GPTQ keeps every group's scale from
the original weights (static groups, whatever the column order). Standard library only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from infer_tool.common.errors import BadInput
from infer_tool.schemes.base import SCALE_DTYPES, Scheme
from infer_tool.schemes.methods import (
    AWQ_SEARCH_FIELDS,
    AutoRoundConfig,
    AWQClipConfig,
    AWQSearchConfig,
    GPTQConfig,
    ObserverConfig,
)
from infer_tool.schemes.options import option

FP4_FORMATS = ("nvfp4", "mxfp4")
FP4_GROUP_SIZE = {"nvfp4": 16, "mxfp4": 32}  # values per scale along K (= kernels/fp4_layout.GROUP_SIZE)
FP4_ACTIVATIONS = ("none", "fp4")
KIND = "fp4"


@dataclass(frozen=True)
class Fp4Scheme(ObserverConfig, Scheme):
    """E2M1 weights (and W4A4 activations): see the module docstring. As a class of its own
    it is RTN (`Fp4RTNScheme`); the other methods compose their configs with it."""

    method: ClassVar[str] = "rtn"
    kind: ClassVar[str] = KIND
    fp4: str = option(
        "nvfp4",
        "FP4 (E2M1) weights instead of INT: nvfp4 (an E4M3 scale per 16 inputs and a float32 global scale per "
        "tensor, shared by fused q/k/v and gate/up) or mxfp4 (an E8M0 scale per 32); --method rtn, gptq, awq "
        "or awq+gptq.",
        panel="FP4",
    )
    fp4_activations: str = option(
        "none",
        "FP4 activations: none (weights only, llm-compressor's NVFP4A16 / MXFP4A16) or fp4 (W4A4, NVFP4 / MXFP4: "
        "NVFP4 with a calibrated static input_global_scale and dynamic per-16 scales, MXFP4 dynamic per 32).",
        panel="FP4",
    )
    amax_dtype: str = "float32"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fp4 not in FP4_FORMATS:
            raise BadInput(f"--fp4 {self.fp4!r} is not supported; use one of {', '.join(FP4_FORMATS)}")
        if self.fp4_activations not in FP4_ACTIVATIONS:
            raise BadInput(
                f"--fp4-activations {self.fp4_activations!r} is not supported; use none (weights only, "
                "NVFP4A16 / MXFP4A16) or fp4 (W4A4, NVFP4 / MXFP4)"
            )
        if self.amax_dtype not in SCALE_DTYPES:
            raise BadInput(f"amax dtype {self.amax_dtype!r} is not supported; use one of {', '.join(SCALE_DTYPES)}")

    @property
    def group_size(self) -> int:
        """Columns per scale along K: 16 (NVFP4) or 32 (MXFP4)."""
        return FP4_GROUP_SIZE[self.fp4]

    def group_for(self, in_features: int) -> int:
        return self.group_size

    @property
    def w4a4(self) -> bool:
        """True when activations are quantized too."""
        return self.fp4_activations == "fp4"

    @property
    def global_scales(self) -> bool:
        """True for NVFP4: a float32 global scale per tensor, one per fused group of shards."""
        return self.fp4 == "nvfp4"

    @property
    def preset(self) -> str:
        """llm-compressor's name of this number format: NVFP4A16, NVFP4, MXFP4A16 or MXFP4."""
        return self.fp4.upper() + ("" if self.w4a4 else "A16")

    def check_shapes(self, shapes: Mapping[str, tuple[int, int]]) -> None:
        """Refuse linears whose K is not a multiple of the group (no padding: vLLM's scales are
        `K // group` wide and compressed-tensors refuses the rest)."""
        g = self.group_size
        bad = {name: k for name, (_, k) in shapes.items() if k % g}
        if bad:
            listed = ", ".join(f"{n} (K={k})" for n, k in sorted(bad.items())[:8])
            more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
            raise BadInput(
                f"{self.fp4} scales groups of {g} input features, which do not divide those of {listed}{more}; "
                "--ignore those linears or use another scheme"
            )

    def for_storage(self, scale_dtype: str) -> Fp4Scheme:
        """FP4 stores its scales as E4M3 / E8M0 (global scales float32); the amax-derived
        arithmetic runs in the checkpoint dtype `scale_dtype`."""
        return dataclasses.replace(self, amax_dtype=scale_dtype)

    def describe(self) -> str:
        """'gptq nvfp4 (NVFP4A16) act-order, mse scales' for the report table."""
        order = " act-order" if getattr(self, "act_order", False) else ""
        return f"{self.method} {self.fp4} ({self.preset}){order}, {self.observer} scales"


@dataclass(frozen=True)
class Fp4RTNScheme(Fp4Scheme):
    """Round to nearest on the FP4 grid, each group's scale from its observer."""

    method: ClassVar[str] = "rtn"


@dataclass(frozen=True)
class Fp4GPTQScheme(GPTQConfig, Fp4Scheme):
    """GPTQ rounding to the FP4 grid (`GPTQConfig`): every column with its group's scale, chosen
    by the observer on the original weights before the solve; act-order visits columns by
    decreasing diag(H) (static groups: column k keeps group k // g). GPTAQ is INT's only."""

    method: ClassVar[str] = "gptq"
    gptaq: float | None = None  # the option INT's GPTQ declares, refused here by name

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.gptaq is not None:
            raise BadInput(
                f"--gptaq {self.gptaq} works with INT weights only: FP4's global scales come from the weights "
                "before the solve; drop --gptaq or --fp4"
            )


@dataclass(frozen=True)
class Fp4AWQScheme(AWQClipConfig, AWQSearchConfig, Fp4Scheme):
    """AWQ with its scale and clip searches scored by the FP4 quantizer (fused shards with one
    global scale), then the observer's scales. `clip`: None means on for NVFP4 and off for
    MXFP4, whose per-group clip search (E8M0 scales) raised the demo model's perplexity
    where it lowered NVFP4's (docs/results.md, "The AWQ clip search on FP4")."""

    method: ClassVar[str] = "awq"
    clip: bool | None = None  # resolved in __post_init__: the format's default when not given

    def __post_init__(self) -> None:
        if self.clip is None:
            object.__setattr__(self, "clip", self.fp4 != "mxfp4")
        super().__post_init__()


@dataclass(frozen=True)
class Fp4AWQGPTQScheme(AWQSearchConfig, Fp4GPTQScheme):
    """AWQ's scale search and fold scored by the FP4 quantizer (`Fp4AWQScheme`, clip search
    off), then GPTQ's rounding of the smoothed weights to the FP4 grid (`Fp4GPTQScheme`):
    `AWQGPTQScheme` on E2M1."""

    method: ClassVar[str] = "awq+gptq"

    def awq(self) -> Fp4AWQScheme:
        """The AWQ step's scheme (clip search off: GPTQ chooses the rounding)."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(Fp4Scheme)}
        search = {n: getattr(self, n) for n in AWQ_SEARCH_FIELDS}
        return Fp4AWQScheme(**own, **search, clip=False)

    def gptq(self) -> Fp4GPTQScheme:
        """The GPTQ step's scheme."""
        return Fp4GPTQScheme(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Fp4GPTQScheme)})


@dataclass(frozen=True)
class Fp4AutoRoundScheme(AutoRoundConfig, Fp4Scheme):
    """AutoRound on the FP4 grid (auto-round's `nv_fp4` / `mx_fp4` tuning, `AutoRoundConfig`):
    per weight an offset V in [-0.5, 0.5] added to w / s before the E2M1 rounding, per group one
    clip factor of max |w| (E2M1 is symmetric, so one side's), learned by signed gradient descent
    on each block's output (`packers/autoround_fp4.py`). NVFP4's global scales stay those of the
    fp weights (fused shards share one). The scales start from min-max (`--observer mse` is
    refused: the descent tunes the clip itself)."""

    method: ClassVar[str] = "autoround"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.observer != "minmax":
            raise BadInput(
                f"--observer {self.observer} does not go with --method autoround: its descent tunes each group's "
                "clip from the min-max scale; drop --observer or use --method rtn / gptq / awq+gptq"
            )

    def describe(self) -> str:
        """'autoround nvfp4 (NVFP4A16), minmax scales, 200 iters' for the report table."""
        return f"{super().describe()}, {self.iters} iters"


FP4_SCHEMES: tuple[type[Fp4Scheme], ...] = (
    Fp4RTNScheme,
    Fp4GPTQScheme,
    Fp4AWQScheme,
    Fp4AWQGPTQScheme,
    Fp4AutoRoundScheme,
)
