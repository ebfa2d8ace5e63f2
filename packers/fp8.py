"""FP8 (e4m3) weight quantization: per-tensor, per-channel and per-block scales.

The e4m3 format (`torch.float8_e4m3fn`, OCP FP8) has 4 exponent bits, 3 mantissa bits
and no infinities; its largest finite value is 448 and casting a larger value gives NaN,
so scaled values are clamped to [-448, 448] before the cast (saturation).

A weight W `(N, K)` is stored as W_q = e4m3(clamp(W / s)) with s = amax / 448 over
- the whole tensor:            `weight_scale` `(1,)`,
- each output channel (row):   `weight_scale` `(N, 1)`,
- each `bn x bk` block:        `weight_scale` `(ceil(N/bn), ceil(K/bk))` (edge blocks partial),
and read back as W ~ W_q * s. An all-zero tensor, row or block gets s = 1 (finite) and
stores exact zeros.

Round-trip bound (no clipping): e4m3 rounds to nearest with 3 mantissa bits, so a scaled
value |x| in the normal range (|x| >= 2^-6) is off by at most 2^-4 |x| (half a unit in the
last place, 2^-3 / 2); below 2^-6 the spacing of subnormals is 2^-9, so the error is at
most 2^-10 in scaled units. Unscaled: |W - W~| <= max(2^-4 |W|, 2^-10 s) per element.

Optional clip search (`search_fp8_clip`): scales s = r * amax / 448 for ratios r on a grid,
choosing per scale-row group the r minimising the output error tr(dW H dW^T) with
H = mean 2 x x^T the layer's calibration Hessian (the same statistic GPTQ uses). The
search returns its result as data; `quantize_fp8_weight(..., clip=...)` applies it.

Static activation scales: `input_scale` = act_abs_max / 448 (one per layer).

This module knows nothing about models, files or formats (see `codecs/fp8_formats.py`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from infer_tool.common.errors import BadInput
from infer_tool.packers.deploy import Deploy
from infer_tool.schemes.fp8 import GRANULARITIES, Fp8Scheme

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
E4M3_MANTISSA_BITS = 3
E4M3_MIN_NORMAL = 2.0**-6
E4M3_SUBNORMAL_STEP = 2.0**-9


@dataclass
class Fp8Weight:
    """One linear layer in FP8: W ~ weight.float() * expand(weight_scale).

    weight        float8_e4m3fn `(N, K)`
    weight_scale  fp32 `(1,)` tensor | `(N, 1)` channel | `(ceil(N/bn), ceil(K/bk))` block
    input_scale   fp32 `(1,)` static activation scale, or None for dynamic per-token
    clip_ratio    fp32 ratio(s) applied to amax: `(1,)`, `(N,)` or `(ceil(N/bn),)`, or None
    """

    weight: torch.Tensor  # (N, K) float8_e4m3fn
    weight_scale: torch.Tensor  # see above, fp32
    granularity: str
    block_size: tuple[int, int] | None = None  # (bn, bk) for "block"
    input_scale: torch.Tensor | None = None  # (1,) fp32
    clip_ratio: torch.Tensor | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) = (out_features, in_features)."""
        return (int(self.weight.shape[0]), int(self.weight.shape[1]))

    def scale_full(self) -> torch.Tensor:
        """(N, K) fp32: every element's scale."""
        return expand_scale(self.weight_scale.float(), self.granularity, self.shape, self.block_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(N, K) weight in `dtype`: weight * scale."""
        return (self.weight.float() * self.scale_full()).to(dtype)

    label = "FP8"

    def takes_int8_activations(self, deploy: Deploy) -> bool:
        return False

    def to_linear(self, bias: torch.Tensor | None, dtype: torch.dtype, deploy: Deploy, where: str) -> Any:
        """The kernels' `Fp8Linear`: W8A8 as the checkpoint says (e4m3 activations per token, or
        with its static `input_scale`), W8A16 when it quantizes no activations or with
        activations "none"."""
        from infer_tool.kernels.quant_linear import Fp8Linear

        mode = "w8a8" if deploy.quantized_activations and deploy.activations != "none" else "w8a16"
        inp = self.input_scale if mode == "w8a8" else None
        return Fp8Linear(self.weight, self.weight_scale.float(), inp, bias, self.block_size, mode)

    @classmethod
    def activations_note(
        cls, layers: Mapping[str, Fp8Weight], deploy: Deploy, kernels: set[str], dtype: torch.dtype
    ) -> str:
        if deploy.activations == "none":
            return "activations unquantized (FP8 W8A16)"
        return "activations e4m3 as the checkpoint says (FP8)"

    def to(self, device: torch.device | str) -> Fp8Weight:
        """A copy with every tensor on `device`."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(
            self,
            weight=move(self.weight),
            weight_scale=move(self.weight_scale),
            input_scale=move(self.input_scale),
            clip_ratio=move(self.clip_ratio),
        )


