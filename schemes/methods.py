"""The methods' configs: each method's own options, their defaults, checks and `quantize` flags,
declared once and composed with a number format into a scheme.

A scheme class is a method's config mixed into a format's class, e.g. GPTQ on INT weights is
`class GPTQScheme(GPTQConfig, QuantScheme)` and GPTQ on FP4 `class Fp4GPTQScheme(GPTQConfig,
Fp4Scheme)`: the same fields, defaults and checks, written here. A config checks only its own
fields (`__post_init__`, then the format's checks through `super()`); what a method refuses on
one format (GPTAQ on FP4) is that pair's class's. The solvers read these fields by name
(`packers/gptq.py`, `packers/awq.py`, `packers/autoround.py`). Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass

from infer_tool.common.errors import BadInput
from infer_tool.schemes.options import option

OBSERVERS = ("minmax", "mse")  # how a group's scale is chosen (packers/rtn.py)
AWQ_SEARCHES = ("fast", "full", "screen")
TUNE_DTYPES = ("float32", "bfloat16")


def check_observer(observer: str) -> None:
    if observer not in OBSERVERS:
        raise BadInput(f"--observer {observer!r} is not supported; use one of {', '.join(OBSERVERS)}")


class _Config:
    """Base of the method configs: ends the cooperative `__post_init__` chain."""

    def __post_init__(self) -> None:
        nxt = getattr(super(), "__post_init__", None)
        if nxt is not None:
            nxt()


@dataclass(frozen=True)
class ObserverConfig(_Config):
    """How each group's scale (and zero point) is chosen from its weights: "minmax" (the group's
    range) or "mse" (llm-compressor's MSE observer: the shrink of the range minimising the
    group's |error|^2.4, scored with the scales stored; `packers/rtn.py`)."""

    observer: str = option(
        "minmax",
        "Group scales of rtn, gptq and awq+gptq, and of every --fp4 method: minmax (each group's range) or mse "
        "(the shrink of it minimising the group's |error|^2.4, llm-compressor's MSE observer grid, scored with the "
        "scales stored).",
        panel="Method",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_observer(self.observer)


@dataclass(frozen=True)
class GPTQConfig(_Config):
    """GPTQ (Frantar et al. 2022), Algorithm 1 with lazy batch updates.

    damp: fraction of mean(diag H) added to the diagonal (§3 "Cholesky Reformulation").
    block_size: columns quantized together before the lazy batch update (§3 step 2).
    act_order: process columns by decreasing diag(H) (the "act-order"/desc_act heuristic);
        on by default, as llm-compressor's GPTQ (with static groups it keeps vLLM's fast path).
    damp_retries / damp_growth: on a failed Cholesky multiply damp by damp_growth up to
        damp_retries times, then fall back to RTN for that layer (reported, not raised).
    """

    damp: float = option(0.01, "GPTQ dampening, fraction of mean diag(H).", panel="Method")
    block_size: int = 128
    act_order: bool = option(
        True,
        "GPTQ: columns by decreasing Hessian diagonal, static groups (g_idx stays trivial).",
        flag="--act-order/--no-act-order",
        panel="Method switches",
    )
    damp_retries: int = 3
    damp_growth: float = 10.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.damp > 0:
            raise BadInput(f"damp={self.damp} is not supported; use a positive fraction such as 0.01")
        if self.block_size <= 0:
            raise BadInput(f"block_size={self.block_size} is not supported; use a positive column count")


@dataclass(frozen=True)
class AWQSearchConfig(_Config):
    """AWQ's scale search (Lin et al. 2023, §3.2).

    grid: number of ratios alpha in [0, 1) tried for s = mean|x|^alpha.
    search: how the grid is searched: "full" (every ratio, as AutoAWQ), "fast" (coarse to
        fine: every `search_step`-th ratio, then every ratio between the best one's coarse
        neighbours; exact where the loss over alpha is unimodal, the full grid where the
        points it saw are not; `packers/awq.search_grid`) or "screen", the default (every
        ratio scored with the block in bfloat16, then the three best and those within a
        margin (from `screen_margin`, widened to what the screen's measured error calls for)
        scored again in float32: the full grid's choice while the screen errs alike near the
        minimum; `packers/awq.screen_grid`).
    duo_scaling: also divide by mean|w|^(1-alpha) (AutoAWQ's default).
    """

    grid: int = 20
    search: str = option(
        "screen",
        "AWQ ratio search: full (every ratio of the grid, in float32), screen (every ratio with the block in "
        "bfloat16, the close ones again in float32) or fast (coarse to fine; exact where the loss over alpha is "
        "unimodal, the full grid where the ratios it looked at are not).",
        name="awq_search",
        panel="Method",
    )
    search_step: int = 4
    screen_margin: float = 0.01
    duo_scaling: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.grid < 1:
            raise BadInput(f"grid={self.grid}: use at least 1 point")
        if self.search not in AWQ_SEARCHES:
            raise BadInput(f"AWQ search {self.search!r} is not supported; use one of {', '.join(AWQ_SEARCHES)}")
        if not self.screen_margin > 0:
            raise BadInput(f"screen_margin={self.screen_margin} is not supported; use a positive fraction such as 0.1")
        if self.search_step < 2:
            raise BadInput(f"search_step={self.search_step} is not supported; use 2 or more grid points")


AWQ_SEARCH_FIELDS = ("grid", "search", "search_step", "screen_margin", "duo_scaling")  # AWQSearchConfig's


@dataclass(frozen=True)
class AWQClipConfig(_Config):
    """AWQ's clipping search after the scales (AutoAWQ's).

    clip: run it. clip_grid / max_shrink: clip thresholds max*(1 - i/clip_grid) for
    i < max_shrink*clip_grid. clip_tokens: calibration tokens subsampled for it (memory bound).
    clip_batch: output channels searched at once (memory bound).
    """

    clip: bool = option(
        True,
        "AWQ: after the scales, search each group's clip threshold minimising the linear's output error "
        "(AutoAWQ's; q/k skipped). MXFP4 leaves it off unless --awq-clip is given.",
        flag="--awq-clip/--no-awq-clip",
        name="awq_clip",
    )
    clip_grid: int = 20
    max_shrink: float = 0.5
    clip_tokens: int = 512
    clip_batch: int = 256

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.clip_grid < 1:
            raise BadInput(f"clip_grid={self.clip_grid}: use at least 1 point")
        if not 0.0 <= self.max_shrink < 1.0:
            raise BadInput(f"max_shrink={self.max_shrink} is not supported; use a fraction in [0, 1)")


@dataclass(frozen=True)
class AutoRoundConfig(_Config):
    """AutoRound / SignRound (Cheng et al. 2023, "Optimize Weight Rounding via Signed Gradient
    Descent for the Quantization of LLMs"): per decoder block, rounding offsets V (one per
    weight, in [-0.5, 0.5]) and clip factors (one per group, in [0, 1]) learned by signed
    gradient descent on the block's output MSE against the fp block.

    iters: descent steps per block (auto-round's default 200; 0 is refused: that is RTN).
    lr: step size of the offsets and clip factors; None: 1 / iters, auto-round's default,
        decayed linearly to 0 over the steps (so V moves at most lr·(iters+1)/2 ≈ 0.5).
    batch: calibration sequences per step (auto-round's default 8).
    batch_seed: seed of the order in which sequences are drawn into batches.
    tune_dtype: dtype the block runs in while tuning ("float32" or "bfloat16"); the
        learned parameters, the targets and the final rounding stay float32.
    """

    iters: int = option(
        200, "autoround: descent steps per block; fewer is faster on a CPU (e.g. 50).", panel="AutoRound"
    )
    lr: float | None = option(
        None,
        "autoround: step size of the rounding offsets and clip factors, decayed linearly to 0 (none: 1/iters).",
        kind=float,
        panel="AutoRound",
    )
    batch: int = option(8, "autoround: calibration sequences per descent step.", panel="AutoRound")
    batch_seed: int = option(0, "autoround: seed of the order sequences are drawn into batches.", panel="AutoRound")
    tune_dtype: str = option(
        "float32",
        "autoround: dtype the block runs in while tuning (float32 or bfloat16); "
        "the learned parameters and the rounding stay float32.",
        panel="AutoRound",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
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
