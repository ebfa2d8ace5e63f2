"""W4A4 activation quantize-dequantize as the runtime does it (pure torch, any device): what
an FP4 linear applies to its input before the weights-only product (`quant_linear.Fp4Linear`),
and the two rounding rules every FP4 quantizer shares (`packers/fp4.py` imports them).

- E2M1 rounding (`e2m1_index`, `round_to_e2m1`): nearest of the magnitudes (0, 0.5, 1, 1.5,
  2, 3, 4, 6), ties to the even mantissa, saturating at 6; a negative value that rounds to 0
  keeps its sign. compressed-tensors 0.19/0.20 `quantization/utils/fp4_utils.py`
  `cast_to_fp4` and vLLM 0.32 `nvfp4_emulation_utils.py` `cast_to_fp4` use these thresholds.
- E8M0 group scales (`mxfp4_group_scales`): compressed-tensors `mxfp_utils.py`
  `generate_mx_scales` ("even" rule): a group max with mantissa >= 1.75 goes up one binade,
  then `u = 127 + floor(log2(.)) - 2`, clamped to 0..254; the scale is `2 ** (u - 127)`.
- NVFP4 activations (`nvfp4_qdq_activations`): step for step vLLM 0.32's CPU emulation
  `ref_nvfp4_quant_dequant`: per 16 along K, amax in float32, E4M3 scale `gs * (amax * (1/6))`
  with `gs` the static `input_global_scale`, values times `1 / (s * (1 / gs))`, clamped to
  ±6, rounded, times `s / gs`. (vLLM's CUDA Triton path multiplies by `gs / s`: last-bit
  differences possible.)
- MXFP4 activations (`mxfp4_qdq_activations`): dynamic per-32 E8M0 scales by the rule above,
  values rounded to E2M1 (amd-quark's `qdq_mxfp4(x, "even")`, which vLLM's MXFP4 emulation calls).

Shapes: `(..., K)`, K a multiple of the group (16 / 32). This module knows nothing about how
weights were quantized or stored.
"""

from __future__ import annotations

import torch

from infer_tool.kernels.fp4_layout import E2M1_MAX, E2M1_VALUES, GROUP_SIZE, effective_scale

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
MX_ELEM_EMAX = 2  # floor(log2(E2M1_MAX)): the E8M0 exponent offset

# Rounding thresholds on |x|: (threshold, inclusive); the index is the number passed.
_UP = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


_BINADE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # exact in float32
_EXPONENT = 0x7F800000  # float32 exponent field
_ONE_BINADE = 1 << 23  # one step of that field
_BOUNDS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # (dtype, device) -> exclusive bounds
_VALUES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # (dtype, device) -> E2M1_VALUES


