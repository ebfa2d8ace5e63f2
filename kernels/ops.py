"""The quantized linears' products as `torch.library` custom ops, as vLLM registers its
quantized GEMMs: `torch.compile` sees one opaque node with a fake (meta) implementation
that gives the output's shape and dtype, and CUDA-graph capture records the kernel
launches inside it (no host synchronisation, no allocation outside PyTorch's allocator).

- `torch.ops.infer_tool.w4a16_mm(x, qweight, scales, zeros, g_idx, group_size,
  kqweight, kg_idx, kperm)`: canonical INT4 operands (`kernels/w4a16.py`) plus, where
  the layer has prepared them, the kernel's planar-128 copies (`kernels/w4_layout.py`);
- `torch.ops.infer_tool.fp8_mm(x, w_bits, w_scale, mode, block_n, block_k, input_scale)`:
  `kernels/fp8.py`, the e4m3 weight passed as its uint8 bits (block sizes 0 = no block scales);
- `torch.ops.infer_tool.fp4_mm(x, w_packed, scale_bits, e4m3_scales, global_scale)`:
  `kernels/fp4.py`, the scales as uint8 bits (E4M3 for NVFP4, E8M0 for MXFP4).

Float8 tensors cross the op boundary as uint8 views (no copy): PyTorch's schema checker
(`opcheck`'s test_schema) compares inputs with arithmetic that float8 lacks on the CPU.

x is `(M, K)`; each returns `(M, N)` in x's dtype. Which implementation runs is decided
inside the op, from x's device and TRITON_INTERPRET (`backend.use_triton`): Triton on CUDA
or under the interpreter, the torch reference otherwise, bit for bit what the modules
computed before the ops existed.
"""

from __future__ import annotations

import torch

from infer_tool.kernels.backend import use_triton

NAMESPACE = "infer_tool"


@torch.library.custom_op(f"{NAMESPACE}::w4a16_mm", mutates_args=())
def w4a16_mm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    group_size: int,
    kqweight: torch.Tensor | None = None,
    kg_idx: torch.Tensor | None = None,
    kperm: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ dequantize(W)`; kqweight / kg_idx / kperm: the prepared kernel weight (or None:
    prepared here, per call)."""
    from infer_tool.kernels import w4a16
    from infer_tool.kernels.w4_layout import W4Weights, prepare

    if not use_triton(x):
        return w4a16.w4a16_reference(x, qweight, scales, zeros, g_idx, group_size).to(x.dtype)
    K = x.shape[1]
    if kqweight is None:
        w = prepare(qweight, scales, zeros, g_idx, group_size, K)
    else:
        w = W4Weights(kqweight, scales, zeros, kg_idx, kperm, group_size, K, int(qweight.shape[1]))
    return w4a16.w4a16_prepared(x, w)


@w4a16_mm.register_fake
def _(x, qweight, scales, zeros, g_idx, group_size, kqweight=None, kg_idx=None, kperm=None):
    return x.new_empty((x.shape[0], qweight.shape[1]))


@torch.library.custom_op(f"{NAMESPACE}::fp8_mm", mutates_args=())
def fp8_mm(
    x: torch.Tensor,
    w_bits: torch.Tensor,
    w_scale: torch.Tensor,
    mode: str,
    block_n: int,
    block_k: int,
    input_scale: torch.Tensor | None,
) -> torch.Tensor:
    """`x @ (w_fp8 * w_scale)ᵀ` (`kernels/fp8.fp8_matmul`), w_bits = `w_fp8.view(torch.uint8)`."""
    from infer_tool.kernels.fp8 import fp8_matmul

    block = (block_n, block_k) if block_n else None
    return fp8_matmul(x, w_bits.view(torch.float8_e4m3fn), w_scale, mode, block, input_scale)


@fp8_mm.register_fake
def _(x, w_bits, w_scale, mode, block_n, block_k, input_scale):
    return x.new_empty((x.shape[0], w_bits.shape[0]))


@torch.library.custom_op(f"{NAMESPACE}::fp4_mm", mutates_args=())
def fp4_mm(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    scale_bits: torch.Tensor,
    e4m3_scales: bool,
    global_scale: torch.Tensor | None,
) -> torch.Tensor:
    """`x @ dequantize(w)ᵀ` (`kernels/fp4.fp4_matmul`); scale_bits: the scales' uint8 bits,
    E4M3 (NVFP4) when e4m3_scales, else E8M0 (MXFP4)."""
    from infer_tool.kernels.fp4 import fp4_matmul

    w_scale = scale_bits.view(torch.float8_e4m3fn) if e4m3_scales else scale_bits
    return fp4_matmul(x, w_packed, w_scale, global_scale)


@fp4_mm.register_fake
def _(x, w_packed, scale_bits, e4m3_scales, global_scale):
    return x.new_empty((x.shape[0], w_packed.shape[0]))
