"""Quantization schemes: one frozen dataclass per algorithm, holding its defaults, and
the one registry of them (`SCHEMES`, method name -> class).

Nothing else in the project restates these defaults: the CLI and recipes build a scheme
with `make_scheme(method, **overrides)` where an override of `None` means "keep the
default". What callers need to know of a scheme is an attribute of it, never a test of
its method name: `kind` (the checkpoint formats that carry it: "int" or "fp8"),
`check_shapes` (shape constraints, before any work), `for_storage` (scales rounded to
what the format stores) and `describe`. This module imports no torch and knows nothing
about models, files or tensors beyond their shapes.

INT: a group of `group_size` consecutive input columns (along K) shares one scale and one
zero point; `group_size=-1` means one group per output row (per-channel).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from infer_tool.common.errors import BadInput

SCALE_DTYPES = ("float32", "bfloat16", "float16")
GRANULARITIES = ("tensor", "channel", "block")
ACTIVATION_SCHEMES = ("dynamic", "static")
KV_CACHE_SCHEMES = ("fp8",)
AWQ_SEARCHES = ("fast", "full", "screen")


@dataclass(frozen=True)
class QuantScheme:
    """Integer weight quantization shared by every INT solver.

    `bits` in 2..8; `symmetric` stores no zero point (zero 2^(bits-1) implied).
    `scale_dtype`: the dtype the checkpoint stores scales in; solvers round every scale to
    it before computing codes, so the stored checkpoint dequantizes to exactly the weights
    the solver produced and evaluated.
    """

    method: ClassVar[str] = "rtn"
    kind: ClassVar[str] = "int"
    bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    scale_dtype: str = "float32"

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 8:
            raise BadInput(f"bits={self.bits} is not supported; use 2..8 (4 for the INT4 formats)")
        if self.scale_dtype not in SCALE_DTYPES:
            raise BadInput(f"scale dtype {self.scale_dtype!r} is not supported; use one of {', '.join(SCALE_DTYPES)}")
        if self.group_size != -1 and self.group_size <= 0:
            raise BadInput(
                f"group_size={self.group_size} is not supported; use a positive size "
                "dividing the input features, or -1 for per-channel"
            )

    @property
    def torch_scale_dtype(self) -> "torch.dtype":  # noqa: F821
        import torch

        return getattr(torch, self.scale_dtype)

    def group_for(self, in_features: int) -> int:
        """The group size in columns for a layer with `in_features` (K) inputs."""
        return in_features if self.group_size == -1 else self.group_size

    def to_dict(self) -> dict[str, object]:
        return {"method": self.method, **dataclasses.asdict(self)}

    def check_shapes(self, shapes: Mapping[str, tuple[int, int]]) -> None:
        """Refuse layers ({name: (N, K)}) this scheme cannot quantize, before any work."""
        check_group_size(shapes, self.group_size)

    def for_storage(self, scale_dtype: str) -> "QuantScheme":
        """This scheme with scales rounded to `scale_dtype`, the dtype the checkpoint stores."""
        return dataclasses.replace(self, scale_dtype=scale_dtype)

    def describe(self) -> str:
        """'awq w4 g64 asym' (+ ' act-order') for the report table."""
        order = " act-order" if getattr(self, "act_order", False) else ""
        return f"{self.method} w{self.bits} g{self.group_size} {'sym' if self.symmetric else 'asym'}{order}"


@dataclass(frozen=True)
class RTNScheme(QuantScheme):
    """Round-to-nearest: min/max (asymmetric) or absmax (symmetric) per group."""

    method: ClassVar[str] = "rtn"


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
    """

    method: ClassVar[str] = "gptq"
    damp: float = 0.01
    block_size: int = 128
    act_order: bool = True
    static_groups: bool = True
    damp_retries: int = 3
    damp_growth: float = 10.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.damp > 0:
            raise BadInput(f"damp={self.damp} is not supported; use a positive fraction such as 0.01")
        if self.block_size <= 0:
            raise BadInput(f"block_size={self.block_size} is not supported; use a positive column count")


