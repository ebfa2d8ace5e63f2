"""W4A16 GEMM: activations (fp16/bf16/fp32) times a packed INT4 weight, dequantized
inside the matrix multiply (the full-precision weight is never materialised).

Operands of the public functions (canonical layout, see `layout.py`):
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

The kernels read the weight in the planar-128 layout (`w4_layout.py`), made once by
`w4_layout.prepare` (`Int4Linear` does it at its first kernel call; `w4a16_matmul` per
call, for tests). A 128-channel K tile is 16 rows of N words; nibble plane `i` of those
words is the contiguous K slice `16i .. 16i+15` of the tile. Paths, chosen from M by
`choose_config`, or read from the tuned table (`tuning.py`), or forced with `config=`:

- "gemv"   (M <= 4): no `tl.dot`. A program owns BLOCK_N output columns and a contiguous
            run of K tiles; it loads each 16 x BLOCK_N tile of words once, turns a plane
            into floats with two integer ops and a bitcast (`q | 0x4B000000` is the fp32
            2^23 + q), subtracts 2^23 + zero, and multiplies by 16 contiguous activations
            in fp32. With groups of 128 (or multiples) the scale multiplies the tile's
            partial sums once, not every weight.
- "splitk" (M <= 64) and "tiled" (larger M): each plane, dequantized to x's dtype in
            registers, is one `(BLOCK_M, 16) x (16, BLOCK_N)` `tl.dot`; the K loop split
            over SPLIT_K programs where M is small.

Split-K is reduced in the same launch (`splitk.serial_store`): the last program of an
output tile sums the fp32 partials in a fixed order, so results are bitwise
reproducible run to run and there is no second launch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import triton
import triton.language as tl

from infer_tool.kernels import backend, tuning
from infer_tool.kernels.backend import Launch, sm_count, use_triton
from infer_tool.kernels.layout import PACK_FACTOR, unpack_int4_k
from infer_tool.kernels.splitk import serial_store, tile_locks
from infer_tool.kernels.tiles import grouped_tile
from infer_tool.kernels.w4_layout import PLANE_K, TILE_K, W4Weights, prepare

SYMMETRIC_ZERO = 8  # implied zero point of symmetric 4-bit weights
_SYMMETRIC_ZERO: tl.constexpr = tl.constexpr(SYMMETRIC_ZERO)  # the same, inside the kernels
_PLANE: tl.constexpr = tl.constexpr(PLANE_K)
PATHS = ("gemv", "splitk", "tiled")
FAMILY = "w4a16"
# How scales are applied (the SCALES meta-parameter): once per 128-channel tile (groups
# of 128 or multiples), once per 16-channel plane (groups a multiple of 16), per element
# (act-order g_idx or other group sizes).
PER_TILE, PER_PLANE, PER_ELEMENT = 0, 1, 2


@dataclass(frozen=True)
class W4A16Config:
    """Meta-parameters of one launch. `path` picks the kernel variant (see module doc);
    BLOCK_K is the layout's tile (128), listed for the tables."""

    path: str
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int = TILE_K
    SPLIT_K: int = 1
    GROUP_M: int = 8
    num_warps: int = 4
    num_stages: int = 3


def choose_config(M: int, N: int, K: int, num_sms: int, *, group_size: int = 128,
                  act_order: bool = False) -> W4A16Config:
    """The default launch configuration for an `(M, K) x (K, N)` product on a device with
    `num_sms` streaming multiprocessors, when the tuned table has none. `group_size` and
    `act_order` do not change it (the layout keeps every case on the same tiles); they
    are accepted for the callers' keys."""
    # Tile sizes keep every path spill-free on sm_90 (tests/test_kernels_compile.py).
    tiles_k = -(-K // TILE_K)
    if M <= 4:
        block_m = triton.next_power_of_2(M)
        cfg = W4A16Config("gemv", BLOCK_M=block_m, BLOCK_N=128 if block_m <= 2 else 64,
                          num_warps=4, num_stages=2)
        target = 4 * num_sms  # programs: enough loads in flight to saturate HBM
    elif M <= 64:
        block_m = max(16, triton.next_power_of_2(M))
        cfg = W4A16Config("splitk", BLOCK_M=block_m, BLOCK_N=64,
                          num_warps=8 if block_m >= 64 else 4, num_stages=3)
        target = 2 * num_sms
    else:
        return W4A16Config("tiled", BLOCK_M=128 if M >= 128 else 64, BLOCK_N=128,
                           num_warps=8 if M >= 128 else 4, num_stages=3)
    tiles = triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N)
    split = max(1, min(triton.cdiv(target, tiles), tiles_k, 32))
    return replace(cfg, SPLIT_K=split)


