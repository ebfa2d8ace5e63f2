"""INT4 weights x INT8 activations, as vLLM's CPU build serves INT4 checkpoints on AMX CPUs.

vLLM 0.32's `CPUWNA16LinearKernel` (model_executor/kernels/linear/mixed_precision/cpu.py) runs
a bf16 model's INT4 linears through `int4_scaled_mm_cpu` (csrc/cpu/sgl-kernels/gemm_int4.cpp)
when `VLLM_CPU_INT4_W4A8=1` (the default) and the CPU has AMX. That kernel:

1. quantizes each token (row of x) to int8 with `quantize_row_int8` (the "sgl" formula of
   `kernels/int8_act.py`: scale = max(amax, 1e-7) / 127, q = round(x * 127 / amax), ties to even
   for bf16), stored as q + 128 with zero point 128, so the activations are symmetric;
2. keeps the INT4 codes and their zero points as they are (unsigned 0..15; symmetric
   checkpoints get zero point 8) and the group scales converted to float32: no requantization;
3. for each block of `min(group_size, 128)` input channels, sums q_a * (q_w - z) exactly in
   int32, converts it to float32 and multiplies by the token's scale, then by the output
   channel's group scale with a fused multiply-add into a float32 accumulator that starts at
   the bias (the build contracts the last multiply and the add; the probe's bits say so);
4. rounds the accumulator to the output dtype (bf16, round to nearest even).

`w4a8_reference` computes exactly that, block by block (the integer sums in float64, exact).
Operands are the canonical INT4 layout of `kernels/w4a16.py`: `qweight` int32 `(ceil(K/8), N)`
packed along K, `scales` `(G, N)`, `zeros` uint8 `(G, N)` or None (symmetric, zero point 8),
contiguous groups of `group_size` along K (vLLM's CPU path has no act-order `g_idx`).
"""

from __future__ import annotations

import torch

from infer_tool.kernels.int8_act import quantize_per_token
from infer_tool.kernels.layout import unpack_int4_k

BLOCK_K = 128  # `get_4bit_block_k_size`: the K block of one int32 partial sum (at most a group)
SYMMETRIC_ZERO = 8


def w4a8_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x (M, K) @ W` with W the INT4 weight `(K, N)`, activations per-token int8, in vLLM's
    AMX W4A8 arithmetic (module doc); `(M, N)` in x's dtype."""
    M, K = x.shape
    N = qweight.shape[1]
    G = scales.shape[0]
    if group_size * G != K or scales.shape != (G, N) or (zeros is not None and zeros.shape != (G, N)):
        raise ValueError(
            f"w4a8: scales {tuple(scales.shape)} / zeros do not give groups of {group_size} over K={K}, N={N}"
        )
    block = min(group_size, BLOCK_K)
    if group_size % block:
        raise ValueError(f"w4a8: group size {group_size} is not a multiple of the {BLOCK_K}-channel block")
    qa, sa, _ = quantize_per_token(x, kernel="sgl")  # (M, K) int8, (M, 1) fp32
    g = torch.arange(K, device=x.device) // group_size  # (K,)
    z = zeros[g].to(torch.int32) if zeros is not None else SYMMETRIC_ZERO
    w = (unpack_int4_k(qweight, K).to(torch.int32) - z).double()  # (K, N), values -15..15
    a = qa.double()
    s_w = scales.float()
    acc = torch.zeros(M, N, dtype=torch.float32, device=x.device)
    if bias is not None:
        acc = acc + bias.float()
    for k0 in range(0, K, block):
        partial = (a[:, k0 : k0 + block] @ w[k0 : k0 + block]).float()  # (M, N) exact integers
        # fma(partial * s_a, s_w, acc): the product of two float32 is exact in float64
        acc = (acc.double() + (partial * sa).double() * s_w[k0 // group_size].double()).float()
    return acc.to(x.dtype)