def _exclusive_bounds(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`_UP` as bounds b with "|x| > b" for every step, in `dtype` (float64, else float32,
    which holds every float16 / bfloat16 value exactly): an inclusive threshold t becomes the
    largest value below t, so `|x| >= t` and `|x| > b` agree on every value of that dtype."""
    key = (dtype, device)
    if key not in _BOUNDS:
        t = torch.tensor([t for t, _ in _UP], dtype=dtype, device=device)
        inclusive = torch.tensor([inc for _, inc in _UP], device=device)
        _BOUNDS[key] = torch.where(inclusive, torch.nextafter(t, torch.full_like(t, float("-inf"))), t)
    return _BOUNDS[key]


SEARCH_MAX = 4096  # up to this many elements one binary search each beats seven passes (a GPTQ column)


def _index_u8(x: torch.Tensor) -> torch.Tensor:
    """`e2m1_index`: the number of thresholds |x| passed, uint8. A small tensor takes one binary
    search per element over the exclusive bounds (fewer kernel launches), a large one a pass per
    threshold counted in uint8 (vectorised, an eighth of int64's memory traffic); the two agree
    on every value, NaN passing none."""
    if x.numel() > SEARCH_MAX:
        a = x.abs()
        passed = torch.empty(x.shape, dtype=torch.bool, device=x.device)  # one buffer for every threshold
        idx = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
        for t, inclusive in _UP:
            (torch.ge if inclusive else torch.gt)(a, t, out=passed)
            idx += passed.view(torch.uint8)  # uint8 + uint8: no mixed-dtype (casting) loop
        return idx
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    a = torch.nan_to_num(x.abs().to(dtype), nan=0.0)
    return torch.bucketize(a, _exclusive_bounds(dtype, x.device)).to(torch.uint8)


def _index(x: torch.Tensor) -> torch.Tensor:
    """`_index_u8` as int64, to index a table of values."""
    return _index_u8(x).long()


def e2m1_index(x: torch.Tensor) -> torch.Tensor:
    """Index into `E2M1_VALUES` of the nearest grid magnitude of |x| (ties to even,
    saturating at 6; NaN gives 0), uint8 of x's shape."""
    return _index_u8(x)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value of every element (float, x's dtype); negative values that round
    to zero give -0.0. A large float32 / float16 / bfloat16 tensor takes `_round_binades`
    (a few passes), the rest a lookup of `_index` (the two agree on every value)."""
    if x.numel() > SEARCH_MAX and x.dtype in _BINADE_DTYPES:
        return _round_binades(x)
    key = (x.dtype, x.device)
    if key not in _VALUES:
        _VALUES[key] = torch.tensor(E2M1_VALUES, dtype=x.dtype, device=x.device)
    mag = _VALUES[key][_index(x)]
    return torch.where(x < 0, -mag, mag)


def _round_binades(x: torch.Tensor) -> torch.Tensor:
    """`round_to_e2m1` in float32, then x's dtype: x clamped to ±6 and rounded (half to
    even, symmetric in the sign) to a multiple of its binade's step: 0.5 below 2 in
    magnitude, 1 in [2, 4), 2 from 4 (step = max(0.5, 2^(floor(log2 |x|) - 1)), read off
    the exponent bits). Scaling by a power of two is exact, so this is the rounding of the
    thresholds in `_UP`, ties to the even mantissa included; a negative x that rounds to 0
    gives -0.0, while -0.0 itself becomes +0.0 (the `+ 0.0`), as does NaN."""
    a = x.float() + 0.0  # a new float32 tensor (x.float() is x itself for float32)
    a = a.clamp_(-E2M1_MAX, E2M1_MAX)
    step = ((a.view(torch.int32) & _EXPONENT) - _ONE_BINADE).view(torch.float32).clamp_(min=0.5)
    return a.div_(step).round_().mul_(step).nan_to_num_(nan=0.0).to(x.dtype)


def mxfp4_group_scales(amax_g: torch.Tensor) -> torch.Tensor:
    """E8M0 biased exponents uint8 `(N, G)` from group amax `(N, G)` (the "even" rule)."""
    bits = amax_g.to(torch.float32).abs().view(torch.int32)
    binade = ((bits + (1 << 21)) >> 23) & 0xFF  # fp32 exponent field after rounding up mantissas >= 1.75
    return (binade - MX_ELEM_EMAX).clamp(0, 254).to(torch.uint8)  # 127 + (binade - 127) - 2


def _groups(x: torch.Tensor, g: int) -> torch.Tensor:
    if x.dim() == 0 or x.shape[-1] % g:
        raise ValueError(f"FP4: K={x.shape[-1] if x.dim() else None} is not a multiple of the group size {g}")
    return x.unflatten(-1, (-1, g))


def _reciprocal(t: torch.Tensor) -> torch.Tensor:
    """vLLM's `get_reciprocal`: 1 / t, with 1e-8 where t == 0."""
    return 1.0 / (t + (t == 0) * 1e8)


def nvfp4_qdq_activations(x: torch.Tensor, input_global_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 W4A4 input quantize-dequantize `(..., K)` -> x's dtype, as vLLM's emulation (module doc)."""
    gs = input_global_scale.to(torch.float32).reshape(1)
    xg = _groups(x, GROUP_SIZE["nvfp4"])  # (..., G, 16)
    vec_max = xg.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    s = gs * (vec_max * (1 / E2M1_MAX))
    s = s.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    out_scale = _reciprocal(s * _reciprocal(gs))
    q = round_to_e2m1((xg.to(torch.float32) * out_scale).clamp(-E2M1_MAX, E2M1_MAX))
    return (q * (s / gs)).flatten(-2).to(x.dtype)


def mxfp4_qdq_activations(x: torch.Tensor) -> torch.Tensor:
    """MXFP4 W4A4 input quantize-dequantize `(..., K)` -> x's dtype (dynamic per-32 E8M0)."""
    xg = _groups(x.float(), GROUP_SIZE["mxfp4"])
    s = effective_scale(mxfp4_group_scales(xg.abs().amax(dim=-1))).unsqueeze(-1)
    return (round_to_e2m1(xg / s) * s).flatten(-2).to(x.dtype)
