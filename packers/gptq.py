"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"), Algorithm 1, with the names of IST-DASLab's gptq.py
(W, H, Hinv, Err1).

Input: a linear weight W (N, K) and the layer's Hessian H (K, K) = mean over tokens of
2·x·xᵀ (calib's `LayerStats.H`). The solver never sees activations, a model or a file.
A failed Cholesky is retried with larger damping, then the layer falls back to RTN; the
returned `QuantizedWeight.info` says so (no warning is printed here).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from infer_tool.packers.int_weight import QuantizedWeight
from infer_tool.packers.rtn import observed_qparams, quantize_codes, quantize_rtn
from infer_tool.schemes.integer import GPTQScheme


def _hessian_of(stats: object) -> torch.Tensor:
    """Accept a LayerStats-like object with `.H`, or the (K, K) tensor itself."""
    H = stats if isinstance(stats, torch.Tensor) else getattr(stats, "H", None)
    if H is None:
        raise ValueError("GPTQ needs the layer Hessian H (K, K); these statistics were gathered without it")
    return H


def inverse_hessian_cholesky(H: torch.Tensor, damp: float) -> torch.Tensor | None:
    """Upper Cholesky factor of (H + damp·mean(diag H)·I)^-1 (§3 Step 3, "Cholesky Reformulation").

    H (K, K) float32 with dead columns already fixed; returns None when a factorisation fails.
    """
    K = H.shape[0]
    H = H.clone()
    idx = torch.arange(K, device=H.device)
    H[idx, idx] += damp * torch.mean(torch.diag(H))
    L, info = torch.linalg.cholesky_ex(H)
    if int(info) != 0:
        return None
    Hinv = torch.cholesky_inverse(L)
    U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
    if int(info) != 0 or not bool(torch.isfinite(U).all()):
        return None
    return U


def gptaq_target(
    W: torch.Tensor, H: torch.Tensor, dXXT: torch.Tensor, alpha: float, damp: float
) -> torch.Tensor | None:
    """The weights GPTQ rounds toward under asymmetric calibration (GPTAQ, Li et al. 2025):
    W* = W + α·W·dXXᵀ·H_d⁻¹, with dXXᵀ = 2(X̃ − X)Xᵀ/T.

    X (K, T) are the inputs through the quantized layers before this one, X̃ the fp model's
    own; H = 2XXᵀ/T. At α = 1 (and no damping) W* is the least-squares fit of the fp output
    WX̃ from X, and ‖QX − WX̃‖² = ‖(Q − W*)X‖² + const: GPTQ on W* with H minimises the
    error against the fp model's output. α < 1 shrinks toward W (the paper's 0.25).
    W (N, K), H, dXXT (K, K) fp32; H_d = H + damp·mean(diag H)·I, dead columns pinned as in
    `prepare`. None when H_d does not factorise (the caller keeps W).
    """
    Hd = H.detach().double().clone()
    dead = torch.diag(Hd) == 0
    Hd[dead, dead] = 1
    idx = torch.arange(Hd.shape[0], device=Hd.device)
    Hd[idx, idx] += damp * torch.mean(torch.diag(Hd))
    L, info = torch.linalg.cholesky_ex(Hd)
    if int(info) != 0:
        return None
    B = W.detach().double() @ dXXT.double().to(W.device)  # (N, K)
    shift = torch.cholesky_solve(B.T, L).T  # B·H_d⁻¹ (H_d symmetric)
    return (W.double() + alpha * shift).to(W.dtype)


class _GroupParams:
    """The scale and zero point (N,) of the group of each column GPTQ reaches.

    Static groups (act-order with `static_groups`: GPTQModel's `static_groups`,
    llm-compressor's actorder="weight"): every group's parameters on the ORIGINAL column
    order, computed up front from W before any permutation. Otherwise (dynamic groups):
    a group's parameters on the error-updated weights, when its first column is reached.
    scale, zero (N, G) float32 hold the parameters of every group at the end.
    """

    def __init__(self, W: torch.Tensor, perm: torch.Tensor | None, scheme: GPTQScheme) -> None:
        N, K = W.shape
        self.g = scheme.group_for(K)
        self.bits, self.sym, self.scale_dtype = scheme.bits, scheme.symmetric, scheme.torch_scale_dtype
        self.observer, self.full_range = scheme.observer, scheme.full_range
        self.static = scheme.act_order and scheme.static_groups
        self.col_group = None  # group of each permuted column (static groups only)
        if self.static:
            self.scale, self.zero = self._qparams(W.reshape(N, K // self.g, self.g))
            if perm is not None:
                self.col_group = (torch.arange(K, device=W.device) // self.g)[perm]
        else:
            self.scale = torch.zeros(N, K // self.g, device=W.device)
            self.zero = torch.zeros(N, K // self.g, device=W.device)

    def _qparams(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return observed_qparams(w, self.bits, self.sym, self.scale_dtype, self.observer, full_range=self.full_range)

    def at(self, col: int, W1: torch.Tensor, i: int, W: torch.Tensor, i2: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero) for permuted column `col`, which is column i of the current block
        W1 = W[:, i1:i2] (dynamic groups read ahead into W past the block when needed)."""
        g = self.g
        if self.static:
            j = int(self.col_group[col]) if self.col_group is not None else col // g
        else:
            j = col // g
            if col % g == 0:
                Wg = W1[:, i : i + g]
                if Wg.shape[1] < g:  # the group runs past this block
                    Wg = torch.cat([Wg, W[:, i2 : i2 + g - Wg.shape[1]]], dim=1)
                self.scale[:, j], self.zero[:, j] = self._qparams(Wg)
        return self.scale[:, j], self.zero[:, j]


# (permuted column index, W1, i, W, i2) -> (stored value (N,), dequantized value (N,)) of column i
# of the current block W1 = W[:, i1:i2] (W: every column, permuted; read ahead for dynamic groups)
ColumnQuantizer = Callable[[int, torch.Tensor, int, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Prepared:
    """A weight and its Hessian ready for the column loop: W (N, K) float32 with dead inputs
    (never active in calibration) zeroed and H_ii = 1 there, in the ORIGINAL column order;
    perm (K,) the act-order column order, or None; dead: how many inputs were dead."""

    W: torch.Tensor
    H: torch.Tensor
    perm: torch.Tensor | None
    dead: int


@dataclass
class Solved:
    """The column loop's result, in the ORIGINAL column order: Q (N, K) the stored values the
    column quantizer returned, the damp used, the attempts, and losses = Σ (w - q)² / Hinv_ii² / 2
    (§3) over the rows of each part (one part: every row)."""

    Q: torch.Tensor
    damp: float
    attempts: int
    losses: list[float]

    @property
    def loss(self) -> float:
        return self.losses[0] if len(self.losses) == 1 else sum(self.losses)


def part_rows(parts: Sequence[int] | None, N: int) -> list[slice]:
    """Row slices of the parts of a stacked weight (N rows; `parts` their row counts, None: one)."""
    if parts is None:
        return [slice(0, N)]
    if any(n <= 0 for n in parts) or sum(parts) != N:
        raise ValueError(f"parts {list(parts)} do not split {N} rows")
    ends = [sum(parts[: i + 1]) for i in range(len(parts))]
    return [slice(e - n, e) for e, n in zip(ends, parts)]


def part_info(info: dict, i: int) -> dict:
    """The solver's info for part i of a stacked solve: its own loss (`part_losses`)."""
    one = {k: v for k, v in info.items() if k != "part_losses"}
    if "part_losses" in info:
        one["loss"] = info["part_losses"][i]
    return one


def prepare(weight: torch.Tensor, stats: object, act_order: bool) -> Prepared | None:
    """W (N, K) and the Hessian of `stats` (LayerStats or the (K, K) tensor) for the column
    loop; None when the Hessian has non-finite entries."""
    W = weight.detach().float().clone()  # (N, K)
    H = _hessian_of(stats).detach().float().clone().to(W.device)  # (K, K)
    if not bool(torch.isfinite(H).all()):
        return None
    # Dead inputs (never active in calibration): pin H_ii = 1 and zero the column.
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else None
    return Prepared(W, H, perm, int(dead.sum()))


def solve_columns(
    p: Prepared, quantize_column: ColumnQuantizer, scheme: GPTQScheme, parts: Sequence[int] | None = None
) -> Solved | str:
    """GPTQ's column loop (Algorithm 1 with lazy batch updates) over `p`, each column rounded by
    `quantize_column`; `scheme` gives damp, damp_retries, damp_growth and block_size (any scheme
    with those fields). Returns the reason when the Cholesky factorisation fails at every damp.

    `parts`: row counts of linears stacked in `p.W` that share H (q/k/v, gate/up). GPTQ's
    updates are row-wise given H; each part's block update is its own product and its loss its
    own sum, so every part gets the bits of its own solve with one factorisation and one
    column loop for all."""
    W, H, perm = p.W, p.H, p.perm
    K = W.shape[1]
    bounds = part_rows(parts, int(W.shape[0]))
    if perm is not None:
        W = W[:, perm]
        H = H[perm][:, perm]

    damp = scheme.damp
    Hinv = None
    attempts = 0
    for attempts in range(1, scheme.damp_retries + 2):  # noqa: B007 (read after the loop: Solved.attempts)
        Hinv = inverse_hessian_cholesky(H, damp)
        if Hinv is not None:
            break
        damp *= scheme.damp_growth
    if Hinv is None:
        return f"Cholesky failed up to damp={damp / scheme.damp_growth:g}"

    Q = torch.zeros_like(W)  # (N, K) stored values, permuted order
    Losses = torch.zeros_like(W)

    B = scheme.block_size
    for i1 in range(0, K, B):  # §3 Step 2: lazy batch updates over blocks of B columns
        i2 = min(i1 + B, K)
        count = i2 - i1
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]

        for i in range(count):
            w = W1[:, i]
            d = Hinv1[i, i]
            q, deq = quantize_column(i1 + i, W1, i, W, i2)  # (N,)
            Q1[:, i] = q
            err1 = (w - deq) / d
            W1[:, i:] -= err1.unsqueeze(1).matmul(Hinv1[i, i:].unsqueeze(0))
            Err1[:, i] = err1

        Q[:, i1:i2] = Q1
        Losses[:, i1:i2] = Err1**2 / 2  # (w - q)² / Hinv_ii² / 2, once per block
        for rows in bounds:  # §3 Step 2: propagate the block's error to later columns
            W[rows, i2:] -= Err1[rows].matmul(Hinv[i1:i2, i2:])

    if perm is not None:
        Q = Q[:, torch.argsort(perm)]
    return Solved(Q, damp, attempts, [float(Losses[rows].sum()) for rows in bounds])


def quantize_gptq(
    weight: torch.Tensor, stats: object, scheme: GPTQScheme = GPTQScheme(), *, parts: Sequence[int] | None = None
) -> QuantizedWeight:
    """Quantize W (N, K) column by column with error feedback through Hinv.

    stats: LayerStats (uses `.H` (K, K) fp32) or the Hessian tensor itself.
    Returns codes in the ORIGINAL column order. With act_order and static groups, g_idx is
    k // group_size (stored as None); with act_order and dynamic groups, g_idx (K,) is the
    group of each original column. info: method, damp (fraction used), attempts, fallback
    (None or "rtn") and reason, dead columns, loss = Σ (w - q)² / Hinv_ii² / 2 (§3); with
    `parts` (stacked linears, `solve_columns`), part_losses too (`part_info` splits it).
    """
    N, K = weight.shape
    g = scheme.group_for(K)
    if K % g:
        raise ValueError(f"group size {g} does not divide K={K}")
    bits, sym = scheme.bits, scheme.symmetric

    p = prepare(weight, stats, scheme.act_order)
    if p is None:
        return _fallback(weight, scheme, "Hessian has non-finite entries", attempts=0, dead=0)
    groups = _GroupParams(p.W, p.perm, scheme)  # on the original column order

    def int_column(col: int, W1: torch.Tensor, i: int, W: torch.Tensor, i2: int) -> tuple[torch.Tensor, torch.Tensor]:
        s, z = groups.at(col, W1, i, W, i2)
        q = quantize_codes(W1[:, i], s, z, bits)  # (N,)
        return q, (q - z) * s

    solved = solve_columns(p, int_column, scheme, parts)
    if isinstance(solved, str):
        return _fallback(weight, scheme, solved, scheme.damp_retries + 1, p.dead)

    g_idx = None
    if p.perm is not None and not groups.static:
        # Group j holds permuted columns j*g..(j+1)*g-1: original column k sits at invperm[k].
        g_idx = (torch.argsort(p.perm) // g).to(torch.int32)

    return QuantizedWeight(
        q=solved.Q.to(torch.uint8),
        scale=groups.scale,
        zero=None if sym else groups.zero.to(torch.uint8),
        g_idx=g_idx,
        bits=bits,
        group_size=g,
        info=solved_info(solved, p.dead, parts),
    )


def finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def solved_info(solved: Solved, dead: int, parts: Sequence[int] | None) -> dict:
    """The report of a finished solve (every format's GPTQ): method, damp used, attempts, no
    fallback, dead columns, loss; with `parts`, each part's loss (`part_info` splits them)."""
    return {
        "method": "gptq",
        "damp": solved.damp,
        "attempts": solved.attempts,
        "fallback": None,
        "reason": None,
        "dead_columns": dead,
        "loss": finite_or_none(solved.loss),
        **({"part_losses": [finite_or_none(x) for x in solved.losses]} if parts is not None else {}),
    }


def fallback_info(reason: str, attempts: int, dead: int) -> dict:
    """The report of a solve that fell back to RTN (a Hessian that would not factorise)."""
    return {
        "method": "gptq",
        "damp": None,
        "attempts": attempts,
        "fallback": "rtn",
        "reason": reason,
        "dead_columns": dead,
        "loss": None,
    }


def _fallback(weight: torch.Tensor, scheme: GPTQScheme, reason: str, attempts: int, dead: int) -> QuantizedWeight:
    qw = quantize_rtn(weight, scheme=scheme)
    qw.info = fallback_info(reason, attempts, dead)
    return qw
