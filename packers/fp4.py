"""FP4 (E2M1) quantization for compressed-tensors' NVFP4 and MXFP4 formats: rounding to
the grid, group and global scales, an MSE search of the group scale, the per-column
quantizer GPTQ calls, the fake quantizer AWQ scores with, and W4A4 activation
fake-quantization. Pure tensor functions; bits are laid out by `kernels/fp4_layout.py`;
the E2M1 rounding, the E8M0 scale rule and vLLM's W4A4 activation rules are the runtime's,
in `kernels/fp4_act.py` (imported here under the same names).

Grid and rounding. E2M1 magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6); `x` rounds to the
nearest, ties to the even mantissa (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
3.5 -> 4, 5 -> 4), saturating at ±6; a negative value that rounds to zero keeps its sign
(code 0x8), -0.0 itself is +0 (code 0). compressed-tensors 0.19/0.20
`quantization/utils/fp4_utils.py` `cast_to_fp4` (thresholds) applied after the clamp to
±6 of `quant_args.py` `round_to_quantized_type_args`; `torch.sign(x)` gives the sign, so
-0.0 -> 0. vLLM 0.32 `nvfp4_emulation_utils.py` `cast_to_fp4` uses the same thresholds.

NVFP4 (`tensor_group`, group 16 along K). compressed-tensors `quantization/utils/
helpers.py`: `generate_gparam`: `global_scale = 448 * 6 / amax` computed in amax's dtype
(amax clamped to that dtype's `tiny`; NaN/inf -> 1.0), stored float32 `(1,)`;
`calculate_qparams`: group scale `s = global_scale * (amax_g / 6)` (amax_g / 6 in amax's
dtype), clamped to ±448 and cast to float8_e4m3fn (round to nearest even), a scale that
rounds to 0 replaced by 0.125 (`_get_dtype_eps`). `lifecycle/forward_helpers.py`
`_quantize` / `_dequantize`: the effective scale is `s / global_scale` (float32
division), `q = round(x / (s / global_scale))`, `w = q * (s / global_scale)`. vLLM 0.32
(`compressed_tensors_w4a4_nvfp4.py` `process_weights_after_loading`) keeps
`1 / max(weight_global_scale)` over the fused shards and its emulation
(`nvfp4_emulation_utils.py` `dequantize_to_dtype`) computes `q * (s * (1 / gs))`: at
most one float32 ulp from compressed-tensors before the cast to the model dtype.

Fused shards (q/k/v, gate/up, an expert's w1/w3) share one global scale from the max of
their amax: llm-compressor 0.14 `observers/base.py` `Observer.get_global_scale` over the
`FusionHandler` group, `observers/helpers.py` `FUSED_LAYER_NAMES`.

MXFP4 (`group`, group 32, no global scale). compressed-tensors `quantization/utils/
mxfp_utils.py` `generate_mx_scales`: `round_to_power_2(amax)` adds a quarter of the
mantissa range and truncates (a group max with mantissa >= 1.75 goes up one binade),
then `u = 127 + floor(log2(.)) - 2` (2 = floor(log2(6))), clamped to the uint8 range;
the weight scale is `2 ** (u - 127)`, stored as uint8 `u` (`compressors/mx_utils.py`
`compress_mx_scale`). The same rule is vLLM's reference "even" mode
(`tests/quantization/reference_mxfp4.py` `qdq_mxfp4_torch`, which amd-quark's
`qdq_mxfp4`, vLLM's MXFP4 activation quantizer, implements).

W4A4 activations. NVFP4: a static `input_global_scale = 448 * 6 / amax(x)` from
calibration (llm-compressor's `static_minmax` observer, `generate_gparam`) and dynamic
per-16 E4M3 scales at run time, as vLLM's CPU emulation computes them
(`nvfp4_emulation_utils.py` `ref_nvfp4_quant` / `ref_nvfp4_quant_dequant`; vLLM's CUDA
Triton path `_nvfp4_quant_dequant_kernel` multiplies by `gs / s` instead of
`1 / (s * (1 / gs))`, which can differ in the last float32 bit). MXFP4: dynamic per-32
E8M0 scales by the rule above.

MSE search: llm-compressor 0.14 `observers/mse.py` `MemorylessMSEObserver` defaults
(maxshrink 0.20, grid 100, norm 2.4, patience 5) and `observers/mse_quant.py`
`_grid_search_mse`: shrink factors `p = 1 - i / grid` for `i < int(maxshrink * grid)`,
error `sum |qdq(x) - x| ** norm` per group, stop after `patience` steps in which no group
improved. For NVFP4 it scores a continuous scale `p * amax / 6` (no E4M3 rounding, no
global scale: `scale_dtype` is dropped for `tensor_group`); for MXFP4 the E8M0 scale.

Shapes: weights `(N, K)` (the `nn.Linear` orientation), K a multiple of the group;
group quantities `(N, G)`, `G = K / group`. Computation is float32 (amax-derived scales
in amax's dtype, as above); the library does not know layer names, files or formats.
"""

from __future__ import annotations

import torch