def config_from(d: dict[str, Any]) -> W4A16Config:
    """A config from a tuned-table entry (its fields by name)."""
    names = {f.name for f in fields(W4A16Config)}
    unknown = set(d) - names
    if unknown:
        raise ValueError(f"w4a16: tuned config has unknown fields {sorted(unknown)}; expected {sorted(names)}")
    return W4A16Config(**d)


def tuned_config(device: torch.device, M: int, N: int, K: int, group_size: int) -> W4A16Config | None:
    """The tuned table's config for this GPU and key, or None."""
    found = tuning.lookup(device, FAMILY, M, N, K, group_size)
    return None if found is None else config_from(found)


@triton.jit
def _plane_exp(i: tl.constexpr):
    """e: plane i sits at bits e..e+3 of `words` (i < 5) or of `words >> 12` (i = 5, 6, 7),
    inside the 23-bit fp32 mantissa."""
    return 4 * i - 12 * (i // 5)


@triton.jit
def _plane(words, words_hi, i: tl.constexpr):
    """Nibble plane i of a tile of words as the fp32 `2^23 + q * 2^e` (exact): the nibble
    is masked in place, inside the mantissa of 2^23 (whose unit is 1), one LOP3."""
    e: tl.constexpr = _plane_exp(i)
    src = words if i < 5 else words_hi
    return ((src & (0xF << e)) | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _bias(zf, i: tl.constexpr):
    """`2^23 + z * 2^e`: `_plane(...) - _bias(z, i)` is `(q - z) * 2^e`, exact."""
    e: tl.constexpr = _plane_exp(i)
    return zf * ((1 << e) * 1.0) + 8388608.0


@triton.jit
def _inv_exp(i: tl.constexpr):
    """2^-e of plane i (exact)."""
    e: tl.constexpr = _plane_exp(i)
    return 1.0 / (1 << e)


@triton.jit
def _zeros(z_ptr, g, offs_n, mask, stride_zg, stride_zn, HAS_ZEROS: tl.constexpr):
    """Zero points (fp32) of groups `g` at columns `offs_n`, broadcast like them; 8 without zeros."""
    if HAS_ZEROS:
        return tl.load(z_ptr + g * stride_zg + offs_n * stride_zn, mask=mask, other=0).to(tl.float32)
    else:
        return tl.full([1], _SYMMETRIC_ZERO, tl.float32)


@triton.jit
def _scale(s_ptr, g, offs_n, mask, stride_sg, stride_sn):
    return tl.load(s_ptr + g * stride_sg + offs_n * stride_sn, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _x_plane(x_ptr, row, offs_k, mask_k, M, stride_xm, stride_xk):
    """16 contiguous activations of row `row` (zeros past M or K), fp32."""
    rows_ok = (offs_k * 0 + row) < M
    return tl.load(x_ptr + row * stride_xm + offs_k * stride_xk, mask=mask_k & rows_ok, other=0.0).to(tl.float32)


@triton.jit
def _w4a16_gemv_kernel(
    # pointers
    x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, ws_ptr, lock_ptr,
    # sizes
    M, N, K, group_size, tiles_per_split,
    # strides
    stride_xm, stride_xk,
    stride_qk, stride_qn,
    stride_sg, stride_sn,
    stride_zg, stride_zn,
    stride_om, stride_on,
    # meta-parameters
    HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr, SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """"gemv": rows `BLOCK_M` (1, 2 or 4) x columns `BLOCK_N`, K tiles
    `pid_k * tiles_per_split ..` (a contiguous run), no `tl.dot`.

    x `(M, K)`; qw planar-128 int32 `(16 * ceil(K/128), N)`; s `(G, N)`; z uint8 `(G, N)`;
    g int32 `(K,)` per stored channel; out `(M, N)`; ws fp32 `(SPLIT_K, M, N)` partials;
    lock int32 per output tile. Each row has its own `(16, BLOCK_N)` fp32 accumulator
    (2-D tensors only: no layout conversions in the loop), reduced over the 16 at the end.
    """
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    m0 = pid_m * BLOCK_M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, 16)
    mask_n = offs_n < N
    n_tiles = (K + 127) // 128
    t_start = pid_k * tiles_per_split
    t_end = tl.minimum(t_start + tiles_per_split, n_tiles)

    acc0 = tl.full((16, BLOCK_N), 0.0, tl.float32)
    acc1 = tl.full((16, BLOCK_N), 0.0, tl.float32)
    acc2 = tl.full((16, BLOCK_N), 0.0, tl.float32)
    acc3 = tl.full((16, BLOCK_N), 0.0, tl.float32)
    for t in range(t_start, t_end):
        words = tl.load(qw_ptr + (t * 16 + offs_r)[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                        mask=mask_n[None, :], other=0)  # (16, BN) int32, each word read once
        words_hi = words >> 12  # planes 5..7 within the fp32 mantissa
        if SCALES == 0:  # one group over the whole tile: scale the tile's sums once
            g_t = (t * 128) // group_size
            s_t = _scale(s_ptr, g_t, offs_n, mask_n, stride_sg, stride_sn)[None, :]
            z_t = _zeros(z_ptr, g_t, offs_n, mask_n, stride_zg, stride_zn, HAS_ZEROS)
            p0 = tl.full((16, BLOCK_N), 0.0, tl.float32)
            p1 = tl.full((16, BLOCK_N), 0.0, tl.float32)
            p2 = tl.full((16, BLOCK_N), 0.0, tl.float32)
            p3 = tl.full((16, BLOCK_N), 0.0, tl.float32)
        for i in tl.static_range(8):
            offs_k = t * 128 + i * 16 + offs_r  # (16,) contiguous channels of plane i
            mask_k = offs_k < K
            qf = _plane(words, words_hi, i)  # (16, BN) 2^23 + q 2^e
            if SCALES == 0:
                w = qf - _bias(z_t, i)[None, :]  # (q - z) 2^e, exact
            elif SCALES == 1:
                k0 = t * 128 + i * 16
                g_i = k0 // group_size
                live = mask_n & (tl.full([BLOCK_N], k0, tl.int32) < K)
                zf = _zeros(z_ptr, g_i, offs_n, live, stride_zg, stride_zn, HAS_ZEROS)
                w = (qf - _bias(zf, i)[None, :]) * _scale(s_ptr, g_i, offs_n, live, stride_sg, stride_sn)[None, :]
            else:
                if HAS_G_IDX:
                    g_e = tl.load(g_ptr + offs_k, mask=mask_k, other=0)
                else:
                    g_e = offs_k // group_size
                live = mask_k[:, None] & mask_n[None, :]
                zf = _zeros(z_ptr, g_e[:, None], offs_n[None, :], live, stride_zg, stride_zn, HAS_ZEROS)
                w = (qf - _bias(zf, i)) * _scale(s_ptr, g_e[:, None], offs_n[None, :], live, stride_sg, stride_sn)
            inv = _inv_exp(i)  # x * 2^-e undoes the plane's 2^e (exact)
            x0 = (_x_plane(x_ptr, m0, offs_k, mask_k, M, stride_xm, stride_xk) * inv)[:, None]
            if SCALES == 0:
                p0 += x0 * w
            else:
                acc0 += x0 * w
            if BLOCK_M > 1:
                x1 = (_x_plane(x_ptr, m0 + 1, offs_k, mask_k, M, stride_xm, stride_xk) * inv)[:, None]
                if SCALES == 0:
                    p1 += x1 * w
                else:
                    acc1 += x1 * w
            if BLOCK_M > 2:
                x2 = (_x_plane(x_ptr, m0 + 2, offs_k, mask_k, M, stride_xm, stride_xk) * inv)[:, None]
                x3 = (_x_plane(x_ptr, m0 + 3, offs_k, mask_k, M, stride_xm, stride_xk) * inv)[:, None]
                if SCALES == 0:
                    p2 += x2 * w
                    p3 += x3 * w
                else:
                    acc2 += x2 * w
                    acc3 += x3 * w
        if SCALES == 0:
            acc0 += p0 * s_t
            if BLOCK_M > 1:
                acc1 += p1 * s_t
            if BLOCK_M > 2:
                acc2 += p2 * s_t
                acc3 += p3 * s_t

    ws_stride = M * N
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
        total = tl.reduce(acc, 0, tl.standard._sum_combine)  # (BN,)
        mask_out = mask_n & ((offs_n * 0 + row) < M)
        serial_store(total, out_ptr + row * stride_om + offs_n * stride_on, ws_ptr + row * N + offs_n,
                     ws_stride, lock_ptr + pid * BLOCK_M + j, pid_k, mask_out, SPLIT_K)


@triton.jit
def _w4a16_dot_kernel(
    # pointers
    x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, ws_ptr, lock_ptr,
    # sizes
    M, N, K, group_size, tiles_per_split,
    # strides
    stride_xm, stride_xk,
    stride_qk, stride_qn,
    stride_sg, stride_sn,
    stride_zg, stride_zn,
    stride_om, stride_on,
    # meta-parameters
    HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr, SCALES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """"splitk"/"tiled": one `(BLOCK_M, BLOCK_N)` output tile, K tiles
    `pid_k * tiles_per_split ..`, eight `(BLOCK_M, 16) x (16, BLOCK_N)` `tl.dot` per K tile
    (one per nibble plane, dequantized to x's dtype in registers). Operands as in the gemv.
    """
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)  # kernels/tiles.py
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, 16)
    mask_m = offs_m < M
    mask_n = offs_n < N
    n_tiles = (K + 127) // 128
    t_start = pid_k * tiles_per_split
    t_end = tl.minimum(t_start + tiles_per_split, n_tiles)

    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for t in range(t_start, t_end):
        words = tl.load(qw_ptr + (t * 16 + offs_r)[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                        mask=mask_n[None, :], other=0)  # (16, BN)
        words_hi = words >> 12
        if SCALES == 0:
            g_t = (t * 128) // group_size
            s_t = _scale(s_ptr, g_t, offs_n, mask_n, stride_sg, stride_sn)
            z_t = _zeros(z_ptr, g_t, offs_n, mask_n, stride_zg, stride_zn, HAS_ZEROS)
        for i in tl.static_range(8):
            offs_k = t * 128 + i * 16 + offs_r
            mask_k = offs_k < K
            xi = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                         mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # (BM, 16)
            qf = _plane(words, words_hi, i)
            inv = _inv_exp(i)  # folded into the scale: w = (q - z) s, as x's dtype
            if SCALES == 0:
                w = (qf - _bias(z_t, i)[None, :]) * (s_t * inv)[None, :]
            elif SCALES == 1:
                k0 = t * 128 + i * 16
                g_i = k0 // group_size
                live = mask_n & (tl.full([BLOCK_N], k0, tl.int32) < K)
                zf = _zeros(z_ptr, g_i, offs_n, live, stride_zg, stride_zn, HAS_ZEROS)
                s_i = _scale(s_ptr, g_i, offs_n, live, stride_sg, stride_sn) * inv
                w = (qf - _bias(zf, i)[None, :]) * s_i[None, :]
            else:
                if HAS_G_IDX:
                    g_e = tl.load(g_ptr + offs_k, mask=mask_k, other=0)
                else:
                    g_e = offs_k // group_size
                live = mask_k[:, None] & mask_n[None, :]
                zf = _zeros(z_ptr, g_e[:, None], offs_n[None, :], live, stride_zg, stride_zn, HAS_ZEROS)
                s_e = _scale(s_ptr, g_e[:, None], offs_n[None, :], live, stride_sg, stride_sn) * inv
                w = (qf - _bias(zf, i)) * s_e
            acc += tl.dot(xi, w.to(xi.dtype), input_precision=DOT_PRECISION)

    mask_out = mask_m[:, None] & mask_n[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    ws_ptrs = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
    serial_store(acc, out_ptrs, ws_ptrs, M * N, lock_ptr + pid, pid_k, mask_out, SPLIT_K)


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
    """`x @ dequantize(qweight, scales, zeros, g_idx)`, `(M, N)` in x's dtype, from the
    canonical layout.

    Runs the fused Triton kernel on CUDA (or under TRITON_INTERPRET=1), repacking the
    weight for it on every call (`Int4Linear` repacks once); otherwise the torch
    reference in fp32. `config` overrides the tuned table and `choose_config`."""
    if not use_triton(x):
        return w4a16_reference(x, qweight, scales, zeros, g_idx, group_size).to(x.dtype)
    _check(x, qweight, scales, zeros, g_idx, group_size)
    return w4a16_prepared(x, prepare(qweight, scales, zeros, g_idx, group_size, x.shape[1]), config=config)


def w4a16_prepared(x: torch.Tensor, w: W4Weights, *, config: W4A16Config | None = None) -> torch.Tensor:
    """`x @ W` with W prepared by `w4_layout.prepare`, on the Triton path (CUDA or the
    interpreter), `(M, N)` in x's dtype."""
    launch, out = plan_prepared(x, w, config=config)
    launch.run()
    return out


def plan(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
         g_idx: torch.Tensor | None, group_size: int, *, config: W4A16Config | None = None
         ) -> tuple[Launch, torch.Tensor]:
    """Check the canonical operands, prepare the weight and build the launch:
    `(launch, out)`, out `(M, N)` in x's dtype."""
    _check(x, qweight, scales, zeros, g_idx, group_size)
    return plan_prepared(x, prepare(qweight, scales, zeros, g_idx, group_size, x.shape[1]), config=config)


def scale_mode(w: W4Weights) -> int:
    """PER_TILE, PER_PLANE or PER_ELEMENT: how the kernels apply this weight's scales."""
    if w.g_idx is not None:
        return PER_ELEMENT
    if w.group_size % TILE_K == 0:
        return PER_TILE
    if w.group_size % PLANE_K == 0:
        return PER_PLANE
    return PER_ELEMENT


def plan_prepared(x: torch.Tensor, w: W4Weights, *, config: W4A16Config | None = None
                  ) -> tuple[Launch, torch.Tensor]:
    """Allocate the output and build the launch for prepared weights: `(launch, out)`."""
    if x.dim() != 2 or x.shape[1] != w.K:
        raise ValueError(f"w4a16: x must be (M, K={w.K}), got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"w4a16: x dtype {x.dtype} not supported (fp16, bf16, fp32)")
    M, K, N = x.shape[0], w.K, w.N
    cfg = (config or tuned_config(x.device, M, N, K, w.group_size)
           or choose_config(M, N, K, sm_count(x.device), group_size=w.group_size, act_order=w.g_idx is not None))
    if cfg.path not in PATHS:
        raise ValueError(f"w4a16: unknown config path {cfg.path!r}; expected one of {PATHS}")
    if cfg.BLOCK_K != TILE_K:
        raise ValueError(f"w4a16: BLOCK_K is the layout's tile, {TILE_K}; got {cfg.BLOCK_K}")
    use_dot = cfg.path != "gemv"
    if use_dot and cfg.BLOCK_M < 16:
        raise ValueError(f"w4a16: tl.dot paths need BLOCK_M >= 16, got {cfg.BLOCK_M}")
    if w.perm is not None:
        x = x.index_select(1, w.perm)  # stored channel order (act-order sorted by group)
    x = x.contiguous()
    tiles_k = -(-K // TILE_K)
    per_split = -(-tiles_k // max(1, cfg.SPLIT_K))
    split = -(-tiles_k // per_split)  # no empty splits
    out_tiles = triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N)
    out = backend.empty_output((M, N), x.dtype, x.device)
    if split > 1:
        ws = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
        locks = tile_locks(x.device, out_tiles * cfg.BLOCK_M)  # the gemv counts rows apart
    else:
        ws = locks = out  # unused
    s, z = w.scales, w.zeros if w.zeros is not None else w.scales  # dummy pointer when symmetric
    g = w.g_idx if w.g_idx is not None else w.qweight  # dummy pointer without act-order
    args = (
        x, w.qweight, s, z, g, out, ws, locks,
        M, N, K, w.group_size, per_split,
        x.stride(0), x.stride(1),
        w.qweight.stride(0), w.qweight.stride(1),
        s.stride(0), s.stride(1),
        z.stride(0), z.stride(1),
        out.stride(0), out.stride(1),
    )
    meta = dict(
        HAS_ZEROS=w.zeros is not None, HAS_G_IDX=w.g_idx is not None, SCALES=scale_mode(w),
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, SPLIT_K=split,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    grid = (out_tiles, split)
    if not use_dot:
        return Launch(_w4a16_gemv_kernel, grid, args, meta), out
    meta.update(DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", GROUP_M=cfg.GROUP_M)
    return Launch(_w4a16_dot_kernel, grid, args, meta), out
