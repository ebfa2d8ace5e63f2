"""FP8 (e4m3) GEMM: `x @ (w_fp8 * w_scale)ᵀ` with the weight dequantized inside the
kernel, in two modes:

- "w8a16": activations stay fp16/bf16/fp32; FP8 weights are upcast in-kernel;
- "w8a8":  activations are quantized to e4m3 once, before the GEMM, by
           `quantize_per_token` (`a_scale[m] = max(amax_k |x[m, k]| / 448, 1 / (448·512))`,
           vLLM's dynamic per-token scale and floor, or a static per-tensor `input_scale`),
           then FP8 x FP8 `tl.dot` with fp32 accumulation, as vLLM quantizes then calls its
           scaled GEMM. We quantize `x / a_scale` (IEEE division); vLLM's CUDA kernel
           multiplies by the reciprocal, which can differ in the last fp32 bit and so,
           rarely, by one e4m3 step.

Operands (the compressed-tensors / vLLM orientation):
- `x`       `(M, K)` fp16, bf16 or fp32;
- `w_fp8`   torch.float8_e4m3fn `(N, K)`;
- `w_scale` fp32, `(1,)` per tensor, `(N, 1)` per output channel, or
            `(ceil(N/bn), ceil(K/bk))` per `block_size = (bn, bk)` block (128x128 usual);
- `input_scale` fp32 `(1,)` static activation scale (w8a8 only) or None = dynamic.
Result `(M, N)` in x's dtype.

Paths (`Fp8Config.path`, from M by `choose_config`, or the tuned table): "gemv" for M <= 4
(no `tl.dot`: each weight tile read once along K, its contiguous dimension, upcast to fp32
and multiplied by each row's activations, the K loop split so one row fills the GPU), "dot"
otherwise (`tl.dot`, FP8 x FP8 on sm_89+ in W8A8). Split-K is reduced in the same launch.

The activations are rounded by torch's cast (round to nearest even, after clamping to
±448), never in the kernel: the Triton interpreter's float->fp8 cast does not round
correctly, and rounding inside the GEMM would redo it for every output tile.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from infer_tool.kernels import backend, tuning
from infer_tool.kernels.backend import Launch, sm_count, use_triton
from infer_tool.kernels.splitk import serial_store, tile_locks
from infer_tool.kernels.tiles import grouped_tile

FP8_MAX = 448.0  # largest finite float8_e4m3fn
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # floor of a dynamic activation scale (all-zero rows)
MODES = ("w8a8", "w8a16")


@dataclass(frozen=True)
class Fp8Config:
    """Meta-parameters of one launch (split-K partials are reduced deterministically, in
    the same launch: `splitk.serial_store`)."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    SPLIT_K: int = 1
    GROUP_M: int = 8
    num_warps: int = 4
    num_stages: int = 3
    path: str = "dot"  # "gemv" (M <= 4, no tl.dot) or "dot"


PATHS = ("gemv", "dot")


