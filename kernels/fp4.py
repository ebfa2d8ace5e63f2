"""FP4 weights-only GEMM (NVFP4A16 / MXFP4A16): activations (fp16/bf16/fp32) times a packed
E2M1 weight, dequantized inside the matrix multiply (the dense weight is never materialised).

Operands (compressed-tensors' checkpoint layout, see `fp4_layout.py`; nothing is repacked):
- `x`            `(M, K)` fp16, bf16 or fp32 activations;
- `w_packed`     uint8 `(N, K/2)`: the code of `w[n, k]` in the low nibble (k even) or high
                 nibble (k odd) of `w_packed[n, k // 2]`; bit 3 sign, bits 0..2 index
                 (0, 0.5, 1, 1.5, 2, 3, 4, 6);
- `w_scale`      `(N, K/g)`: NVFP4 float8_e4m3fn, g = 16; MXFP4 uint8 E8M0 exponents, g = 32;
- `global_scale` NVFP4: float32 `(1,)`, the checkpoint's `weight_global_scale` (a divisor);
                 MXFP4: None.
K must be a multiple of g. Dequantisation: `w[n, k] = value(code) * s_eff[n, k // g]` with
`s_eff = s / global_scale` (NVFP4) or `2 ** (u - 127)` (MXFP4), rounded to x's dtype before
the product; result `x @ wᵀ`, `(M, N)` in x's dtype.

Scales are decoded from their bits in the kernel (E4M3 and E8M0 via integer arithmetic and
a float32 bitcast), so no fp8 instructions are needed: any GPU Triton supports runs it.

Kernel paths, chosen from M by `choose_config` (or forced with `config=`), as in `w4a16.py`:
- "gemv"   (M <= 4): no `tl.dot`; products accumulate elementwise and are reduced over K
            once at the end; split over K so that one row still fills the GPU;
- "splitk" (M <= 64): `tl.dot` tiles with the K loop split over `SPLIT_K` programs;
- "tiled"  (larger M): classic `tl.dot` tiling, grouped program order for L2 reuse.
Split-K is reduced in the same launch (`splitk.serial_store`: the last program of a tile
sums the fp32 partials in a fixed order; bitwise reproducible). No `@triton.autotune`:
the tuned table (`tuning.py`) or `choose_config`, or pass `config=`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from infer_tool.kernels import backend, tuning
from infer_tool.kernels.backend import Launch, sm_count, use_triton
from infer_tool.kernels.fp4_layout import GROUP_SIZE, dequantize_codes, effective_scale, unpack_fp4
from infer_tool.kernels.splitk import serial_store, tile_locks
from infer_tool.kernels.tiles import grouped_tile

PATHS = ("gemv", "splitk", "tiled")
FORMATS = tuple(GROUP_SIZE)  # ("nvfp4", "mxfp4")


@dataclass(frozen=True)
class Fp4Config:
    """Meta-parameters of one launch. `path` picks the kernel variant (see module doc)."""

    path: str
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    SPLIT_K: int = 1
    GROUP_M: int = 8
    num_warps: int = 4
    num_stages: int = 3


def choose_config(M: int, N: int, K: int, num_sms: int) -> Fp4Config:
    """The default launch configuration for an `(M, K) x (K, N)` product on a device with
    `num_sms` streaming multiprocessors."""
    # Tile sizes keep every default spill-free on sm_80 and sm_90 (tests/test_kernels_fp4.py
    # compiles them with ptxas); the gemv accumulator holds BLOCK_M x BLOCK_K x BLOCK_N fp32.
    if M <= 4:
        block_m = triton.next_power_of_2(M)
        cfg = Fp4Config("gemv", BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=64 // block_m, num_warps=4, num_stages=2)
    elif M <= 64:
        block_m = max(16, triton.next_power_of_2(M))
        cfg = Fp4Config("splitk", BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64,
                        num_warps=8 if block_m >= 64 else 4, num_stages=3)
    else:
        return Fp4Config("tiled", BLOCK_M=128 if M >= 128 else 64, BLOCK_N=128, BLOCK_K=32,
                         num_warps=8 if M >= 128 else 4, num_stages=3)
    tiles = triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N)
    k_blocks = triton.cdiv(K, cfg.BLOCK_K)
    split = max(1, min(triton.cdiv(2 * num_sms, tiles), k_blocks // 2, 16))
    return replace(cfg, SPLIT_K=split)


@triton.jit
def _fp4_kernel(
    # pointers
    x_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, part_ptr, lock_ptr,
    # sizes
    M, N, K,
    # strides
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_sn, stride_sg,
    stride_om, stride_on,
    # meta-parameters
    IS_NVFP4: tl.constexpr, GROUP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """"splitk"/"tiled": one `(BLOCK_M, BLOCK_N)` output tile with `tl.dot`, over the
    K-blocks `pid_k, pid_k + SPLIT_K, ...`.

    x `(M, K)`; w uint8 `(N, K/2)`; s uint8 bits `(N, K/GROUP)` (E4M3 or E8M0); gs float32
    `(1,)` (NVFP4); out `(M, N)`; part fp32 `(SPLIT_K, M, N)` split-K partials, lock int32 per tile.
    """
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)  # kernels/tiles.py

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    if IS_NVFP4:
        gs = tl.load(gs_ptr).to(tl.float32)

    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for kb in range(pid_k, (K + BLOCK_K - 1) // BLOCK_K, SPLIT_K):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # (BM, BK)
        mask_w = mask_k[:, None] & mask_n[None, :]
        byte = tl.load(w_ptr + (offs_k // 2)[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                       mask=mask_w, other=0).to(tl.int32)  # (BK, BN): each byte read twice (L1)
        code = (byte >> ((offs_k % 2) * 4)[:, None]) & 0xF
        # 2 * |value|: magnitude index i = 2e + m -> m (e = 0) or (2 + m) << (e - 1)
        e = (code >> 1) & 3
        m = code & 1
        v2 = tl.where(e == 0, m, (2 + m) << (tl.maximum(e, 1) - 1))
        v2 = tl.where((code & 8) != 0, -v2, v2).to(tl.float32)
        if BLOCK_K % GROUP == 0:  # decode each group's scale once, then repeat it GROUP times
            offs_g = kb * (BLOCK_K // GROUP) + tl.arange(0, BLOCK_K // GROUP)
            sb = tl.load(s_ptr + offs_n[None, :] * stride_sn + offs_g[:, None] * stride_sg,
                         mask=(offs_g < K // GROUP)[:, None] & mask_n[None, :], other=0).to(tl.int32)
        else:
            sb = tl.load(s_ptr + offs_n[None, :] * stride_sn + (offs_k // GROUP)[:, None] * stride_sg,
                         mask=mask_w, other=0).to(tl.int32)  # (BK, BN) scale bits
        if IS_NVFP4:  # E4M3: s eeee mmm, bias 7; subnormal m * 2**-9
            se = (sb >> 3) & 0xF
            sm = sb & 7
            normal = (((se + 120) << 23) | (sm << 20)).to(tl.float32, bitcast=True)
            s = tl.where(se == 0, sm.to(tl.float32) * 0.001953125, normal) / gs
        else:  # E8M0: 2 ** (u - 127); u = 0 is the fp32 subnormal 2**-127
            s = tl.where(sb == 0, 1 << 22, sb << 23).to(tl.float32, bitcast=True)
        if BLOCK_K % GROUP == 0:  # (BK/GROUP, BN) -> (BK, BN)
            s = tl.reshape(tl.broadcast_to(s[:, None, :], (BLOCK_K // GROUP, GROUP, BLOCK_N)), (BLOCK_K, BLOCK_N))
        w = (v2 * (0.5 * s)).to(x.dtype)  # (BK, BN), value * s_eff rounded like the reference
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)

    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    part_ptrs = part_ptr + offs_m[:, None] * N + offs_n[None, :]
    mask_out = mask_m[:, None] & mask_n[None, :]
    serial_store(acc, out_ptrs, part_ptrs, M * N, lock_ptr + pid, pid_k, mask_out, SPLIT_K)


@triton.jit
def _fp4_gemv_kernel(
    # pointers
    x_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, part_ptr, lock_ptr,
    # sizes
    M, N, K,
    # strides
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_sn, stride_sg,
    stride_om, stride_on,
    # meta-parameters
    IS_NVFP4: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """"gemv": a few rows (BLOCK_M, tiny) times one BLOCK_N column slab, no `tl.dot`.
    Products accumulate elementwise in `(BM, BK, BN)` fp32 and are reduced over K once at
    the end. Operands and outputs as in `_fp4_kernel`.
    """
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    if IS_NVFP4:
        gs = tl.load(gs_ptr).to(tl.float32)

    acc = tl.full((BLOCK_M, BLOCK_K, BLOCK_N), 0.0, tl.float32)
    for kb in range(pid_k, (K + BLOCK_K - 1) // BLOCK_K, SPLIT_K):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # (BM, BK)
        mask_w = mask_k[:, None] & mask_n[None, :]
        byte = tl.load(w_ptr + (offs_k // 2)[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                       mask=mask_w, other=0).to(tl.int32)  # (BK, BN)
        code = (byte >> ((offs_k % 2) * 4)[:, None]) & 0xF
        e = (code >> 1) & 3
        m = code & 1
        v2 = tl.where(e == 0, m, (2 + m) << (tl.maximum(e, 1) - 1))
        v2 = tl.where((code & 8) != 0, -v2, v2).to(tl.float32)
        sb = tl.load(s_ptr + offs_n[None, :] * stride_sn + (offs_k // GROUP)[:, None] * stride_sg,
                     mask=mask_w, other=0).to(tl.int32)
        if IS_NVFP4:
            se = (sb >> 3) & 0xF
            sm = sb & 7
            normal = (((se + 120) << 23) | (sm << 20)).to(tl.float32, bitcast=True)
            s = tl.where(se == 0, sm.to(tl.float32) * 0.001953125, normal) / gs
        else:
            s = tl.where(sb == 0, 1 << 22, sb << 23).to(tl.float32, bitcast=True)
        w = (v2 * (0.5 * s)).to(x.dtype)  # rounded like the dot paths
        acc += x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :]
    acc2 = tl.reduce(acc, 1, tl.standard._sum_combine)  # (BM, BN)

    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    part_ptrs = part_ptr + offs_m[:, None] * N + offs_n[None, :]
    mask_out = mask_m[:, None] & mask_n[None, :]
    serial_store(acc2, out_ptrs, part_ptrs, M * N, lock_ptr + pid, pid_k, mask_out, SPLIT_K)


def fp4_format(w_scale: torch.Tensor, global_scale: torch.Tensor | None) -> str:
    """"nvfp4" (float8_e4m3fn scales with a global scale) or "mxfp4" (uint8 E8M0, none)."""
    if w_scale.dtype == torch.float8_e4m3fn and global_scale is not None:
        return "nvfp4"
    if w_scale.dtype == torch.uint8 and global_scale is None:
        return "mxfp4"
    raise ValueError(
        f"fp4: w_scale {w_scale.dtype} with global_scale {'given' if global_scale is not None else 'None'} is "
        "neither NVFP4 (float8_e4m3fn + float32 (1,) global scale) nor MXFP4 (uint8, no global scale)"
    )


def _check(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor,
           global_scale: torch.Tensor | None) -> str:
    if x.dim() != 2:
        raise ValueError(f"fp4: x must be 2-D (M, K), got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"fp4: x dtype {x.dtype} not supported (fp16, bf16, fp32)")
    fmt = fp4_format(w_scale, global_scale)
    K, g = x.shape[1], GROUP_SIZE[fmt]
    if K % g:
        raise ValueError(f"fp4: {fmt} needs K a multiple of {g}, got K={K}")
    if w_packed.dtype != torch.uint8 or w_packed.dim() != 2 or w_packed.shape[1] != K // 2:
        raise ValueError(f"fp4: w_packed must be uint8 (N, K/2={K // 2}), got {w_packed.dtype} "
                         f"{tuple(w_packed.shape)}")
    N = w_packed.shape[0]
    if w_scale.shape != (N, K // g):
        raise ValueError(f"fp4: {fmt} w_scale must be (N={N}, K/{g}={K // g}), got {tuple(w_scale.shape)}")
    if global_scale is not None and (global_scale.dtype != torch.float32 or global_scale.numel() != 1):
        raise ValueError(f"fp4: global_scale must be float32 (1,), got {global_scale.dtype} "
                         f"{tuple(global_scale.shape)}")
    return fmt


def dequantize_fp4(w_packed: torch.Tensor, w_scale: torch.Tensor, global_scale: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense weight `(N, K)` in `dtype` from the checkpoint operands (pure torch, vectorised):
    compressed-tensors' decompression."""
    fp4_format(w_scale, global_scale)
    return dequantize_codes(unpack_fp4(w_packed), effective_scale(w_scale, global_scale), dtype)


