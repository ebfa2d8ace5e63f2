"""Quantization schemes: one frozen dataclass per INT algorithm, holding its defaults.

Nothing else in the project restates these defaults: the CLI and recipes build a scheme
with `make_scheme(method, **overrides)` where an override of `None` means "keep the
default". This module knows nothing about models, files or tensors beyond their shapes.

A group of `group_size` consecutive input columns (along K) shares one scale and one
zero point; `group_size=-1` means one group per output row (per-channel).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from infer_tool.common.errors import BadInput

SCALE_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class QuantScheme:
    """Integer weight quantization shared by every INT solver.

    `bits` in 2..8; `symmetric` stores no zero point (zero 2^(bits-1) implied).
    `scale_dtype`: the dtype the checkpoint stores scales in; solvers round every scale to
    it before computing codes, so the stored checkpoint dequantizes to exactly the weights
    the solver produced and evaluated.
    """

    method: ClassVar[str] = "rtn"
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


@dataclass(frozen=True)
class RTNScheme(QuantScheme):
    """Round-to-nearest: min/max (asymmetric) or absmax (symmetric) per group."""

    method: ClassVar[str] = "rtn"


@dataclass(frozen=True)
class GPTQScheme(QuantScheme):
    """GPTQ (Frantar et al. 2022), Algorithm 1 with lazy batch updates.

    damp: fraction of mean(diag H) added to the diagonal (§3 "Cholesky Reformulation").
    block_size: columns quantized together before the lazy batch update (§3 step 2).
    act_order: process columns by decreasing diag(H) (the "act-order"/desc_act heuristic).
    static_groups: with act_order, compute each group's scale/zero on the ORIGINAL column
        groups before permuting, so g_idx stays k // g (vLLM's fast path; llm-compressor's
        actorder="weight"). False gives act-order groups (actorder="group", non-trivial g_idx).
    damp_retries / damp_growth: on a failed Cholesky multiply damp by damp_growth up to
        damp_retries times, then fall back to RTN for that layer (reported, not raised).
    """

    method: ClassVar[str] = "gptq"
    damp: float = 0.01
    block_size: int = 128
    act_order: bool = False
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
        if not 0.0 <= self.max_shrink < 1.0:
            raise BadInput(f"max_shrink={self.max_shrink} is not supported; use a fraction in [0, 1)")


SCHEMES: dict[str, type[QuantScheme]] = {s.method: s for s in (RTNScheme, GPTQScheme, AWQScheme)}


def make_scheme(method: str, **overrides: object) -> QuantScheme:
    """Build the scheme for `method`; overrides equal to None keep the dataclass default."""
    cls = SCHEMES.get(method)
    if cls is None:
        raise BadInput(f"method {method!r} is not supported; use one of {', '.join(SCHEMES)}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(k for k, v in overrides.items() if v is not None and k not in names)
    if unknown:
        raise BadInput(f"options {unknown} do not apply to method {method!r}; it accepts {sorted(names)}")
    return cls(**{k: v for k, v in overrides.items() if v is not None})


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