from infer_tool.kernels.fp4_act import (
    E4M3_MAX,
    e2m1_index,
    mxfp4_group_scales,
    mxfp4_qdq_activations,
    nvfp4_qdq_activations,
    round_to_e2m1,
)
from infer_tool.kernels.fp4_layout import E2M1_MAX, GROUP_SIZE, SIGN_BIT, effective_scale
from infer_tool.packers.rtn import MSE_DEFAULTS, shrink_search

NVFP4_ZERO_SCALE = 0.125  # stored for a group scale that rounds to 0 (compressed-tensors `_get_dtype_eps`)


def _group_size(fmt: str) -> int:
    if fmt not in GROUP_SIZE:
        raise ValueError(f"unknown FP4 format {fmt!r}; expected one of {sorted(GROUP_SIZE)}")
    return GROUP_SIZE[fmt]


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """`(..., K)` -> `(..., K/g, g)`; K must be a multiple of the group."""
    if w.dim() == 0 or w.shape[-1] % group_size:
        raise ValueError(f"FP4: K={w.shape[-1] if w.dim() else None} is not a multiple of the group size {group_size}")
    return w.unflatten(-1, (-1, group_size))


def _group_of(w: torch.Tensor, scale: torch.Tensor) -> int:
    """Group size implied by `w (..., K)` and its scales `(..., G)`."""
    K, G = w.shape[-1], scale.shape[-1]
    if G == 0 or K % G or w.shape[:-1] != scale.shape[:-1]:
        raise ValueError(
            f"FP4: scales {tuple(scale.shape)} do not divide a tensor {tuple(w.shape)} into groups along K"
        )
    return K // G


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of the rounded x: uint8 0..15, bit 3 the sign, bits 0..2 the magnitude index."""
    return e2m1_index(x).bitwise_or_((x < 0).view(torch.uint8).mul(SIGN_BIT))


def fake_quantize(x: torch.Tensor, eff_scale: torch.Tensor) -> torch.Tensor:
    """`round_to_e2m1(x / s) * s` in float32, `s` the effective scale broadcast against x.
    GPTQ calls it column by column with the column's fixed group scales (x `(N,)`, s `(N,)`)."""
    s = eff_scale.float()
    return round_to_e2m1(x.float() / s) * s


def group_amax(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """max |w| per group along K: `(..., K)` -> `(..., K/g)` in w's dtype."""
    return _grouped(w, group_size).abs().amax(dim=-1)


def tensor_amax(*weights: torch.Tensor) -> torch.Tensor:
    """max |w| over every tensor given (the shards of one fused layer), `(1,)` in their
    common dtype."""
    if not weights:
        raise ValueError("tensor_amax needs at least one tensor")
    return torch.stack([w.abs().amax() for w in weights]).amax().reshape(1)


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """`448 * 6 / amax` in amax's dtype, float32 `(1,)`; amax 0 (or NaN) gives 1.0. Also
    the W4A4 `input_global_scale` from the calibration amax of a layer's input."""
    a = amax.reshape(1).clamp(min=torch.finfo(amax.dtype).tiny)
    gs = E4M3_MAX * E2M1_MAX / a
    return torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32)


def nvfp4_fused_global_scale(*weights: torch.Tensor) -> torch.Tensor:
    """The one global scale fused shards (q/k/v, gate/up, w1/w3) share: from the max of
    their amax. float32 `(1,)`."""
    return nvfp4_global_scale(tensor_amax(*weights))