def choose_config(M: int, N: int, K: int, num_sms: int, scale_block_k: int | None = None) -> Fp8Config:
    """Default configuration on a device with `num_sms` SMs. With block scales along K
    (`scale_block_k`), BLOCK_K is shrunk to divide the scale block."""
    # Tile sizes chosen to stay spill-free on sm_90, checked with ptxas through
    # `Launch.compile_for`.
    if M <= 4:  # decode: the gemv keeps (BLOCK_N, BLOCK_K) fp32 products per row
        block_m = triton.next_power_of_2(M)
        cfg = Fp8Config(BLOCK_M=block_m, BLOCK_N=32 if block_m <= 2 else 16, BLOCK_K=128, num_warps=4,
                        num_stages=3, path="gemv")
    elif M <= 64:
        block_m = max(16, triton.next_power_of_2(M))
        cfg = Fp8Config(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, num_warps=8 if block_m >= 64 else 4)
    else:
        cfg = Fp8Config(BLOCK_M=128 if M >= 128 else 64, BLOCK_N=128, BLOCK_K=64, num_warps=8)
    if scale_block_k is not None:
        block_k = cfg.BLOCK_K
        while scale_block_k % block_k and block_k > 16:
            block_k //= 2
        cfg = replace(cfg, BLOCK_K=block_k)
    if M > 64:
        return cfg
    tiles = triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N)
    k_blocks = triton.cdiv(K, cfg.BLOCK_K)
    target = (4 if cfg.path == "gemv" else 2) * num_sms
    split = max(1, min(triton.cdiv(target, tiles), k_blocks // 2, 16))
    return replace(cfg, SPLIT_K=split)


@triton.jit
def _fp8_kernel(
    # pointers
    x_ptr, w_ptr, ws_ptr, xs_ptr, out_ptr, part_ptr, lock_ptr,
    # sizes
    M, N, K, scale_bn, scale_bk,
    # strides
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_wsn, stride_wsk,
    stride_om, stride_on,
    # meta-parameters
    W8A8: tl.constexpr, SCALE_IN_LOOP: tl.constexpr,
    FP8_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One `(BLOCK_M, BLOCK_N)` output tile over K-blocks `pid_k, pid_k + SPLIT_K, ...`.

    x `(M, K)`: e4m3 codes (W8A8) or fp16/bf16/fp32 (W8A16); w fp8 `(N, K)` read as
    `(BK, BN)` tiles; ws fp32 `(N/scale_bn, K/scale_bk)` (per-tensor and per-channel are
    blocks spanning K); xs fp32 `(M,)` activation scales (W8A8); out `(M, N)`; part fp32
    `(SPLIT_K, M, N)` split-K partials, lock int32 per output tile (`splitk.serial_store`).
    SCALE_IN_LOOP: the weight scale changes along K (block scales), applied per K-block.
    """
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)  # kernels/tiles.py

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    num_kb = (K + BLOCK_K - 1) // BLOCK_K

    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for kb in range(pid_k, num_kb, SPLIT_K):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # (BM, BK)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # (BK, BN) fp8
        if W8A8:
            if FP8_DOT:
                part = tl.dot(x, w)
            else:
                part = tl.dot(x.to(tl.float16), w.to(tl.float16))
        else:
            part = tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
        if SCALE_IN_LOOP:
            ws = tl.load(ws_ptr + (offs_n // scale_bn) * stride_wsn + ((kb * BLOCK_K) // scale_bk) * stride_wsk,
                         mask=mask_n, other=0.0)
            acc += part * ws[None, :]
        else:
            acc += part

    if not SCALE_IN_LOOP:
        ws = tl.load(ws_ptr + (offs_n // scale_bn) * stride_wsn, mask=mask_n, other=0.0)
        acc = acc * ws[None, :]
    if W8A8:
        acc = acc * tl.load(xs_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    part_ptrs = part_ptr + offs_m[:, None] * N + offs_n[None, :]
    mask_out = mask_m[:, None] & mask_n[None, :]
    serial_store(acc, out_ptrs, part_ptrs, M * N, lock_ptr + pid, pid_k, mask_out, SPLIT_K)


@triton.jit
def _fp8_gemv_kernel(
    # pointers
    x_ptr, w_ptr, ws_ptr, xs_ptr, out_ptr, part_ptr, lock_ptr,
    # sizes
    M, N, K, scale_bn, scale_bk, kb_per_split,
    # strides
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_wsn, stride_wsk,
    stride_om, stride_on,
    # meta-parameters
    W8A8: tl.constexpr, SCALE_IN_LOOP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """"gemv" (M <= 4): rows `BLOCK_M` (1, 2 or 4) x columns `BLOCK_N`, K-blocks
    `pid_k * kb_per_split ..` (a contiguous run), no `tl.dot`: the weight tile `(BN, BK)` is
    read once along K (its contiguous dimension), upcast to fp32 and multiplied by each
    row's activations, accumulated elementwise per row and reduced over K at the end.
    Operands as in `_fp8_kernel`; x e4m3 codes (W8A8) or fp16/bf16/fp32.
    """
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    m0 = pid_m * BLOCK_M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    num_kb = (K + BLOCK_K - 1) // BLOCK_K
    kb_start = pid_k * kb_per_split
    kb_end = tl.minimum(kb_start + kb_per_split, num_kb)

    acc0 = tl.full((BLOCK_N, BLOCK_K), 0.0, tl.float32)
    acc1 = tl.full((BLOCK_N, BLOCK_K), 0.0, tl.float32)
    acc2 = tl.full((BLOCK_N, BLOCK_K), 0.0, tl.float32)
    acc3 = tl.full((BLOCK_N, BLOCK_K), 0.0, tl.float32)
    for kb in range(kb_start, kb_end):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk,
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)  # (BN, BK)
        if SCALE_IN_LOOP:
            ws = tl.load(ws_ptr + (offs_n // scale_bn) * stride_wsn + ((kb * BLOCK_K) // scale_bk) * stride_wsk,
                         mask=mask_n, other=0.0)
            w = w * ws[:, None]
        x0 = tl.load(x_ptr + m0 * stride_xm + offs_k * stride_xk, mask=mask_k & (offs_k * 0 + m0 < M),
                     other=0.0).to(tl.float32)
        acc0 += w * x0[None, :]
        if BLOCK_M > 1:
            x1 = tl.load(x_ptr + (m0 + 1) * stride_xm + offs_k * stride_xk,
                         mask=mask_k & (offs_k * 0 + m0 + 1 < M), other=0.0).to(tl.float32)
            acc1 += w * x1[None, :]
        if BLOCK_M > 2:
            x2 = tl.load(x_ptr + (m0 + 2) * stride_xm + offs_k * stride_xk,
                         mask=mask_k & (offs_k * 0 + m0 + 2 < M), other=0.0).to(tl.float32)
            x3 = tl.load(x_ptr + (m0 + 3) * stride_xm + offs_k * stride_xk,
                         mask=mask_k & (offs_k * 0 + m0 + 3 < M), other=0.0).to(tl.float32)
            acc2 += w * x2[None, :]
            acc3 += w * x3[None, :]

    if not SCALE_IN_LOOP:
        ws_n = tl.load(ws_ptr + (offs_n // scale_bn) * stride_wsn, mask=mask_n, other=0.0)
    for j in tl.static_range(BLOCK_M):
        if j == 0:
            acc = acc0
        elif j == 1:
            acc = acc1
        elif j == 2:
            acc = acc2
        else:
            acc = acc3
        row = m0 + j
        row_ok = (offs_n * 0 + row) < M
        total = tl.reduce(acc, 1, tl.standard._sum_combine)  # (BN,)
        if not SCALE_IN_LOOP:
            total = total * ws_n
        if W8A8:
            total = total * tl.load(xs_ptr + row + offs_n * 0, mask=row_ok, other=0.0)
        serial_store(total, out_ptr + row * stride_om + offs_n * stride_on, part_ptr + row * N + offs_n,
                     M * N, lock_ptr + pid * BLOCK_M + j, pid_k, mask_n & row_ok, SPLIT_K)


def scale_blocks(w_scale: torch.Tensor, N: int, K: int,
                 block_size: tuple[int, int] | None) -> tuple[torch.Tensor, int, int]:
    """`w_scale` as a 2-D `(rows, cols)` grid and the `(bn, bk)` weight block each entry
    covers: per tensor `(1, 1)` over `(N, K)`, per channel `(N, 1)` over `(1, K)`, per
    block `(ceil(N/bn), ceil(K/bk))` over `block_size`."""
    if w_scale.dtype != torch.float32:
        raise ValueError(f"fp8: w_scale must be float32, got {w_scale.dtype}")
    if block_size is not None:
        bn, bk = (int(b) for b in block_size)
        want = (-(-N // bn), -(-K // bk))
        if tuple(w_scale.shape) != want:
            raise ValueError(f"fp8: block_size {block_size} needs w_scale {want}, got {tuple(w_scale.shape)}")
        return w_scale, bn, bk
    if w_scale.numel() == 1:
        return w_scale.reshape(1, 1), N, K
    if w_scale.numel() == N and (w_scale.dim() == 1 or w_scale.shape[-1] == 1):
        return w_scale.reshape(N, 1), 1, K
    raise ValueError(
        f"fp8: w_scale shape {tuple(w_scale.shape)} is none of (1,), (N={N}, 1) or a block "
        "grid with block_size"
    )


def _check(x: torch.Tensor, w_fp8: torch.Tensor, mode: str, input_scale: torch.Tensor | None) -> None:
    if mode not in MODES:
        raise ValueError(f"fp8: unknown mode {mode!r}; expected one of {MODES}")
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"fp8: x must be 2-D fp16/bf16/fp32, got {x.dtype} {tuple(x.shape)}")
    if w_fp8.dtype != torch.float8_e4m3fn or w_fp8.dim() != 2 or w_fp8.shape[1] != x.shape[1]:
        raise ValueError(
            f"fp8: w_fp8 must be float8_e4m3fn (N, K={x.shape[1]}), got {w_fp8.dtype} {tuple(w_fp8.shape)}"
        )
    if input_scale is not None and (mode != "w8a8" or input_scale.numel() != 1):
        raise ValueError("fp8: input_scale is a single per-tensor value and only used with mode='w8a8'")


def quantize_per_token(x: torch.Tensor, input_scale: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference activation quantization: e4m3 `(M, K)` and fp32 scales `(M, 1)`
    (dynamic per token, or the static per-tensor `input_scale` broadcast)."""
    xf = x.float()
    if input_scale is None:
        a_scale = torch.clamp(xf.abs().amax(dim=1, keepdim=True) / FP8_MAX, min=MIN_SCALE)
    else:
        a_scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    xq = torch.clamp(xf / a_scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return xq, a_scale


def dequantize_fp8(w_fp8: torch.Tensor, w_scale: torch.Tensor, block_size: tuple[int, int] | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense weight `(N, K)` in `dtype`: `w_fp8 * w_scale` broadcast over its blocks."""
    N, K = w_fp8.shape
    grid, bn, bk = scale_blocks(w_scale, N, K, block_size)
    s = grid.to(dtype).repeat_interleave(bn, dim=0)[:N].repeat_interleave(bk, dim=1)[:, :K]
    return w_fp8.to(dtype) * s


def fp8_reference(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, mode: str = "w8a8",
                  block_size: tuple[int, int] | None = None, input_scale: torch.Tensor | None = None,
                  *, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pure-torch FP8 linear (no bias), `(M, N)` in `compute_dtype`."""
    _check(x, w_fp8, mode, input_scale)
    w = dequantize_fp8(w_fp8, w_scale, block_size, compute_dtype)  # (N, K)
    if mode == "w8a16":
        return x.to(compute_dtype) @ w.T
    xq, a_scale = quantize_per_token(x, input_scale)
    return (xq.to(compute_dtype) @ w.T) * a_scale.to(compute_dtype)


def fp8_matmul(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, mode: str = "w8a8",
               block_size: tuple[int, int] | None = None, input_scale: torch.Tensor | None = None,
               *, config: Fp8Config | None = None) -> torch.Tensor:
    """`x @ (w_fp8 * w_scale)ᵀ` `(M, N)` in x's dtype; see the module doc for modes and
    scale shapes. Triton on CUDA (or under TRITON_INTERPRET=1), torch reference otherwise."""
    if not use_triton(x):
        return fp8_reference(x, w_fp8, w_scale, mode, block_size, input_scale).to(x.dtype)
    launch, out = plan(x, w_fp8, w_scale, mode, block_size, input_scale, config=config)
    launch.run()  # split-K reduced in the same launch, in a fixed order
    return out


def plan(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, mode: str,
         block_size: tuple[int, int] | None, input_scale: torch.Tensor | None, *,
         config: Fp8Config | None = None) -> tuple[Launch, torch.Tensor]:
    """Check the operands, allocate the output and build the launch: `(launch, out)`,
    out `(M, N)` in x's dtype. The config: `config`, else the tuned table's (`tuning.py`,
    keyed with the scale block along K as the group), else `choose_config`."""
    _check(x, w_fp8, mode, input_scale)
    M, K = x.shape
    N = w_fp8.shape[0]
    grid_s, bn, bk = scale_blocks(w_scale, N, K, block_size)
    scale_in_loop = grid_s.shape[1] > 1  # the weight scale changes along K
    tuned = tuning.lookup(x.device, f"fp8-{mode}", M, N, K, bk if scale_in_loop else 0)
    cfg = config or (Fp8Config(**tuned) if tuned is not None else None)
    cfg = cfg or choose_config(M, N, K, sm_count(x.device), bk if scale_in_loop else None)
    if scale_in_loop and bk % cfg.BLOCK_K:
        raise ValueError(f"fp8: BLOCK_K={cfg.BLOCK_K} must divide the scale block along K ({bk})")
    if cfg.path not in PATHS:
        raise ValueError(f"fp8: unknown config path {cfg.path!r}; expected one of {PATHS}")
    gemv = cfg.path == "gemv"
    if gemv and cfg.BLOCK_M > 4:
        raise ValueError(f"fp8: the gemv takes BLOCK_M <= 4, got {cfg.BLOCK_M}")
    if not gemv and cfg.BLOCK_M < 16:
        raise ValueError(f"fp8: tl.dot needs BLOCK_M >= 16, got {cfg.BLOCK_M}")
    out_dtype = x.dtype
    if mode == "w8a8":  # quantized once here, not per output tile in the kernel
        x, a_scale = quantize_per_token(x, input_scale)
        xs = a_scale.reshape(M).contiguous()
    else:
        x, xs = x.contiguous(), grid_s  # xs unused
    num_kb = triton.cdiv(K, cfg.BLOCK_K)
    split = max(1, min(cfg.SPLIT_K, num_kb))
    per_split = triton.cdiv(num_kb, split)
    if gemv:
        split = triton.cdiv(num_kb, per_split)  # the gemv's splits are contiguous runs: none empty
    tiles = triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N)
    out = backend.empty_output((M, N), out_dtype, x.device)
    if split > 1:
        part = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
        locks = tile_locks(x.device, tiles * cfg.BLOCK_M)  # the gemv counts rows apart
    else:
        part = locks = out  # unused
    # FP8 x FP8 tl.dot needs sm_89+; older GPUs multiply the exact fp16 upcasts instead.
    fp8_dot = x.device.type != "cuda" or torch.cuda.get_device_capability(x.device) >= (8, 9)
    args = (
        x, w_fp8, grid_s, xs, out, part, locks,
        M, N, K, bn, bk,
        x.stride(0), x.stride(1),
        w_fp8.stride(0), w_fp8.stride(1),
        grid_s.stride(0), grid_s.stride(1),
        out.stride(0), out.stride(1),
    )
    meta = dict(
        W8A8=mode == "w8a8", SCALE_IN_LOOP=scale_in_loop, FP8_DOT=fp8_dot,
        DOT_PRECISION="ieee" if out_dtype == torch.float32 else "tf32",
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
        SPLIT_K=split, GROUP_M=cfg.GROUP_M,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if gemv:
        args = args[:12] + (per_split,) + args[12:]  # after scale_bn, scale_bk
        meta = {k: v for k, v in meta.items() if k not in ("FP8_DOT", "DOT_PRECISION", "GROUP_M")}
        return Launch(_fp8_gemv_kernel, (tiles, split), args, meta), out
    return Launch(_fp8_kernel, (tiles, split), args, meta), out
