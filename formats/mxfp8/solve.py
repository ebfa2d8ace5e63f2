"""MXFP8 solvers, pure functions `(W (N, K), stats, scheme) -> Mxfp8Weight`: round to nearest,
and GPTQ's column loop (`packers/gptq.solve_columns`, the same code INT and FP4 run) with each
column rounded to E4M3 at its group's scale, the scales taken from the original weights
(static groups, whatever the column order)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from infer_tool.formats.mxfp8 import numerics
from infer_tool.formats.mxfp8.scheme import Mxfp8GPTQScheme, Mxfp8Scheme
from infer_tool.formats.mxfp8.weight import Mxfp8Weight
from infer_tool.packers.gptq import fallback_info, prepare, solve_columns, solved_info


def group_exponents(W: torch.Tensor) -> torch.Tensor:
    """uint8 `(N, K/32)` E8M0 exponents of W's groups (compressed-tensors' rule)."""
    return numerics.weight_scales(numerics.grouped(W.float()).abs().amax(dim=-1))


def quantize_rtn(W: torch.Tensor, stats: object | None = None, scheme: Mxfp8Scheme = Mxfp8Scheme()) -> Mxfp8Weight:
    """Round W (N, K) to the MXFP8 grid; `stats` is unused."""
    u = group_exponents(W)
    return Mxfp8Weight(numerics.quantize(W, u), u, scheme.mxfp8_activations, {"method": "rtn"})


def quantize_gptq(
    W: torch.Tensor, stats: object, scheme: Mxfp8GPTQScheme = Mxfp8GPTQScheme(), *, parts: Sequence[int] | None = None
) -> Mxfp8Weight:
    """GPTQ of W (N, K) onto the MXFP8 grid. stats: LayerStats or the (K, K) Hessian; info as INT
    GPTQ's (method, damp, attempts, fallback and reason, dead columns, loss); `parts` (stacked
    linears sharing H) as `packers/gptq.quantize_gptq`'s."""
    u = group_exponents(W)  # the original weights' (static groups)

    def fallback(reason: str, attempts: int, dead: int) -> Mxfp8Weight:
        w = quantize_rtn(W, None, scheme)
        w.info = fallback_info(reason, attempts, dead)
        return w

    p = prepare(W, stats, scheme.act_order)
    if p is None:
        return fallback("Hessian has non-finite entries", 0, 0)
    cols = numerics.scale_value(u).repeat_interleave(numerics.GROUP_SIZE, dim=1)  # (N, K): column k's scale
    if p.perm is not None:
        cols = cols[:, p.perm]

    def column(col: int, W1: torch.Tensor, i: int, Wp: torch.Tensor, i2: int) -> tuple[torch.Tensor, torch.Tensor]:
        deq = numerics.fake_quantize(W1[:, i], cols[:, col])  # (N,)
        return deq, deq

    solved = solve_columns(p, column, scheme, parts)
    if isinstance(solved, str):
        return fallback(solved, scheme.damp_retries + 1, p.dead)
    info = solved_info(solved, p.dead, parts)
    return Mxfp8Weight(numerics.quantize(solved.Q, u), u, scheme.mxfp8_activations, info)