def nvfp4_group_scales(amax_g: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """E4M3 group scales `(N, G)` from group amax `(N, G)`: `gs * (amax_g / 6)`, clamped to
    448, round to nearest even; 0 becomes 0.125. float8_e4m3fn."""
    s = global_scale.to(torch.float32) * (amax_g / E2M1_MAX)
    s = s.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return torch.where(s == 0, NVFP4_ZERO_SCALE, s).to(torch.float8_e4m3fn)


def expand_scales(eff_scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """`(N, G)` -> `(N, G*g)`: each column's effective scale (static groups: column k
    always uses group k // g, whatever order a solver visits the columns in)."""
    return eff_scale.repeat_interleave(group_size, dim=-1)


def quantize_codes(w: torch.Tensor, eff_scale: torch.Tensor) -> torch.Tensor:
    """E2M1 codes uint8 `(N, K)` of `w / s` for group scales `(N, G)`."""
    x = _grouped(w.float(), _group_of(w, eff_scale)) / eff_scale.float().unsqueeze(-1)
    return e2m1_codes(x).flatten(-2)


def nvfp4_quantize(
    w: torch.Tensor, global_scale: torch.Tensor | None = None, amax_g: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 RTN of `w (N, K)`: `(codes uint8 (N, K), scale float8_e4m3fn (N, K/16),
    global_scale float32 (1,))`. `global_scale` defaults to this tensor's (pass the fused
    one for shards); `amax_g (N, K/16)` defaults to the min-max group amax (pass an MSE
    search's result instead)."""
    g = GROUP_SIZE["nvfp4"]
    if amax_g is None:
        amax_g = group_amax(w, g)
    if global_scale is None:
        global_scale = nvfp4_global_scale(tensor_amax(w))
    scale = nvfp4_group_scales(amax_g, global_scale)
    codes = quantize_codes(w, effective_scale(scale, global_scale))
    return codes, scale, global_scale.to(torch.float32).reshape(1)


def mxfp4_quantize(w: torch.Tensor, amax_g: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 RTN of `w (N, K)`: `(codes uint8 (N, K), scale uint8 E8M0 (N, K/32))`;
    `amax_g` as in `nvfp4_quantize`."""
    if amax_g is None:
        amax_g = group_amax(w, GROUP_SIZE["mxfp4"])
    scale = mxfp4_group_scales(amax_g)
    return quantize_codes(w, effective_scale(scale)), scale


def effective_scales(fmt: str, amax_g: torch.Tensor, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """float32 `(N, G)` scales a code is multiplied by, from group amax: the stored NVFP4
    (needs `global_scale`) or MXFP4 scale."""
    _group_size(fmt)
    if fmt == "mxfp4":
        return effective_scale(mxfp4_group_scales(amax_g))
    if global_scale is None:
        raise ValueError("nvfp4 scales need the tensor's global scale")
    return effective_scale(nvfp4_group_scales(amax_g, global_scale), global_scale)


def fake_quantize_weight(w: torch.Tensor, fmt: str, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Min-max RTN quantize-dequantize of `w (N, K)` in w's dtype: what AWQ's scale and clip
    search scores. NVFP4 uses `global_scale` (the fused shards' one) or w's own."""
    g = _group_size(fmt)
    if fmt == "nvfp4" and global_scale is None:
        global_scale = nvfp4_global_scale(tensor_amax(w))
    eff = effective_scales(fmt, group_amax(w, g), global_scale)
    return fake_quantize(_grouped(w, g), eff.unsqueeze(-1)).flatten(-2).to(w.dtype)


def mse_group_amax(
    w: torch.Tensor,
    fmt: str,
    global_scale: torch.Tensor | None = None,
    *,
    norm: float = MSE_DEFAULTS["norm"],
    **search: float,
) -> torch.Tensor:
    """Group amax `(N, G)` (float32) minimising `sum |qdq(x) - x| ** norm` per group over the
    shrink grid of llm-compressor's MSE observer (module doc; `search`: `shrink_search`'s
    grid, maxshrink, patience). NVFP4 without `global_scale` scores llm-compressor's
    continuous scale `p * amax / 6`; with it, the stored E4M3 scale relative to that global
    scale. MXFP4 scores its E8M0 scale."""
    g = _group_size(fmt)
    x = _grouped(w.float(), g)  # (N, G, g)
    amax = x.abs().amax(dim=-1)  # (N, G)

    def evaluate(p: float) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        cand = amax * p
        if fmt == "nvfp4" and global_scale is None:
            eff = cand / E2M1_MAX
            eff = torch.where(eff == 0, torch.finfo(torch.float32).eps, eff)
        else:
            eff = effective_scales(fmt, cand, global_scale)
        return (fake_quantize(x, eff.unsqueeze(-1)) - x).abs().pow(norm).sum(dim=-1), (cand,)

    return shrink_search(evaluate, **search)[0]


def nvfp4_fake_quantize_input(x: torch.Tensor, input_global_scale: torch.Tensor, *, rule: str = "vllm") -> torch.Tensor:
    """W4A4 NVFP4 activation quantize-dequantize `(..., K)` -> x's dtype, per 16 along K.

    rule "vllm": step for step as vLLM's CPU emulation (`ref_nvfp4_quant_dequant`): amax
    in float32, E4M3 scale `gs * (amax * (1/6))`, values times `1 / (s * (1 / gs))`,
    clamped to ±6, rounded, times `s / gs`. rule "compressed-tensors": what transformers
    runs (`compute_dynamic_scales_and_zp`, `fake_quantize`): `gs * (amax / 6)` with the
    division in x's dtype, a zero scale stored as 0.125, values divided by `s / gs`. They
    differ in rare last float32 bits, and for bfloat16 x in the rounding of amax / 6."""
    g = GROUP_SIZE["nvfp4"]
    gs = input_global_scale.to(torch.float32).reshape(1)
    xg = _grouped(x, g)  # (..., G, 16)
    if rule == "compressed-tensors":
        eff = effective_scales("nvfp4", xg.abs().amax(dim=-1), gs)
        return fake_quantize(xg, eff.unsqueeze(-1)).flatten(-2).to(x.dtype)
    if rule != "vllm":
        raise ValueError(f"unknown rule {rule!r}; expected 'vllm' or 'compressed-tensors'")
    return nvfp4_qdq_activations(x, gs)


def mxfp4_fake_quantize_input(x: torch.Tensor) -> torch.Tensor:
    """W4A4 MXFP4 activation quantize-dequantize `(..., K)` -> x's dtype: dynamic per-32
    E8M0 scales ("even" rule), values rounded to E2M1 (`kernels/fp4_act.py`)."""
    return mxfp4_qdq_activations(x)
