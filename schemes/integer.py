"""Integer weight schemes: `QuantScheme`, the options every INT solver shares, and one
subclass per method holding that method's options and defaults (RTN, GPTQ, AWQ, AWQ then
GPTQ, AutoRound).

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

AWQ_SEARCHES = ("fast", "full", "screen")
OBSERVERS = ("minmax", "mse")  # how a group's scale is chosen (packers/rtn.py)
# their names in compressed-tensors configs: llm-compressor's memoryless weight observers
OBSERVER_NAMES = {"minmax": "memoryless_minmax", "mse": "memoryless_mse"}
INT8_ACTIVATIONS = ("none", "dynamic", "static")  # none: weights only; dynamic: per token; static: per tensor
W8A8_KIND = "w8a8"


def check_observer(observer: str) -> None:
    if observer not in OBSERVERS:
        raise BadInput(f"--observer {observer!r} is not supported; use one of {', '.join(OBSERVERS)}")


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
    bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    scale_dtype: str = "float32"
    int8_activations: str = "none"
    smoothquant: float | None = None
    full_range: bool = False

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
class RTNScheme(QuantScheme):
    """Round-to-nearest: min/max (asymmetric) or absmax (symmetric) per group, or the MSE
    observer's shrink of that range (`observer`, as GPTQScheme's)."""

    method: ClassVar[str] = "rtn"
    observer: str = "minmax"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_observer(self.observer)


@dataclass(frozen=True)
class GPTQScheme(QuantScheme):
    """GPTQ (Frantar et al. 2022), Algorithm 1 with lazy batch updates.

    damp: fraction of mean(diag H) added to the diagonal (§3 "Cholesky Reformulation").
    block_size: columns quantized together before the lazy batch update (§3 step 2).
    act_order: process columns by decreasing diag(H) (the "act-order"/desc_act heuristic);
        on by default, as llm-compressor's GPTQ (with static groups it keeps vLLM's fast path).
    static_groups: with act_order, compute each group's scale/zero on the ORIGINAL column
        groups before permuting, so g_idx stays k // g (vLLM's fast path; llm-compressor's
        actorder="weight"). False gives act-order groups (actorder="group", non-trivial g_idx).
    damp_retries / damp_growth: on a failed Cholesky multiply damp by damp_growth up to
        damp_retries times, then fall back to RTN for that layer (reported, not raised).
    observer: how each group's scale and zero point are chosen: "minmax" (the group's range)
        or "mse" (llm-compressor's MSE observer: the shrink of the range minimising the
        group's |error|^2.4; `packers/rtn.py`), on the weights GPTQ groups them by.
    gptaq: asymmetric calibration's α (GPTAQ, Li et al. 2025: round toward the fp model's
        output from the quantized chain's inputs, `packers/gptq.gptaq_target`), in (0, 1];
        None: off (GPTQ's own target, the layer's output on the same inputs).
    """

    method: ClassVar[str] = "gptq"
    damp: float = 0.01
    block_size: int = 128
    act_order: bool = True
    static_groups: bool = True
    damp_retries: int = 3
    damp_growth: float = 10.0
    observer: str = "minmax"
    gptaq: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_observer(self.observer)
        if self.gptaq is not None and (isinstance(self.gptaq, bool) or not 0.0 < self.gptaq <= 1.0):
            raise BadInput(
                f"--gptaq {self.gptaq} is not supported; use a strength in (0, 1] such as 0.25 (the paper's)"
            )
        if self.gptaq is not None and self.smoothquant is not None:
            raise BadInput(
                f"--gptaq {self.gptaq} does not go with --smoothquant: the fp model's inputs are taken before "
                "the smoothing; drop one of them"
            )
        if not self.damp > 0:
            raise BadInput(f"damp={self.damp} is not supported; use a positive fraction such as 0.01")
        if self.block_size <= 0:
            raise BadInput(f"block_size={self.block_size} is not supported; use a positive column count")


@dataclass(frozen=True)
class AWQScheme(QuantScheme):
    """AWQ (Lin et al. 2023): activation-aware scale search, then clipping search.

    grid: number of ratios alpha in [0, 1) tried for s = mean|x|^alpha (§3.2).
    search: how the grid is searched: "full" (every ratio, as AutoAWQ), "fast" (coarse to
        fine: every `search_step`-th ratio, then every ratio between the best one's coarse
        neighbours; exact where the loss over alpha is unimodal, the full grid where the
        points it saw are not; `packers/awq.search_grid`) or "screen", the default (every
        ratio scored with the block in bfloat16, then the three best and those within a
        margin (from `screen_margin`, widened to what the screen's measured error calls for)
        scored again in float32: the full grid's choice while the screen errs alike near the
        minimum; `packers/awq.screen_grid`).
    duo_scaling: also divide by mean|w|^(1-alpha) (AutoAWQ's default).
    clip: run the weight-clipping search after scaling.
    clip_grid / max_shrink: clip thresholds max*(1 - i/clip_grid) for i < max_shrink*clip_grid.
    clip_tokens: calibration tokens subsampled for the clip search (memory bound).
    clip_batch: output channels searched at once (memory bound).
    AWQ is asymmetric (zero point) by default, as in AutoAWQ.
    """

    method: ClassVar[str] = "awq"
    symmetric: bool = False
    grid: int = 20
    search: str = "screen"
    search_step: int = 4
    screen_margin: float = 0.01
    duo_scaling: bool = True
    clip: bool = True
    clip_grid: int = 20
    max_shrink: float = 0.5
    clip_tokens: int = 512
    clip_batch: int = 256

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.int8_activations != "none" or self.smoothquant is not None:
            raise BadInput(
                f"{self._activation_options()} go{'es' if self.int8_activations == 'none' else ''} with --method "
                "gptq or rtn: AWQ searches its own scales for the weights alone"
            )
        if self.grid < 1 or self.clip_grid < 1:
            raise BadInput(f"grid={self.grid}, clip_grid={self.clip_grid}: use at least 1 point")
        if self.search not in AWQ_SEARCHES:
            raise BadInput(f"AWQ search {self.search!r} is not supported; use one of {', '.join(AWQ_SEARCHES)}")
        if not self.screen_margin > 0:
            raise BadInput(f"screen_margin={self.screen_margin} is not supported; use a positive fraction such as 0.1")
        if self.search_step < 2:
            raise BadInput(f"search_step={self.search_step} is not supported; use 2 or more grid points")
        if not 0.0 <= self.max_shrink < 1.0:
            raise BadInput(f"max_shrink={self.max_shrink} is not supported; use a fraction in [0, 1)")


AWQ_SEARCH_FIELDS = ("grid", "search", "search_step", "screen_margin", "duo_scaling")  # the ratio search's options


@dataclass(frozen=True)
class AWQGPTQScheme(GPTQScheme):
    """AWQ's scale search and fold, then GPTQ's rounding of the smoothed weights (the chain
    llm-compressor's recipes build from AWQModifier + GPTQModifier). AWQ's clip search is
    off: GPTQ chooses the rounding. The AWQ fields are AWQScheme's (same defaults); the rest
    are GPTQScheme's. GPTQ's Hessians are measured on the folded layer's inputs (x / s).
    """

    method: ClassVar[str] = "awq+gptq"
    grid: int = AWQScheme.grid
    search: str = AWQScheme.search
    search_step: int = AWQScheme.search_step
    screen_margin: float = AWQScheme.screen_margin
    duo_scaling: bool = AWQScheme.duo_scaling

    def __post_init__(self) -> None:
        super().__post_init__()
        self.awq()  # AWQScheme validates its fields

    def awq(self) -> AWQScheme:
        """The AWQ step's scheme (clip search off)."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(QuantScheme)}
        own = {n: getattr(self, n) for n in AWQ_SEARCH_FIELDS}
        return AWQScheme(**shared, **own, clip=False)

    def gptq(self) -> GPTQScheme:
        """The GPTQ step's scheme."""
        return GPTQScheme(**{f.name: getattr(self, f.name) for f in dataclasses.fields(GPTQScheme)})


TUNE_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class AutoRoundScheme(QuantScheme):
    """AutoRound / SignRound (Cheng et al. 2023, "Optimize Weight Rounding via Signed Gradient
    Descent for the Quantization of LLMs"): per decoder block, rounding offsets V (one per
    weight, in [-0.5, 0.5]) and clip factors alpha, beta (one pair per group, in [0, 1],
    scaling the group's min and max) learned by signed gradient descent on the block's output
    MSE against the fp block, then rounded on this project's INT grid.

    iters: descent steps per block (auto-round's default 200; 0 is refused: that is RTN).
    lr: step size of V, alpha and beta; None: 1 / iters, auto-round's default, decayed
        linearly to 0 over the steps (so V moves at most lr·(iters+1)/2 ≈ 0.5).
    batch: calibration sequences per step (auto-round's default 8).
    batch_seed: seed of the order in which sequences are drawn into batches.
    tune_dtype: dtype the block runs in while tuning ("float32" or "bfloat16"); the
        learned parameters, the targets and the final rounding stay float32.
    full_range: None (not given) resolves to `symmetric`: symmetric groups take the
        full-range grid, auto-round's own `int_sym`.
    Symmetric by default (auto-round's W4A16).
    """

    method: ClassVar[str] = "autoround"
    full_range: bool | None = None
    iters: int = 200
    lr: float | None = None
    batch: int = 8
    batch_seed: int = 0
    tune_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.full_range is None:  # the weight-only grid: int8 activations are refused below, not for it
            object.__setattr__(self, "full_range", self.symmetric and self.int8_activations == "none")
        super().__post_init__()
        if self.int8_activations != "none" or self.smoothquant is not None:
            raise BadInput(
                f"{self._activation_options()} go{'es' if self.int8_activations == 'none' else ''} with --method "
                "gptq or rtn: autoround learns the rounding of weight-only INT"
            )
        if self.iters < 1:
            raise BadInput(
                f"--iters {self.iters} is not supported; use 1 or more descent steps per block "
                "(0 steps is plain rounding: --method rtn)"
            )
        if self.lr is not None and not (self.lr > 0 and self.lr < float("inf")):
            raise BadInput(f"--lr {self.lr} is not supported; use a positive step size, e.g. 0.005 (default 1/iters)")
        if self.batch < 1:
            raise BadInput(f"--batch {self.batch} is not supported; use 1 or more calibration sequences per step")
        if self.tune_dtype not in TUNE_DTYPES:
            raise BadInput(f"--tune-dtype {self.tune_dtype!r} is not supported; use one of {', '.join(TUNE_DTYPES)}")

    @property
    def step_size(self) -> float:
        """The initial step size: `lr`, or 1 / iters."""
        return self.lr if self.lr is not None else 1.0 / self.iters

    def describe(self) -> str:
        """'autoround w4 g64 sym, 200 iters' for the report table."""
        return f"{super().describe()}, {self.iters} iters"