def check_finite(weight: torch.Tensor, name: str) -> None:
    """Refuse a weight holding NaN or Inf, naming the tensor and the count."""
    if weight.numel():
        lo, hi = torch.aminmax(weight)  # NaN propagates: finite ends mean every value is finite
        if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
            return  # one reduction: isfinite over every element was most of FP8 RTN's time
    bad = ~torch.isfinite(weight)
    if bool(bad.any()):
        n_nan = int(torch.isnan(weight).sum())
        raise BadInput(
            f"weight {name!r} holds {n_nan} NaN and {int(bad.sum()) - n_nan} Inf values; "
            "FP8 quantization needs finite weights (fix or --ignore the layer)"
        )


def _block_view(x: torch.Tensor, block_size: tuple[int, int]) -> torch.Tensor:
    """(N, K) -> (Nb, bn, Kb, bk), zero-padded to whole blocks (zeros never raise an amax)."""
    n, k = x.shape
    bn, bk = block_size
    nb, kb = math.ceil(n / bn), math.ceil(k / bk)
    x = torch.nn.functional.pad(x, (0, kb * bk - k, 0, nb * bn - n))
    return x.reshape(nb, bn, kb, bk)


def weight_amax(weight: torch.Tensor, granularity: str, block_size: tuple[int, int] | None = None) -> torch.Tensor:
    """max |W| over each scale's elements, fp32, shaped like `weight_scale`."""
    a = weight.detach().float().abs()  # (N, K)
    if granularity == "tensor":
        return a.amax().reshape(1)
    if granularity == "channel":
        return a.amax(dim=1, keepdim=True)  # (N, 1)
    if granularity == "block":
        assert block_size is not None
        return _block_view(a, block_size).amax(dim=(1, 3))  # (Nb, Kb)
    raise BadInput(f"FP8 granularity {granularity!r} is not supported; use one of {', '.join(GRANULARITIES)}")


def expand_scale(
    scale: torch.Tensor, granularity: str, shape: tuple[int, int], block_size: tuple[int, int] | None = None
) -> torch.Tensor:
    """Broadcast a `weight_scale` to the `(N, K)` weight it scales."""
    n, k = shape
    if granularity == "tensor":
        return scale.reshape(1, 1).expand(n, k)
    if granularity == "channel":
        return scale.reshape(n, 1).expand(n, k)
    if granularity == "block":
        assert block_size is not None
        bn, bk = block_size
        return scale.repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)[:n, :k]
    raise BadInput(f"FP8 granularity {granularity!r} is not supported; use one of {', '.join(GRANULARITIES)}")


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """s = amax / 448, fp32; where that is 0 (all-zero group, or amax underflowing) s = 1."""
    s = amax.float() / E4M3_MAX
    return torch.where(s > 0, s, torch.ones_like(s))


def cast_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Saturating cast of already-scaled values: clamp to +-448, round to nearest e4m3."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _clip_to_scale_shape(clip: torch.Tensor, granularity: str) -> torch.Tensor:
    """Ratios `(1,)`, `(N,)` or `(Nb,)` broadcast against amax `(1,)`, `(N,1)` or `(Nb,Kb)`."""
    return clip.float().reshape(1) if granularity == "tensor" else clip.float().reshape(-1, 1)


