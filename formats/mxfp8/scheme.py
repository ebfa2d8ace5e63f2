"""MXFP8 schemes: E4M3 weights with one E8M0 (power-of-two) scale per 32 inputs along K, and
optionally MXFP8 activations (dynamic, per 32), `kind = "mxfp8"`. Standard library only.

`mxfp8_activations`: "none" (weights only, llm-compressor's MXFP8A16) or "mxfp8" (W8A8,
llm-compressor's MXFP8: each linear's input rounded to E4M3 with a dynamic E8M0 scale per 32).
What the format fixes (8 bits, symmetric, groups of 32, uint8 E8M0 scales) is not an option.
As a class of its own the scheme is RTN; `Mxfp8GPTQScheme` and `Mxfp8AutoRoundScheme` compose
GPTQ's and AutoRound's configs (`schemes/methods.py`: options, defaults and checks, not
restated) with it: one GPTQ and one AutoRound, on this format's grid.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from infer_tool.common.errors import BadInput
from infer_tool.schemes.base import Scheme
from infer_tool.schemes.methods import AutoRoundConfig, GPTQConfig
from infer_tool.schemes.options import option

KIND = "mxfp8"
GROUP_SIZE = 32  # values per E8M0 scale along K
ACTIVATIONS = ("none", "mxfp8")


@dataclass(frozen=True)
class Mxfp8Scheme(Scheme):
    """MXFP8 round to nearest: each group's scale from its max |w| (compressed-tensors' rule)."""

    method: ClassVar[str] = "rtn"
    kind: ClassVar[str] = KIND
    mxfp8_activations: str = option(
        "none",
        "MXFP8 weights (E4M3, an E8M0 scale per 32 inputs) instead of INT, for --method rtn, gptq or autoround, with "
        "activations: none (llm-compressor's MXFP8A16) or mxfp8 (its MXFP8: E4M3 with a dynamic E8M0 scale per 32). "
        "--scheme MXFP8A16 / MXFP8 set it.",
        panel="MXFP8",
    )

    def __post_init__(self) -> None:
        if self.mxfp8_activations not in ACTIVATIONS:
            raise BadInput(
                f"--mxfp8-activations {self.mxfp8_activations!r} is not supported; use none (weights only, "
                "MXFP8A16) or mxfp8 (W8A8, MXFP8)"
            )

    group_size: ClassVar[int] = GROUP_SIZE

    @property
    def w8a8(self) -> bool:
        return self.mxfp8_activations == "mxfp8"

    @property
    def preset(self) -> str:
        """llm-compressor's name of this number format: MXFP8A16 or MXFP8."""
        return "MXFP8" if self.w8a8 else "MXFP8A16"

    def group_for(self, in_features: int) -> int:
        return GROUP_SIZE

    def check_shapes(self, shapes: Mapping[str, tuple[int, int]]) -> None:
        """Refuse linears whose K is not a multiple of 32 (vLLM's scales are K // 32 wide)."""
        bad = {name: k for name, (_, k) in shapes.items() if k % GROUP_SIZE}
        if bad:
            listed = ", ".join(f"{n} (K={k})" for n, k in sorted(bad.items())[:8])
            more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
            raise BadInput(
                f"mxfp8 scales groups of {GROUP_SIZE} input features, which do not divide those of {listed}{more}; "
                "--ignore those linears or use another scheme"
            )

    def for_storage(self, scale_dtype: str) -> Mxfp8Scheme:
        """MXFP8 stores its scales as E8M0 whatever the model dtype."""
        return self

    def describe(self) -> str:
        """'gptq mxfp8 (MXFP8A16) act-order' for the report table."""
        order = " act-order" if getattr(self, "act_order", False) else ""
        return f"{self.method} mxfp8 ({self.preset}){order}"


@dataclass(frozen=True)
class Mxfp8GPTQScheme(GPTQConfig, Mxfp8Scheme):
    """GPTQ on the MXFP8 grid: every group's scale from the original weights (static groups),
    then GPTQ's column loop (`packers/gptq.solve_columns`) rounding each column to E4M3 at its
    group's scale."""

    method: ClassVar[str] = "gptq"


@dataclass(frozen=True)
class Mxfp8AutoRoundScheme(AutoRoundConfig, Mxfp8Scheme):
    """AutoRound on the MXFP8 grid (`formats/mxfp8/autoround.py`): per weight an offset added
    before the E4M3 rounding and per group a clip factor of max |w|, learned by signed gradient
    descent on each block's output."""

    method: ClassVar[str] = "autoround"

    def describe(self) -> str:
        """'autoround mxfp8 (MXFP8A16), 200 iters' for the report table."""
        return f"{super().describe()}, {self.iters} iters"


SCHEMES: tuple[type[Mxfp8Scheme], ...] = (Mxfp8Scheme, Mxfp8GPTQScheme, Mxfp8AutoRoundScheme)
