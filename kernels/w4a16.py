"""W4A16 GEMM: activations (fp16/bf16/fp32) times a packed INT4 weight, dequantized
inside the matrix multiply (the full-precision weight is never materialised).

Operands (canonical layout, see `layout.py`):
- `x`       `(M, K)` fp16, bf16 or fp32 activations;
- `qweight` int32 `(ceil(K/8), N)`, packed along K: `q[k, n]` at bits `4*(k%8)` of
  `qweight[k//8, n]`, values 0..15;
- `scales`  `(G, N)` in x's dtype or fp32, `G = ceil(K/group_size)` (or the number of
  groups `g_idx` refers to);
- `zeros`   uint8 `(G, N)` unpacked integer zero points, or None = symmetric, zero
  point 8;
- `g_idx`   int32 `(K,)` input channel -> group (act-order checkpoints), or None =
  `k // group_size`.

Dequantisation: `w[k, n] = (q[k, n] - z[g(k), n]) * s[g(k), n]`; result `x @ w`,
`(M, N)` in x's dtype.

Kernel paths, chosen from M by `choose_config` (or forced with `config=`):
- "gemv"   (M <= 4): its own kernel, no `tl.dot`: each packed word is loaded once and
            unpacked to (K/8, 8, N) nibbles, products accumulate elementwise and are
            reduced over K at the end; split over K so that one row still fills the GPU;
- "splitk" (M <= 64): `tl.dot` tiles with the K loop split over `SPLIT_K` programs;
- "tiled"  (larger M): classic `tl.dot` tiling, grouped program order for L2 reuse.
Split-K writes fp32 partials `(SPLIT_K, M, N)` that are summed in a fixed order
afterwards: no float atomics, so results are bitwise reproducible run to run. There is
no `@triton.autotune` (it cannot run without a GPU); pass `config=` to choose.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from infer_tool.kernels import backend
from infer_tool.kernels.backend import Launch, sm_count, use_triton
from infer_tool.kernels.layout import PACK_FACTOR, unpack_int4_k
from infer_tool.kernels.splitk import sum_partials
from infer_tool.kernels.tiles import grouped_tile

SYMMETRIC_ZERO = 8  # implied zero point of symmetric 4-bit weights
_SYMMETRIC_ZERO: tl.constexpr = tl.constexpr(SYMMETRIC_ZERO)  # the same, inside the kernels
PATHS = ("gemv", "splitk", "tiled")


@dataclass(frozen=True)
class W4A16Config:
    """Meta-parameters of one launch. `path` picks the kernel variant (see module doc)."""

    path: str
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    SPLIT_K: int = 1
    GROUP_M: int = 8
    num_warps: int = 4
    num_stages: int = 3


def choose_config(M: int, N: int, K: int, num_sms: int, *, group_size: int = 128,
                  act_order: bool = False) -> W4A16Config:
    """The default launch configuration for an `(M, K) x (K, N)` product on a device with
    `num_sms` streaming multiprocessors (per-element scale gathers, for act-order or
    groups smaller than BLOCK_K, get a shorter gemv K-block)."""
    # Tile sizes keep every path spill-free on sm_90 (checked with ptxas through
    # `Launch.compile_for`); the gemv accumulator holds BLOCK_M x BLOCK_K x BLOCK_N fp32.
    if M <= 4:
        block_m = triton.next_power_of_2(M)
        block_k = 128 // block_m
        if act_order or group_size % block_k:
            block_k //= 2
        cfg = W4A16Config("gemv", BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k,
                          num_warps=4, num_stages=2)
    elif M <= 64:
        block_m = max(16, triton.next_power_of_2(M))
        cfg = W4A16Config("splitk", BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64,
                          num_warps=8 if block_m >= 64 else 4, num_stages=3)
    else:
        return W4A16Config("tiled", BLOCK_M=128 if M >= 128 else 64, BLOCK_N=128, BLOCK_K=32,
                           num_warps=8 if M >= 128 else 4, num_stages=3)
    # Split K until the launch has about two programs per SM, keeping >= 2 K-blocks each.
    tiles = triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N)
    k_blocks = triton.cdiv(K, cfg.BLOCK_K)
    split = triton.cdiv(2 * num_sms, tiles)
    split = max(1, min(split, k_blocks // 2, 16))
    return replace(cfg, SPLIT_K=split)


@triton.jit
def _group_params(s_ptr, z_ptr, g, offs_n, mask, stride_sg, stride_sn, stride_zg, stride_zn,
                  HAS_ZEROS: tl.constexpr):
    """Scales (fp32) and zero points (int32) of groups `g` at output columns `offs_n`.

    `g` (a scalar or a tile of group indices), `offs_n` and `mask` broadcast to the shape
    of the result, e.g. g `(BK, 1)` and offs_n `(1, BN)` give `(BK, BN)`. Without zeros
    (symmetric weights) the zero point is `SYMMETRIC_ZERO`."""
    s = tl.load(s_ptr + g * stride_sg + offs_n * stride_sn, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(z_ptr + g * stride_zg + offs_n * stride_zn, mask=mask, other=0).to(tl.int32)
    else:
        z = _SYMMETRIC_ZERO
    return s, z


@triton.jit
def _w4a16_kernel(
    # pointers
    x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr,
    # sizes
    M, N, K, group_size,
    # strides
    stride_xm, stride_xk,
    stride_qk, stride_qn,
    stride_sg, stride_sn,
    stride_zg, stride_zn,
    stride_os, stride_om, stride_on,
    # meta-parameters
    HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr, SCALE_PER_BLOCK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """"splitk"/"tiled": one `(BLOCK_M, BLOCK_N)` output tile with `tl.dot`, over the
    K-blocks `pid_k, pid_k + SPLIT_K, ...`.

    x `(M, K)`; qw int32 `(K/8, N)`; s `(G, N)`; z uint8 `(G, N)`; g int32 `(K,)`;
    out `(M, N)` when SPLIT_K == 1, else fp32 partials `(SPLIT_K, M, N)`.
    SCALE_PER_BLOCK: no g_idx and group_size % BLOCK_K == 0, so one scale row per K-block.
    """
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)  # kernels/tiles.py

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N

    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for kb in range(pid_k, (K + BLOCK_K - 1) // BLOCK_K, SPLIT_K):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # (BM, BK)
        mask_w = mask_k[:, None] & mask_n[None, :]
        packed = tl.load(qw_ptr + (offs_k // 8)[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                         mask=mask_w, other=0)  # (BK, BN) int32: each word read 8 times (L1)
        q = (packed >> ((offs_k % 8) * 4)[:, None]) & 0xF  # (BK, BN)
        if SCALE_PER_BLOCK:
            g = (kb * BLOCK_K) // group_size
            s, z = _group_params(s_ptr, z_ptr, g, offs_n[None, :], mask_n[None, :],
                                 stride_sg, stride_sn, stride_zg, stride_zn, HAS_ZEROS)  # (1, BN)
        else:
            if HAS_G_IDX:
                g = tl.load(g_ptr + offs_k, mask=mask_k, other=0)  # (BK,)
            else:
                g = offs_k // group_size
            s, z = _group_params(s_ptr, z_ptr, g[:, None], offs_n[None, :], mask_w,
                                 stride_sg, stride_sn, stride_zg, stride_zn, HAS_ZEROS)  # (BK, BN)
        w = ((q - z).to(tl.float32) * s).to(x.dtype)  # (BK, BN)
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)

    out_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    mask_out = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_out)
    else:
        tl.store(out_ptrs, acc, mask=mask_out)


@triton.jit
def _w4a16_gemv_kernel(
    # pointers
    x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr,
    # sizes
    M, N, K, group_size,
    # strides
    stride_xm, stride_xk,
    stride_qk, stride_qn,
    stride_sg, stride_sn,
    stride_zg, stride_zn,
    stride_os, stride_om, stride_on,
    # meta-parameters
    HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr, SCALE_PER_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """"gemv": a few rows (BLOCK_M, tiny) times one BLOCK_N column slab, no `tl.dot`.

    Each packed int32 word is loaded once as a `(BLOCK_K/8, BLOCK_N)` tile and unpacked
    to `(BLOCK_K/8, 8, BLOCK_N)` nibbles (k = 8r + i); x is read as `(BM, BK/8, 8)`.
    Products accumulate elementwise in `(BM, BK/8, 8, BN)` fp32 and are reduced over K
    once at the end. Operands and outputs as in `_w4a16_kernel`.
    """
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    R: tl.constexpr = BLOCK_K // 8
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_i = tl.arange(0, 8)
    mask_m = offs_m < M
    mask_n = offs_n < N

    acc = tl.full((BLOCK_M, R, 8, BLOCK_N), 0.0, tl.float32)
    for kb in range(pid_k, (K + BLOCK_K - 1) // BLOCK_K, SPLIT_K):
        offs_r = kb * R + tl.arange(0, R)  # packed rows
        offs_k = offs_r[:, None] * 8 + offs_i[None, :]  # (R, 8)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None, None] * stride_xm + offs_k[None, :, :] * stride_xk,
                    mask=mask_m[:, None, None] & mask_k[None, :, :], other=0.0)  # (BM, R, 8)
        packed = tl.load(qw_ptr + offs_r[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                         mask=(offs_r * 8 < K)[:, None] & mask_n[None, :], other=0)  # (R, BN)
        q = (packed[:, None, :] >> (offs_i * 4)[None, :, None]) & 0xF  # (R, 8, BN)
        if SCALE_PER_BLOCK:
            g = (kb * BLOCK_K) // group_size
            s, z = _group_params(s_ptr, z_ptr, g, offs_n[None, None, :], mask_n[None, None, :],
                                 stride_sg, stride_sn, stride_zg, stride_zn, HAS_ZEROS)  # (1, 1, BN)
        else:
            if HAS_G_IDX:
                g = tl.load(g_ptr + offs_k, mask=mask_k, other=0)  # (R, 8)
            else:
                g = offs_k // group_size
            mask_w = mask_k[:, :, None] & mask_n[None, None, :]
            s, z = _group_params(s_ptr, z_ptr, g[:, :, None], offs_n[None, None, :], mask_w,
                                 stride_sg, stride_sn, stride_zg, stride_zn, HAS_ZEROS)  # (R, 8, BN)
        w = ((q - z).to(tl.float32) * s).to(x.dtype)  # (R, 8, BN), rounded like the dot paths
        acc += x.to(tl.float32)[:, :, :, None] * w.to(tl.float32)[None, :, :, :]
    acc2 = tl.reduce(tl.reduce(acc, 2, tl.standard._sum_combine), 1, tl.standard._sum_combine)

    out_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    mask_out = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc2.to(out_ptr.dtype.element_ty), mask=mask_out)
    else:
        tl.store(out_ptrs, acc2, mask=mask_out)


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
           zeros: torch.Tensor | None, g_idx: torch.Tensor | None, group_size: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"w4a16: x must be 2-D (M, K), got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"w4a16: x dtype {x.dtype} not supported (fp16, bf16, fp32)")
    K = x.shape[1]
    if qweight.dtype != torch.int32 or qweight.dim() != 2 or qweight.shape[0] != -(-K // PACK_FACTOR):
        raise ValueError(
            f"w4a16: qweight must be int32 (ceil(K/8)={-(-K // PACK_FACTOR)}, N), "
            f"got {qweight.dtype} {tuple(qweight.shape)}"
        )
    N = qweight.shape[1]
    if scales.dim() != 2 or scales.shape[1] != N:
        raise ValueError(f"w4a16: scales must be (G, N={N}), got {tuple(scales.shape)}")
    if scales.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"w4a16: scales dtype {scales.dtype} must be x's ({x.dtype}) or float32")
    if zeros is not None and (zeros.dtype != torch.uint8 or zeros.shape != scales.shape):
        raise ValueError(
            f"w4a16: zeros must be uint8 {tuple(scales.shape)}, got {zeros.dtype} {tuple(zeros.shape)}"
        )
    if g_idx is None:
        if group_size <= 0 or scales.shape[0] != -(-K // group_size):
            raise ValueError(
                f"w4a16: group_size={group_size} with K={K} needs {-(-K // max(group_size, 1))} "
                f"scale rows, got {scales.shape[0]}"
            )
    elif g_idx.dtype != torch.int32 or g_idx.shape != (K,):
        raise ValueError(f"w4a16: g_idx must be int32 (K={K},), got {g_idx.dtype} {tuple(g_idx.shape)}")


def group_index(K: int, group_size: int, g_idx: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Group of every input channel, int64 `(K,)`: `g_idx` or `k // group_size`."""
    if g_idx is not None:
        return g_idx.to(device=device, dtype=torch.long)
    return torch.arange(K, device=device) // group_size


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    g_idx: torch.Tensor | None, group_size: int, K: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense weight `(K, N)` in `dtype` from the canonical INT4 operands (pure torch,
    vectorised: no loop over groups)."""
    q = unpack_int4_k(qweight, K).to(dtype)  # (K, N)
    g = group_index(K, group_size, g_idx, qweight.device)  # (K,)
    z = zeros[g].to(dtype) if zeros is not None else SYMMETRIC_ZERO
    return (q - z) * scales[g].to(dtype)


def w4a16_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor | None = None, g_idx: torch.Tensor | None = None,
                    group_size: int = 128, *, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pure-torch `x @ dequantize(w)`, `(M, N)` in `compute_dtype`."""
    _check(x, qweight, scales, zeros, g_idx, group_size)
    w = dequantize_int4(qweight, scales, zeros, g_idx, group_size, x.shape[1], compute_dtype)
    return x.to(compute_dtype) @ w


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None = None, g_idx: torch.Tensor | None = None,
                 group_size: int = 128, *, config: W4A16Config | None = None) -> torch.Tensor:
    """`x @ dequantize(qweight, scales, zeros, g_idx)`, `(M, N)` in x's dtype.

    Runs the fused Triton kernel on CUDA (or under TRITON_INTERPRET=1), otherwise the
    torch reference in fp32. `config` overrides `choose_config`."""
    if not use_triton(x):
        return w4a16_reference(x, qweight, scales, zeros, g_idx, group_size).to(x.dtype)
    launch, out = plan(x, qweight, scales, zeros, g_idx, group_size, config=config)
    launch.run()
    if out.dim() == 2:
        return out
    return sum_partials(out, x.dtype)  # fixed-order reduction, no atomics


