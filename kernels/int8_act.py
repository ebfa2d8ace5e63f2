"""INT8 activation quantization as vLLM's kernels compute it: per-token dynamic (symmetric or
with a zero point), static per-tensor (a calibrated `input_scale`, optionally `input_zero_point`),
and the quantize-dequantize ("fake quant") an evaluation runs in their place.

Codes are int8 in [-128, 127]; the real value a code stands for is (q - azp) * scale. Every
backend first converts the input (fp32, bf16, fp16) to float32 exactly, and computes in float32.
They differ in the reciprocal, in the rounding of ties and in what an all-zero row gives, so
`kernel` names the one to reproduce:

- "onednn": vLLM's CPU `dynamic_scaled_int8_quant` / `static_scaled_int8_quant`
  (csrc/cpu/dnnl_kernels.cpp), used by `CPUInt8ScaledMMLinearKernel`'s oneDNN path (every x86
  CPU without AMX, and every asymmetric-activation checkpoint):
  dynamic symmetric  scale = amax / 127 (float32 division), inv = float32(1 / double(scale));
  dynamic asymmetric scale = (max - min) / 255, azp = nearbyint(-128 - min / scale) over the
                     row's true min and max (zero need not be in range);
  static             inv = float32(1 / double(input_scale));
  then q = round_half_even(clamp(x * inv, -128, 127)); with a zero point the build contracts
  x * inv + azp into one fused multiply-add (one rounding). An all-zero row gets scale 0 and
  codes 0 (0 * inf is NaN, which the conversion turns into 0); a row with no range gets codes
  0 and the zero point INT32_MIN (x86's conversion of NaN or infinity).
- "onednn_avx2": the same ops in vLLM's AVX2 build (`_C_AVX2`, which vLLM loads on an x86 CPU
  without AVX-512, e.g. AMD Zen 3): the same formulas, but x * inv and the zero point are two
  roundings (no fused multiply-add), and NaN becomes -128 (the saturating int32 -> int8 pack of
  the integer indefinite), so an all-zero row gets codes -128 (which still stand for 0: its
  scale is 0). For symmetric activations (the only kind our checkpoints carry) the values it
  quantizes to are "onednn"'s bit for bit, which is why `vllm_kernel` answers "onednn" there.
- "sgl": the AMX kernels' `quantize_row_int8` (csrc/cpu/sgl-kernels/vec.h), used by
  `int8_scaled_mm_with_quant` (W8A8 on AMX: symmetric activations, K % 32 == 0, N % 16 == 0)
  and `int4_scaled_mm_cpu` (W4A8, see `kernels/w4a8.py`): amax = max(amax, 1e-7),
  scale = amax / 127, inv = 127 / amax (float32), q = round(x * inv) with ties to even for
  bf16 input (the AVX-512 specialisation) and away from zero otherwise (`std::round`).
  Dynamic symmetric only: that path ignores a static input_scale.
- "cuda": vLLM's CUDA kernels (csrc/quantization/w8a8/int8/scaled_quant.cu): dynamic
  scale = amax / 127, inv = 127 / amax (0 for an all-zero row); static symmetric q = x / scale
  (division); static and dynamic asymmetric inv = 1 / scale (float32) and the zero point added
  after rounding; ties to even, saturating.

Checked bit for bit against vLLM 0.32's CPU ops ("onednn" and "sgl" in its AVX-512 BF16 build,
"onednn_avx2" in its AVX2 build, which has no AMX ops) by `tests/vllm_int8_probe.py`;
the "cuda" formulas are read from the source only (and CUDA's asymmetric path for a row without
range is not emulated). This module knows nothing about layers, checkpoints or calibration.
Inputs are assumed finite.
"""

from __future__ import annotations

import torch

KERNELS = ("onednn", "onednn_avx2", "sgl", "cuda")
QMIN, QMAX = -128, 127
SGL_EPS = 1e-7  # the AMX kernels' floor of a row's absolute maximum


