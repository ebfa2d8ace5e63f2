"""AWQ (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization"): the per-channel
scale search (§3.2) and the weight-clipping search, as functions returning data, and the
clip's apply step (a tensor operation). Folding the scales into a block is module surgery
and lives with the pipeline (`calib/quantizers/awq_fold.fold_scales`).

The caller knows the block: it passes a `forward` callable that runs the inspected block
with given effective weights for the balanced linears. This module knows nothing about
architectures or files.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from infer_tool.packers.rtn import fake_quantize
from infer_tool.schemes.integer import AWQScheme


@dataclass
class AWQScaleResult:
    scales: torch.Tensor  # (K,) fp32: balanced linears' inputs are divided by s, weights multiplied
    ratio: float | None  # the best alpha; None when no scaling beat plain RTN (s = 1)
    rtn_loss: float | None  # block-output MSE with plain RTN weights (s = 1); None: screened out (not the minimum)
    losses: list[float | None] = field(default_factory=list)  # MSE per alpha on the grid; None: not evaluated
    search: str = "full"  # the grid search that ran (`schemes/integer.AWQ_SEARCHES`)
    fell_back: bool = False  # fast: a loss curve that is not unimodal; screen: so inexact that every ratio was scored
    screen_losses: list[float] | None = None  # screen: the low-precision MSE per alpha (every grid point)
    screen_error: float | None = None  # screen: the spread of L_lo / L where both were measured (`screen_grid`)
    screen_rtn_loss: float | None = None  # screen: plain RTN's low-precision MSE
    # With the full grid: the ratio the fast search picks on the same losses, and its loss.
    fast_ratio: float | None = None
    fast_loss: float | None = None

    @property
    def best_loss(self) -> float:
        return min(v for v in [self.rtn_loss, *self.losses] if v is not None)

    @property
    def evaluated(self) -> int:
        """Block evaluations spent on the grid (the RTN candidate not counted)."""
        return sum(v is not None for v in self.losses)

    def summary(self) -> dict[str, object]:
        """The search, for a report: the grid losses (None: not evaluated), the evaluations
        spent, and, with the full grid, the fast search's choice on the same losses and how
        much higher its loss is (0.0: the same choice)."""
        out: dict[str, object] = {"search": self.search, "evaluated": self.evaluated, "losses": self.losses}
        if self.search == "fast":
            out["fell_back"] = self.fell_back
        elif self.search == "screen":
            out.update(
                fell_back=self.fell_back,
                screen_losses=self.screen_losses,
                screen_rtn_loss=self.screen_rtn_loss,
                screen_error=self.screen_error,
            )
        else:
            out["fast_ratio"] = self.fast_ratio
            out["fast_loss_excess"] = self.fast_loss - self.best_loss
        return out


def weight_magnitude(weights: Sequence[torch.Tensor], group_size: int) -> torch.Tensor:
    """(K,) mean over output rows of |w| normalised by each group's max (AutoAWQ's w_mean)."""
    W = torch.cat([w.float() for w in weights], dim=0)  # (sum N_i, K)
    n, k = W.shape
    g = k if group_size == -1 else group_size
    Wg = W.abs().reshape(n, k // g, g)
    Wg = Wg / (Wg.amax(dim=-1, keepdim=True) + 1e-6)
    return Wg.reshape(n, k).mean(dim=0)


def candidate_scales(x_abs_mean: torch.Tensor, ratio: float, w_mean: torch.Tensor | None) -> torch.Tensor:
    """s = mean|x|^alpha [/ mean|w|^(1-alpha)], clamped, normalised by sqrt(max·min): (K,)."""
    x = x_abs_mean.float()
    if w_mean is not None:
        s = (x.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
    else:
        s = x.pow(ratio).clamp(min=1e-4)
    s = s / (s.max() * s.min()).sqrt()
    s[~torch.isfinite(s)] = 1.0
    return s


def linear_output_mse(delta: torch.Tensor, H: torch.Tensor, tokens: int) -> float:
    """mean((X ΔWᵀ)²) over T tokens and N outputs, from the Gram matrix H = XᵀX (K, K):
    sum((ΔW H) ∘ ΔW) / (T·N). delta: ΔW (N, K). Costs N·K² instead of T·N·K flops. In
    float32, or, with ΔW and H both in a lower precision (the screen), its product in that
    precision and the rest in float32."""
    d = delta.float()
    product = delta @ H if delta.dtype == H.dtype != torch.float32 else d @ H.float()
    return float((product.float() * d).sum()) / (tokens * d.shape[0])


def unimodal(values: Sequence[float]) -> bool:
    """True when `values` strictly decrease to their minimum, then strictly increase (a tie
    anywhere is not unimodal: the argmin could then depend on the points looked at)."""
    k = min(range(len(values)), key=values.__getitem__)
    down = all(a > b for a, b in zip(values[:k], values[1 : k + 1]))
    up = all(a < b for a, b in zip(values[k:], values[k + 1 :]))
    return down and up


def search_grid(loss_at: Callable[[int], float], n: int, search: str, step: int) -> bool:
    """Call `loss_at(i)` on grid indices 0..n-1 so that the smallest loss is among those looked at.

    "full": every index. "fast" (coarse to fine): the coarse indices 0, step, 2·step, ... and
    n-1, then every index between the coarse minimum's two coarse neighbours. When the
    losses over the grid are unimodal the grid's minimum lies in that bracket, so this finds
    it exactly, in at most 12 of 20 evaluations at step 4. The points looked at are checked:
    when the coarse points, or all points looked at (in grid order), are not unimodal (a tie
    included), every remaining index is evaluated: the full grid. What it cannot see is a
    dip of the loss at indices it never looked at. Returns True when it fell back.
    """
    if search == "full" or n <= 2:
        for i in range(n):
            loss_at(i)
        return False
    seen: dict[int, float] = {}

    def look(indices: Sequence[int]) -> bool:
        for i in indices:
            if i not in seen:
                seen[i] = loss_at(i)
        return unimodal([seen[i] for i in sorted(seen)])

    coarse = sorted({*range(0, n, step), n - 1})
    if look(coarse):
        j = min(range(len(coarse)), key=lambda c: seen[coarse[c]])
        if look(range(coarse[max(j - 1, 0)], coarse[min(j + 1, len(coarse) - 1)] + 1)):
            return False
    look(range(n))
    return True


def screen_grid(
    loss_at: Callable[[int], float], screen_at: Callable[[int], float], n: int, margin: float, at_least: int = 3
) -> tuple[list[float], float, float]:
    """Find the grid index of the smallest `loss_at` while calling it on few indices: screen
    every index with the cheap, approximate `screen_at` (e.g. the block in bfloat16), then
    call `loss_at` on the `at_least` smallest screened losses L̃ and on every index whose L̃
    is within (1 + m) of the smallest, m starting at `margin`.

    Write the screen as L̃ = c·L·(1 + δ) with a common factor c (only ratios of screened
    losses are compared, so c does not matter). While |δ| ≤ ε = m / (2 + m), an index left
    out is not the minimum: L ≥ L̃/(c(1+ε)) > (1+m)·min L̃/(c(1+ε)) ≥ (1+m)(1-ε)/(1+ε)·min L
    = min L. δ is measured where it matters, on the indices scored exactly (the smallest
    losses): the spread of their L̃/L, (max - min)/(max + min). While that spread exceeds
    ε/2, m grows to the margin it calls for, 4·spread/(1 - 2·spread), and the indices it
    adds are scored exactly; at worst every index is (the full grid). Returns (the
    screened losses, the final spread, the final m; m = inf: the full grid).
    """
    screened = [screen_at(i) for i in range(n)]
    low = min(screened)
    ratio: dict[int, float] = {}
    todo = set(sorted(range(n), key=screened.__getitem__)[:at_least])
    m = margin
    while True:
        todo |= set(range(n)) if m == float("inf") else {i for i in range(n) if screened[i] <= (1 + m) * low}
        for i in sorted(todo - ratio.keys()):
            loss = loss_at(i)
            ratio[i] = screened[i] / loss if loss > 0 else (1.0 if screened[i] == 0 else float("inf"))
        hi, lo = max(ratio.values()), min(ratio.values())
        spread = (hi - lo) / (hi + lo) if hi < float("inf") and hi + lo > 0 else float("inf")
        need = 4 * spread / (1 - 2 * spread) if spread < 0.5 else float("inf")  # spread = need / (2 + need) / 2
        if need <= m:
            return screened, spread, m
        if len(ratio) == n:
            return screened, spread, float("inf")
        m = need  # the next round adds a point, or stops here: the same spread then meets need <= m


def awq_search_scale(
    x_abs_mean: torch.Tensor,
    weights: Sequence[torch.Tensor],
    forward: Callable[[list[torch.Tensor]], torch.Tensor] | None,
    reference_output: torch.Tensor | None,
    scheme: AWQScheme = AWQScheme(),
    *,
    gram: tuple[torch.Tensor, int] | None = None,
    screen: tuple[Callable[[list[torch.Tensor]], torch.Tensor], torch.Tensor] | None = None,
    gram_lo: torch.Tensor | None = None,
    qdq: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
) -> AWQScaleResult:
    """Search the per-input-channel scale s (K,) shared by the balanced linears over the grid
    alpha in {0, 1/grid, ..., (grid-1)/grid} (`scheme.search`: every point, or coarse to
    fine, `search_grid`); loss = mean squared error of the block outputs.

    x_abs_mean: (K,) mean |x| per input channel of the balanced linears' common input.
    weights: the balanced linears' weights, each (N_i, K), unscaled.
    forward(effective_weights) -> block output: runs the inspected block with each balanced
        linear's weight replaced by Q(W_i·diag(s))·diag(s)^-1 (the same order as `weights`);
        equivalent to feeding X/s to the quantized scaled weights.
    reference_output: the block output with the original weights (same shape as forward's).
    gram: (H = XᵀX (K, K), T) when the inspected block is the one balanced linear itself
        (up -> down, v -> o): the loss is then `linear_output_mse`, the same MSE (a bias
        cancels) without running the block; forward and reference_output may be None.
    screen: (forward_lo, reference_lo): the inspected block in a lower precision (e.g.
        bfloat16) and its output with the original weights, for `scheme.search == "screen"`
        (`screen_grid`: every ratio scored by it, the close ones again by `forward`).
    gram_lo: with `gram`, H in a lower precision (e.g. bfloat16): the screen of a Gram-matrix
        loss (`linear_output_mse` with ΔW and H in that precision). Without a screen for the
        kind of loss at hand, "screen" runs the full grid.
    Plain RTN (s = 1) is also measured and kept when no alpha beats it; among equal losses
    the smallest alpha wins, so both searches choose alike whenever they see the minimum.
    The screened search screens RTN like any ratio and scores it exactly only when it may be
    the minimum (`rtn_loss` None otherwise: it is not).
    qdq: quantize-dequantize of the scaled balanced weights together (a number format whose
        fused shards share a parameter, FP4's global scale); default the scheme's INT RTN of
        each (`fake_quantize`). `scheme.group_size` is the group `weight_magnitude` reads.
    """
    w_mean = weight_magnitude(weights, scheme.group_size) if scheme.duo_scaling else None
    ref = None if gram is not None else reference_output.float()

    def effective_weights(s: torch.Tensor) -> list[torch.Tensor]:
        if qdq is not None:
            return [(q / s).to(w.dtype) for w, q in zip(weights, qdq([w.float() * s for w in weights]))]
        return [
            (
                fake_quantize(
                    w.float() * s,
                    scheme.bits,
                    scheme.group_size,
                    scheme.symmetric,
                    scheme.torch_scale_dtype,
                    full_range=scheme.full_range,
                )
                / s
            ).to(w.dtype)
            for w in weights
        ]

    def loss_with(s: torch.Tensor) -> float:
        effective = effective_weights(s)
        if gram is not None:
            (w,), (e,) = weights, effective
            return linear_output_mse(e.float() - w.float(), *gram)
        return float((forward(effective).float() - ref).pow(2).mean())

    forward_lo, ref_lo = (screen[0], screen[1].float()) if screen is not None else (None, None)
    diff: list[torch.Tensor] = []  # one float32 buffer for every screened candidate's output error

    def screened_loss(s: torch.Tensor) -> float:
        if gram is not None:
            (w,), (e,) = weights, effective_weights(s)
            return linear_output_mse((e.float() - w.float()).to(gram_lo.dtype), gram_lo, gram[1])
        out = forward_lo(effective_weights(s))
        if not diff:
            diff.append(torch.empty_like(ref_lo))
        d = torch.sub(out, ref_lo, out=diff[0])  # in float32, as out.float() - ref_lo: one pass, no allocation
        return float(torch.linalg.vector_norm(d)) ** 2 / d.numel()

    ones = torch.ones(x_abs_mean.shape[0], device=weights[0].device)
    x = x_abs_mean.to(ones.device)
    losses: list[float | None] = [None] * scheme.grid

    def loss_at(i: int) -> float:
        losses[i] = loss_with(candidate_scales(x, i / scheme.grid, w_mean))
        return losses[i]

    search = scheme.search
    if search == "screen" and (gram is None and screen is None or gram is not None and gram_lo is None):
        search = "full"
    screened, screen_error, screen_rtn = None, None, None
    if search == "screen":  # plain RTN is one more candidate (index grid), scored exactly only if it may be the minimum
        rtn: list[float] = []

        def exact(i: int) -> float:
            if i < scheme.grid:
                return loss_at(i)
            rtn.append(loss_with(ones))
            return rtn[0]

        def approx(i: int) -> float:
            return screened_loss(ones if i == scheme.grid else candidate_scales(x, i / scheme.grid, w_mean))

        every, screen_error, margin = screen_grid(exact, approx, scheme.grid + 1, scheme.screen_margin)
        *screened, screen_rtn = every
        fell_back = margin == float("inf")
        rtn_loss = rtn[0] if rtn else None
    else:
        rtn_loss = loss_with(ones)
        fell_back = search_grid(loss_at, scheme.grid, search, scheme.search_step)
    best = choose(losses, float("inf") if rtn_loss is None else rtn_loss)
    ratio = None if best is None else best / scheme.grid
    s = ones if best is None else candidate_scales(x, ratio, w_mean)  # elementwise, deterministic: the tensor scored
    found = AWQScaleResult(s.cpu(), ratio, rtn_loss, losses, search, fell_back, screened, screen_error, screen_rtn)
    if search == "full":  # what the fast search would choose on these very losses
        fast: list[float | None] = [None] * scheme.grid

        def seen(i: int) -> float:
            fast[i] = losses[i]
            return fast[i]

        search_grid(seen, scheme.grid, "fast", scheme.search_step)
        i = choose(fast, rtn_loss)
        found.fast_ratio, found.fast_loss = (None, rtn_loss) if i is None else (i / scheme.grid, fast[i])
    return found


def choose(losses: Sequence[float | None], rtn_loss: float) -> int | None:
    """The grid index of the smallest loss looked at (the first among equals), or None when
    none is strictly below plain RTN's: the full grid's rule since the first session."""
    best, best_loss = None, rtn_loss
    for i, loss in enumerate(losses):
        if loss is not None and loss < best_loss:
            best, best_loss = i, loss
    return best


@torch.no_grad()
def awq_search_clip(
    weight: torch.Tensor,
    x: torch.Tensor,
    scheme: AWQScheme = AWQScheme(),
    qdq_rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Per (output row, group) clip threshold minimising the group-wise output error.

    weight: (N, K) after scaling; x: (T, K) its inputs (already divided by s), subsampled to
    at most `scheme.clip_tokens` evenly spaced tokens. For i < max_shrink·clip_grid the
    threshold max|w|·(1 - i/clip_grid) clamps w to [-t, t] before RTN; the error is the
    mean over tokens of (x_g·q_g - x_g·w_g)² per group. Returns t (N, G) fp32. Callers skip
    layers whose output feeds a softmax through a dot product (q/k) by not calling this.
    qdq_rows: quantize-dequantize of a batch of clipped rows (b, K) -> (b, K) float32 in
    another number format (FP4, its global scale fixed); default the scheme's INT RTN.
    """
    N, K = weight.shape
    g = scheme.group_for(K)
    G = K // g
    T = x.shape[0]
    step = max(1, T // scheme.clip_tokens)
    xs = x[::step][: scheme.clip_tokens].float().reshape(-1, G, g).transpose(0, 1)  # (G, t, g)
    W = weight.float().reshape(N, G, g)  # (N, G, g)
    n_shrink = max(1, int(scheme.max_shrink * scheme.clip_grid))
    best_max = torch.empty(N, G, device=weight.device)
    for b0 in range(0, N, scheme.clip_batch):
        w = W[b0 : b0 + scheme.clip_batch]  # (b, G, g)
        b = w.shape[0]
        org_max = w.abs().amax(dim=-1, keepdim=True)  # (b, G, 1)
        org_out = torch.bmm(xs, w.permute(1, 2, 0))  # (G, t, b): per-group partial outputs
        out = torch.empty_like(org_out)  # every candidate's partial outputs, then its squared error, in place
        best = org_max.clone()
        min_err = torch.full_like(org_max, float("inf"))
        for i in range(n_shrink):
            t = org_max * (1 - i / scheme.clip_grid)
            cur = torch.clamp(w, -t, t)
            if qdq_rows is not None:
                q = qdq_rows(cur.reshape(b, K)).float().reshape(b, G, g)
            else:
                q = fake_quantize(
                    cur.reshape(b, K),
                    scheme.bits,
                    g,
                    scheme.symmetric,
                    scheme.torch_scale_dtype,
                    full_range=scheme.full_range,
                )
                q = q.reshape(b, G, g)
            d = torch.bmm(xs, q.permute(1, 2, 0), out=out).sub_(org_out)
            err = d.mul_(d).mean(dim=1)  # (G, b)
            err = err.transpose(0, 1).unsqueeze(-1)  # (b, G, 1)
            better = err < min_err
            min_err = torch.where(better, err, min_err)
            best = torch.where(better, t, best)
        best_max[b0 : b0 + scheme.clip_batch] = best.reshape(-1, G)
    return best_max


def apply_awq_clip(weight: torch.Tensor, max_val: torch.Tensor) -> torch.Tensor:
    """Clamp each group of (N, K) to [-t, t] with t = max_val (N, G); returns a new tensor."""
    N, K = weight.shape
    G = max_val.shape[1]
    t = max_val.to(weight.device).float().unsqueeze(-1)  # (N, G, 1)
    w = weight.float().reshape(N, G, K // G)
    return torch.clamp(w, -t, t).reshape(N, K).to(weight.dtype)