def plan(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
         g_idx: torch.Tensor | None, group_size: int, *, config: W4A16Config | None = None
         ) -> tuple[Launch, torch.Tensor]:
    """Check the operands, allocate the output and build the launch: `(launch, out)`,
    out `(M, N)` in x's dtype, or fp32 partials `(SPLIT_K, M, N)` to be summed."""
    _check(x, qweight, scales, zeros, g_idx, group_size)
    M, K = x.shape
    N = qweight.shape[1]
    cfg = config or choose_config(M, N, K, sm_count(x.device), group_size=group_size,
                                  act_order=g_idx is not None)
    if cfg.path not in PATHS:
        raise ValueError(f"w4a16: unknown config path {cfg.path!r}; expected one of {PATHS}")
    use_dot = cfg.path != "gemv"
    if use_dot and cfg.BLOCK_M < 16:
        raise ValueError(f"w4a16: tl.dot paths need BLOCK_M >= 16, got {cfg.BLOCK_M}")
    if not use_dot and cfg.BLOCK_K % 8:
        raise ValueError(f"w4a16: gemv needs BLOCK_K a multiple of 8, got {cfg.BLOCK_K}")
    x = x.contiguous()
    split = cfg.SPLIT_K
    if split == 1:
        out = backend.empty_output((M, N), x.dtype, x.device)
        stride_os = 0
    else:
        out = backend.empty_output((split, M, N), torch.float32, x.device)
        stride_os = out.stride(0)
    z = zeros if zeros is not None else scales  # dummy pointer when symmetric
    g = g_idx if g_idx is not None else qweight  # dummy pointer without act-order
    args = (
        x, qweight, scales, z, g, out,
        M, N, K, group_size,
        x.stride(0), x.stride(1),
        qweight.stride(0), qweight.stride(1),
        scales.stride(0), scales.stride(1),
        z.stride(0), z.stride(1),
        stride_os, out.stride(-2), out.stride(-1),
    )
    meta = dict(
        HAS_ZEROS=zeros is not None, HAS_G_IDX=g_idx is not None,
        SCALE_PER_BLOCK=g_idx is None and group_size % cfg.BLOCK_K == 0,
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, SPLIT_K=split,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    grid = (triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N), split)
    if not use_dot:
        return Launch(_w4a16_gemv_kernel, grid, args, meta), out
    meta.update(DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", GROUP_M=cfg.GROUP_M)
    return Launch(_w4a16_kernel, grid, args, meta), out