def quantize_fp8_weight(
    weight: torch.Tensor,
    scheme: Fp8Scheme,
    *,
    name: str = "weight",
    clip: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
) -> Fp8Weight:
    """Quantize one `(N, K)` weight to e4m3 with `scheme.granularity` scales.

    clip: ratios from `search_fp8_clip` (None = 1, scale from the true amax).
    input_scale: the static activation scale (`static_input_scale`), stored alongside.
    """
    if weight.dim() != 2:
        raise BadInput(f"weight {name!r} has shape {tuple(weight.shape)}; FP8 quantization takes a 2-D (N, K) weight")
    check_finite(weight, name)
    w = weight.detach().float()  # (N, K)
    block = scheme.block_size if scheme.granularity == "block" else None
    amax = weight_amax(w, scheme.granularity, block)
    if clip is not None:
        amax = amax * _clip_to_scale_shape(clip, scheme.granularity)
    s = scale_from_amax(amax)
    q = cast_e4m3(w / expand_scale(s, scheme.granularity, w.shape, block))
    return Fp8Weight(
        weight=q,
        weight_scale=s,
        granularity=scheme.granularity,
        block_size=block,
        input_scale=input_scale,
        clip_ratio=None if clip is None else clip.float().reshape(-1),
    )


def static_input_scale(act_abs_max: float | torch.Tensor) -> torch.Tensor:
    """(1,) fp32 per-tensor activation scale act_abs_max / 448 (1 when the input was all zero)."""
    a = torch.as_tensor(act_abs_max, dtype=torch.float32).reshape(1)
    if not bool(torch.isfinite(a).all()):
        raise BadInput(f"activation abs-max {float(a)} is not finite; the calibration inputs overflowed")
    return scale_from_amax(a)


@dataclass
class Fp8ClipSearch:
    """Result of `search_fp8_clip`.

    ratios  fp32 `(G,)`: the chosen ratio per scale-row group (G = 1, N or ceil(N/bn))
    grid    fp32 `(S,)`: the ratios tried (grid[0] = 1, no clipping)
    loss    fp32 `(S, G)`: output error tr(dW H dW^T) of each group at each ratio
    """

    ratios: torch.Tensor
    grid: torch.Tensor
    loss: torch.Tensor

    @property
    def loss_unclipped(self) -> float:
        return float(self.loss[0].sum())

    @property
    def loss_chosen(self) -> float:
        return float(self.loss.min(dim=0).values.sum())


def clip_groups(n: int, scheme: Fp8Scheme) -> int:
    """Number of clip ratios for a weight with `n` rows: 1, N, or ceil(N / bn)."""
    if scheme.granularity == "tensor":
        return 1
    return n if scheme.granularity == "channel" else math.ceil(n / scheme.block_size[0])


def _row_groups(per_row: torch.Tensor, granularity: str, block_size: tuple[int, int]) -> torch.Tensor:
    """Sum a per-row quantity `(N,)` over the rows sharing a clip ratio -> `(G,)`."""
    if granularity == "tensor":
        return per_row.sum().reshape(1)
    if granularity == "channel":
        return per_row
    bn = block_size[0]
    nb = math.ceil(per_row.shape[0] / bn)
    return torch.nn.functional.pad(per_row, (0, nb * bn - per_row.shape[0])).reshape(nb, bn).sum(dim=1)


def search_fp8_clip(weight: torch.Tensor, H: torch.Tensor, scheme: Fp8Scheme, *, name: str = "weight") -> Fp8ClipSearch:
    """Grid search of clipping ratios minimising tr(dW H dW^T) per scale-row group.

    weight `(N, K)`; H `(K, K)` = mean over calibration tokens of 2 x x^T, so
    tr(dW H dW^T) = 2 * mean_x ||dW x||^2, the output error. Rows sharing a scale share a
    ratio: one ratio per tensor, per channel, or per row of blocks (the error of a row
    depends only on its own scales, so groups are independent).
    """
    check_finite(weight, name)
    w = weight.detach().float()  # (N, K)
    H = H.to(w.device, torch.float32)  # (K, K)
    grid = scheme.clip_grid()
    n_groups = clip_groups(w.shape[0], scheme)
    losses = []
    for r in grid:
        dW = w - quantize_fp8_weight(w, scheme, name=name, clip=r.expand(n_groups)).dequantize()  # (N, K)
        per_row = ((dW @ H) * dW).sum(dim=1)  # (N,)
        losses.append(_row_groups(per_row, scheme.granularity, scheme.block_size))
    loss = torch.stack(losses)  # (S, G)
    return Fp8ClipSearch(ratios=grid[loss.argmin(dim=0)], grid=grid, loss=loss)