def fp4_reference(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor,
                  global_scale: torch.Tensor | None = None, *,
                  compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pure-torch `x @ dequantize(w)ᵀ`, `(M, N)` in `compute_dtype`."""
    _check(x, w_packed, w_scale, global_scale)
    return x.to(compute_dtype) @ dequantize_fp4(w_packed, w_scale, global_scale, compute_dtype).t()


def fp4_matmul(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor,
               global_scale: torch.Tensor | None = None, *, config: Fp4Config | None = None) -> torch.Tensor:
    """`x @ dequantize(w_packed, w_scale, global_scale)ᵀ`, `(M, N)` in x's dtype.

    Runs the fused Triton kernel on CUDA (or under TRITON_INTERPRET=1), otherwise the
    torch reference in fp32. `config` overrides `choose_config`."""
    if not use_triton(x):
        return fp4_reference(x, w_packed, w_scale, global_scale).to(x.dtype)
    launch, out = plan(x, w_packed, w_scale, global_scale, config=config)
    launch.run()  # split-K reduced in the same launch, in a fixed order (splitk.serial_store)
    return out


def plan(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, global_scale: torch.Tensor | None,
         *, config: Fp4Config | None = None) -> tuple[Launch, torch.Tensor]:
    """Check the operands, allocate the output and build the launch: `(launch, out)`,
    out `(M, N)` in x's dtype. The config: `config`, else the tuned table's (`tuning.py`,
    family "nvfp4" / "mxfp4"), else `choose_config`."""
    fmt = _check(x, w_packed, w_scale, global_scale)
    M, K = x.shape
    N = w_packed.shape[0]
    tuned = tuning.lookup(x.device, fmt, M, N, K, GROUP_SIZE[fmt])
    cfg = config or (Fp4Config(**tuned) if tuned is not None else None) or choose_config(M, N, K, sm_count(x.device))
    if cfg.path not in PATHS:
        raise ValueError(f"fp4: unknown config path {cfg.path!r}; expected one of {PATHS}")
    use_dot = cfg.path != "gemv"
    if use_dot and cfg.BLOCK_M < 16:
        raise ValueError(f"fp4: tl.dot paths need BLOCK_M >= 16, got {cfg.BLOCK_M}")
    x = x.contiguous()
    split = max(1, min(cfg.SPLIT_K, triton.cdiv(K, cfg.BLOCK_K)))
    tiles = triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N)
    out = backend.empty_output((M, N), x.dtype, x.device)
    if split > 1:
        part = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
        locks = tile_locks(x.device, tiles)
    else:
        part = locks = out  # unused
    s_bits = w_scale.view(torch.uint8)
    gs = global_scale if global_scale is not None else s_bits  # dummy pointer for MXFP4
    args = (
        x, w_packed, s_bits, gs, out, part, locks,
        M, N, K,
        x.stride(0), x.stride(1),
        w_packed.stride(0), w_packed.stride(1),
        s_bits.stride(0), s_bits.stride(1),
        out.stride(0), out.stride(1),
    )
    meta = {
        "IS_NVFP4": fmt == "nvfp4", "GROUP": GROUP_SIZE[fmt],
        "BLOCK_M": cfg.BLOCK_M, "BLOCK_N": cfg.BLOCK_N, "BLOCK_K": cfg.BLOCK_K, "SPLIT_K": split,
        "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
    }
    grid = (tiles, split)
    if not use_dot:
        return Launch(_fp4_gemv_kernel, grid, args, meta), out
    meta.update(DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", GROUP_M=cfg.GROUP_M)
    return Launch(_fp4_kernel, grid, args, meta), out