@dataclass(frozen=True)
class AWQScheme(QuantScheme):
    """AWQ (Lin et al. 2023): activation-aware scale search, then clipping search.

    grid: number of ratios alpha in [0, 1) tried for s = mean|x|^alpha (§3.2).
    search: how the grid is searched: "full" (every ratio, as AutoAWQ) or "fast" (coarse to
        fine: every `search_step`-th ratio, then every ratio between the best one's coarse
        neighbours; exact where the loss over alpha is unimodal, the full grid where the
        points it saw are not). See `packers/awq.search_grid`. Full by default: on the demo
        model the loss over alpha is unimodal on few mappings, so the fast search mostly
        falls back and saves little (README, "How calibration runs"). "screen": every ratio
        scored with the block in bfloat16, then the three best and those within a margin
        (from `screen_margin`, widened to what the screen's measured error calls for) scored
        again in float32: the full grid's choice while the screen errs alike near the
        minimum (`packers/awq.screen_grid`).
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


@dataclass(frozen=True)
class Fp8Scheme:
    """FP8 e4m3 weights (and activations, KV cache).

    granularity: weight scale per "tensor", output "channel" or "block" of `block_size`
        `(bn, bk)` (rows, columns). The default, per-channel weights with dynamic per-token
        activations, is llm-compressor's FP8_DYNAMIC scheme.
    activations: "dynamic" (per-token scales at run time, no calibration) or "static"
        (one calibrated per-tensor `input_scale`). Block weights go with dynamic only.
    kv_cache: None, or "fp8" for calibrated per-layer k_scale / v_scale.
    clip_search: search clipping ratios in [clip_min_ratio, 1] (clip_steps + 1 points)
        minimising output error on calibration data (needs the layer Hessian).
    """

    method: ClassVar[str] = "fp8"
    kind: ClassVar[str] = "fp8"
    granularity: str = "channel"
    block_size: tuple[int, int] = (128, 128)
    activations: str = "dynamic"
    kv_cache: str | None = None
    clip_search: bool = False
    clip_min_ratio: float = 0.8
    clip_steps: int = 20

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise BadInput(f"FP8 granularity {self.granularity!r} is not supported; use one of {', '.join(GRANULARITIES)}")
        if self.activations not in ACTIVATION_SCHEMES:
            raise BadInput(
                f"FP8 activations {self.activations!r} are not supported; use one of {', '.join(ACTIVATION_SCHEMES)}"
            )
        if self.kv_cache is not None and self.kv_cache not in KV_CACHE_SCHEMES:
            raise BadInput(f"kv cache {self.kv_cache!r} is not supported; use fp8 or leave it unset")
        if self.granularity == "block" and self.activations == "static":
            raise BadInput(
                "block-wise FP8 weights go with dynamic activations only (vLLM and transformers "
                "load no static input scale for them); use --fp8-activations dynamic or another granularity"
            )
        bs = tuple(self.block_size)
        if len(bs) != 2 or min(bs) <= 0:
            raise BadInput(f"block_size={self.block_size} is not supported; use two positive sizes such as (128, 128)")
        object.__setattr__(self, "block_size", (int(bs[0]), int(bs[1])))
        if not 0.0 < self.clip_min_ratio <= 1.0 or self.clip_steps < 1:
            raise BadInput(
                f"clip_min_ratio={self.clip_min_ratio}, clip_steps={self.clip_steps}: use a ratio in (0, 1] and at least 1 step"
            )

    @property
    def needs_activation_stats(self) -> bool:
        return self.activations == "static"

    @property
    def needs_hessian(self) -> bool:
        return self.clip_search

    def clip_grid(self) -> "torch.Tensor":  # noqa: F821
        """(S+1,) fp32 ratios from 1 down to clip_min_ratio."""
        import torch

        return torch.linspace(1.0, self.clip_min_ratio, self.clip_steps + 1, dtype=torch.float32)

    def to_dict(self) -> dict[str, object]:
        d = dataclasses.asdict(self)
        d["block_size"] = list(self.block_size)
        return {"method": self.method, **d}

    def check_shapes(self, shapes: Mapping[str, tuple[int, int]]) -> None:
        """Any (N, K) works: edge blocks are partial."""

    def for_storage(self, scale_dtype: str) -> "Fp8Scheme":
        """FP8 scales are stored in float32 whatever the model dtype."""
        return self

    def describe(self) -> str:
        """'fp8 e4m3 channel weights, dynamic activations, FP8 KV cache' for the report table."""
        text = f"fp8 e4m3 {self.granularity} weights"
        if self.granularity == "block":
            text += f" {self.block_size[0]}x{self.block_size[1]}"
        text += f", {self.activations} activations"
        if self.clip_search:
            text += ", clip search"
        if self.kv_cache:
            text += ", FP8 KV cache"
        return text


Scheme = QuantScheme | Fp8Scheme
SCHEMES: dict[str, type[QuantScheme] | type[Fp8Scheme]] = {s.method: s for s in (RTNScheme, GPTQScheme, AWQScheme, Fp8Scheme)}


def scheme_fields(method: str) -> tuple[str, ...]:
    """The option names `make_scheme(method, ...)` accepts."""
    return tuple(f.name for f in dataclasses.fields(SCHEMES[method]))


def make_scheme(method: str, **overrides: object) -> Scheme:
    """Build the scheme for `method`; overrides equal to None keep the dataclass default."""
    cls = SCHEMES.get(method)
    if cls is None:
        raise BadInput(f"method {method!r} is not supported; use one of {', '.join(SCHEMES)}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(k for k, v in overrides.items() if v is not None and k not in names)
    if unknown:
        raise BadInput(f"options {unknown} do not apply to method {method!r}; it accepts {sorted(names)}")
    return cls(**{k: v for k, v in overrides.items() if v is not None})  # type: ignore[arg-type]


def check_group_size(shapes: Mapping[str, tuple[int, int]], group_size: int) -> None:
    """Refuse, before any work, layers whose K (`shapes[name] = (N, K)`) the group size does not divide.

    The message lists the offending layers and the group sizes (powers of two >= 16, or -1)
    that divide every layer's K.
    """
    if group_size == -1:
        return
    bad = {name: k for name, (_, k) in shapes.items() if k % group_size}
    if not bad:
        return
    ks = {k for _, k in shapes.values()}
    candidates = [g for g in (16, 32, 64, 128, 256, 512, 1024) if all(k % g == 0 for k in ks)]
    listed = ", ".join(f"{n} (K={k})" for n, k in sorted(bad.items())[:8])
    more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
    works = ", ".join(str(g) for g in candidates + [-1])
    raise BadInput(
        f"group size {group_size} does not divide the input features of {listed}{more}; "
        f"group sizes that work for every layer: {works}"
    )
