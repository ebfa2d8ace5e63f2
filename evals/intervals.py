"""A 95% interval for the mean of a per-token quantity whose tokens are correlated within
a window (a window's tokens share their context): the windows are the independent units.

The mean is the ratio estimator m = Σ_w S_w / Σ_w n_w (S_w the window's sum, n_w its
scored tokens). Its standard error is the cluster-robust one with windows as clusters,
se² = W/(W−1) · Σ_w (S_w − m·n_w)² / (Σ_w n_w)², and the interval m ± t₀.₉₇₅(W−1)·se with
Student's t quantile for W−1 degrees of freedom (with equal windows this is the classic
batch-means interval: the t interval over the W window means). With one window there is
no interval. (The per-token standard error, tokens taken as independent as llama.cpp's
`--kl-divergence` takes them for its "±", is narrower when tokens are correlated.)

Student's t distribution function is computed from the regularized incomplete beta
function by its continued fraction (modified Lentz), and inverted by bisection.

What this module does not know: what the quantity is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def _beta_cf(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b) (modified Lentz), converging for x < (a+1)/(a+b+2)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        for aa in (
            m * (b - m) * x / ((a - 1.0 + 2 * m) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 1.0 + 2 * m)),
        ):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def beta_inc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_cf(a, b, x) / a
    return 1.0 - front * _beta_cf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * beta_inc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The `p` quantile (0 < p < 1) of Student's t with `df` degrees of freedom (bisection)."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0 (got p={p}, df={df})")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, 2.0 * hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return 0.5 * (lo + hi)


def window_se(sums: Sequence[float], counts: Sequence[int]) -> float | None:
    """The cluster-robust standard error of Σ sums / Σ counts, windows as clusters (None for
    fewer than two windows)."""
    W, N = len(sums), sum(counts)
    if W < 2:
        return None
    m = math.fsum(sums) / N
    return math.sqrt(W / (W - 1) * math.fsum((s - m * n) ** 2 for s, n in zip(sums, counts))) / N


def mean_ci95(sums: Sequence[float], counts: Sequence[int]) -> tuple[float, float] | None:
    """The 95% interval of the mean (see the module docstring), or None for one window."""
    se = window_se(sums, counts)
    if se is None:
        return None
    m = math.fsum(sums) / sum(counts)
    half = t_quantile(0.975, len(sums) - 1) * se
    return m - half, m + half