def _check(x: torch.Tensor, kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"int8 activations: unknown kernel {kernel!r}; expected one of {KERNELS}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"int8 activations: x must be fp32, bf16 or fp16, got {x.dtype}")


def _f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def _reciprocal_via_double(scale: torch.Tensor) -> torch.Tensor:
    """float32(1.0 / double(scale)): the C++ `cvt_vec_t inv_scale(1.0 / scale)` (inf for 0)."""
    return (1.0 / scale.double()).float()


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """`std::round` on float32 values: nearest integer, ties away from zero (exact: v - trunc(v)
    is representable)."""
    t = torch.trunc(v)
    return torch.where((v - t).abs() >= 0.5, t + torch.sign(v), t)


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 a * b + c with one rounding, as a fused multiply-add: the product of two
    float32 values is exact in float64; the float64 sum, rounded to float32, errs from the
    fused result only when its own rounding lands on a float32 tie (double rounding)."""
    return (a.double() * b.double() + c.double()).float()


def _to_int32(v: torch.Tensor) -> torch.Tensor:
    """float32 -> int32 as x86's `cvttss2si`: truncation; NaN, infinities and values out of
    range give INT32_MIN (the "integer indefinite")."""
    ok = torch.isfinite(v) & (v.abs() < 2.0**31)
    return torch.where(ok, torch.trunc(torch.where(ok, v, 0.0)), -(2.0**31)).to(torch.int32)


def _to_codes(v: torch.Tensor, nan: float = 0.0) -> torch.Tensor:
    """clamp(v) to [-128, 127] (NaN stays NaN, as `_mm512_min/max_ps` keep it), ties to even,
    NaN -> `nan`: 0 from the truncating int32 -> int8 conversion of 0x80000000 (AVX-512), -128
    from the saturating one (AVX2); int8."""
    v = torch.clamp(v, QMIN, QMAX)
    return torch.nan_to_num(torch.round(v), nan=nan).to(torch.int8)


def _onednn_codes(x: torch.Tensor, inv: torch.Tensor, azp: torch.Tensor | None, kernel: str) -> torch.Tensor:
    """round_half_even(clamp(x * inv [+ azp])) as the "onednn" kernels compute it: the AVX-512
    build contracts x * inv + azp into one fused multiply-add, the AVX2 build rounds twice."""
    if kernel == "onednn_avx2":
        return _to_codes(x * inv if azp is None else x * inv + azp, nan=float(QMIN))
    return _to_codes(x * inv if azp is None else _fma(x, inv, azp))


def has_amx() -> bool:
    """True on a CPU with AMX tiles (Sapphire Rapids and newer), as vLLM's CPU build asks torch."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


def has_avx512() -> bool:
    """True where vLLM's CPU build loads one of its AVX-512 libraries (`_C`, `_C_AVX512`), not
    `_C_AVX2`: what `vllm.platforms.cpu` asks torch (`torch.cpu._is_avx512_supported()`)."""
    probe = getattr(torch.cpu, "_is_avx512_supported", None)
    return bool(probe()) if probe is not None else False


def vllm_kernel(
    device_type: str,
    n: int,
    k: int,
    *,
    amx: bool | None = None,
    symmetric: bool = True,
    avx512: bool | None = None,
) -> str:
    """The kernel vLLM 0.32 quantizes a W8A8 linear's activations with (its weight (n, k)) on
    `device_type`: "cuda" on a GPU; on a CPU "sgl" where `CPUInt8ScaledMMLinearKernel` takes
    the AMX path (AMX, symmetric activations, k % 32 == 0, n % 16 == 0: vLLM checks the fused
    q/k/v and gate/up weights, this the linear's own), else "onednn" ("onednn_avx2" for
    asymmetric activations on a CPU without AVX-512; symmetric ones quantize to the same values
    in both builds). `amx`, `avx512` None: this CPU's."""
    if device_type == "cuda":
        return "cuda"
    amx = has_amx() if amx is None else amx
    if amx and symmetric and k % 32 == 0 and n % 16 == 0:
        return "sgl"
    avx512 = has_avx512() if avx512 is None else avx512
    return "onednn" if symmetric or avx512 else "onednn_avx2"


def quantize_per_token(
    x: torch.Tensor, *, symmetric: bool = True, kernel: str = "onednn"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Dynamic per-token quantization of x (..., K): codes int8 (..., K), scale fp32 (..., 1),
    and azp int32 (..., 1) when asymmetric (else None). See the module doc for each kernel."""
    _check(x, kernel)
    xf = x.float()
    if not symmetric:
        if kernel == "sgl":
            raise ValueError("int8 activations: the AMX (sgl) kernels quantize activations symmetrically only")
        lo, hi = xf.amin(dim=-1, keepdim=True), xf.amax(dim=-1, keepdim=True)
        scale = (hi - lo) / _f32(255.0)
        azp = torch.round(_f32(-128.0) - lo / scale)  # nearbyint: ties to even
        if kernel in ("onednn", "onednn_avx2"):
            q = _onednn_codes(xf, _reciprocal_via_double(scale), azp, kernel)  # the float zero point
            return q, scale, _to_int32(azp)
        # cuda: round, then add the zero point as an integer, saturating
        v = torch.round(xf * (_f32(1.0) / scale))
        q = torch.clamp(torch.nan_to_num(v, nan=0.0) + azp, QMIN, QMAX).to(torch.int8)
        return q, scale, torch.nan_to_num(azp, nan=0.0).to(torch.int32)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    if kernel == "sgl":
        amax = torch.clamp(amax, min=SGL_EPS)
        scale = amax / _f32(127.0)
        v = xf * (_f32(127.0) / amax)
        r = torch.round(v) if x.dtype == torch.bfloat16 else _round_half_away(v)
        return r.to(torch.int8), scale, None
    scale = amax / _f32(127.0)
    if kernel in ("onednn", "onednn_avx2"):
        return _onednn_codes(xf, _reciprocal_via_double(scale), None, kernel), scale, None
    inv = torch.where(amax == 0, torch.zeros_like(amax), _f32(127.0) / amax)
    return _to_codes(xf * inv), scale, None


def quantize_static(
    x: torch.Tensor, scale: torch.Tensor, azp: torch.Tensor | None = None, *, kernel: str = "onednn"
) -> torch.Tensor:
    """Static per-tensor quantization of x (..., K) with `scale` fp32 (1,) and optional `azp`
    int32 (1,): codes int8 (..., K)."""
    _check(x, kernel)
    if scale.numel() != 1 or (azp is not None and azp.numel() != 1):
        raise ValueError("int8 activations: a static scale and zero point are single per-tensor values")
    if kernel == "sgl":
        raise ValueError(
            "int8 activations: the AMX (sgl) W8A8 kernel ignores a static input_scale "
            "and quantizes per token; use quantize_per_token(kernel='sgl')"
        )
    xf = x.float()
    s = scale.float().reshape(())
    if kernel in ("onednn", "onednn_avx2"):
        return _onednn_codes(xf, _reciprocal_via_double(s), None if azp is None else azp.float().reshape(()), kernel)
    if azp is None:
        return _to_codes(xf / s)
    v = torch.round(xf * (_f32(1.0) / s))
    return torch.clamp(torch.clamp(v, -(2.0**31), 2.0**31) + azp.float().reshape(()), QMIN, QMAX).to(torch.int8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, azp: torch.Tensor | None = None) -> torch.Tensor:
    """The values codes q stand for, (q - azp) * scale, in float32 (scale and azp broadcast)."""
    qf = q.float() if azp is None else q.float() - azp.float()
    return qf * scale.float()


def fake_quantize(
    x: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    input_zero_point: torch.Tensor | None = None,
    *,
    symmetric: bool = True,
    kernel: str = "onednn",
) -> torch.Tensor:
    """Quantize-dequantize x (..., K) as the int8 GEMM sees it, float32 (..., K): per token when
    `input_scale` is None (`symmetric` chooses the zero point), else with the static scale (and
    zero point)."""
    if input_scale is None:
        q, scale, azp = quantize_per_token(x, symmetric=symmetric, kernel=kernel)
        return dequantize(q, scale, azp)
    q = quantize_static(x, input_scale, input_zero_point, kernel=kernel)
    return dequantize(q, input_scale.reshape(()), None if input_zero_point is None else input_zero_point.reshape(()))
