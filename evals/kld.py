"""KL divergence of a model from a reference model, token by token, over the windows
`evals/ppl.py` scores.

At every scored position t (the positions `eval ppl` sums its NLL over), with P the
reference's next-token distribution and Q the model's, both over the full vocabulary:

    KL_t(P ‖ Q) = Σ_v P(v) · (log P(v) − log Q(v))      (nats)

from log-softmax in float64 of the float32 logits (terms with P(v) = 0 are 0). "Same top
token" is the fraction of positions where both argmaxes (of the float32 logits, first
index on ties) agree. The windows are run one at a time: one window's logits of each
model are held at once, never the corpus's.

Summary over the N scored tokens: the mean with its 95% interval over windows
(`evals/intervals.py`: windows are the independent units, a window's tokens share their
context), the per-token standard error (tokens as independent, llama.cpp's "±"), median,
p90, p99, p99.9 and max, with percentiles by linear interpolation between order
statistics (numpy's default, `torch.quantile`'s "linear"). Same top token gets the same
interval.

Under `accelerate launch` the windows are dealt round-robin as `eval ppl` deals them
(`ppl.my_windows`); every process writes its windows' per-token values into their slots
of one flat float64 tensor (zeros elsewhere) and the tensors are all-reduced with SUM:
each slot is non-zero on one process only, so every process holds the one-process values
bit for bit and computes the same exact percentiles.

What this module does not know: how the models were loaded or quantized.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from infer_tool.common.errors import BadInput
from infer_tool.common.progress import Progress, no_progress

PROTOCOL = (
    "per-token KL(P_reference ‖ P_model) in nats over the full vocabulary at every position eval ppl scores, "
    "from float64 log-softmax of float32 logits; mean with a 95% t interval over windows (cluster-robust), "
    "percentiles by linear interpolation; same top token: argmaxes agree"
)
QUANTILES = {"median": 0.5, "p90": 0.9, "p99": 0.99, "p99_9": 0.999}
CHUNK_ELEMENTS = 1 << 22  # float64 elements per row chunk of the log-softmax (32 MiB)


def token_kl(ref_logits: Any, logits: Any) -> Any:
    """KL(P ‖ Q) per row, float64 (S,), of P = softmax(ref_logits) and Q = softmax(logits),
    both (S, V); computed in row chunks so that only a chunk is held in float64."""
    import torch

    if ref_logits.shape != logits.shape:
        raise BadInput(
            f"the models' logits differ in shape: reference {tuple(ref_logits.shape)}, model {tuple(logits.shape)}"
        )
    S, V = logits.shape
    out = torch.empty(S, dtype=torch.float64, device=logits.device)
    rows = max(1, CHUNK_ELEMENTS // max(V, 1))
    for a in range(0, S, rows):
        log_p = torch.log_softmax(ref_logits[a : a + rows].double(), dim=-1)  # (r, V)
        log_q = torch.log_softmax(logits[a : a + rows].double(), dim=-1)
        p = log_p.exp()
        out[a : a + rows] = torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)
    return out


def same_top(ref_logits: Any, logits: Any) -> Any:
    """(S,) bool: the two (S, V) logits' argmaxes agree."""
    return ref_logits.argmax(-1) == logits.argmax(-1)


def quantiles(values: Any, qs: list[float]) -> list[float]:
    """The `qs` quantiles of a 1-D tensor, linear interpolation between order statistics
    (numpy's default method); any length (torch.quantile refuses very large inputs)."""
    import torch

    v = torch.sort(values.detach().double().flatten().cpu()).values
    n = v.numel()
    found = []
    for q in qs:
        h = (n - 1) * q
        lo = math.floor(h)
        hi = min(lo + 1, n - 1)
        found.append(float(v[lo] + (h - lo) * (v[hi] - v[lo])))
    return found


@dataclass
class MeanStat:
    """A per-token mean with its 95% interval over windows (None for one window) and the
    per-token standard error."""

    mean: float
    ci95_low: float | None
    ci95_high: float | None
    se_windows: float | None
    se_tokens: float | None

    @classmethod
    def of(cls, values: Any, counts: list[int]) -> MeanStat:
        """`values` (N,) float64: the windows' per-token values back to back, `counts` per window."""
        from infer_tool.evals.intervals import mean_ci95, window_se

        sums = [math.fsum(part.tolist()) for part in values.split(counts)]
        n = sum(counts)
        low, high = mean_ci95(sums, counts) or (None, None)
        se_tok = float(values.std(correction=1)) / math.sqrt(n) if n > 1 else None
        return cls(math.fsum(sums) / n, low, high, window_se(sums, counts), se_tok)


@dataclass
class KldSummary:
    """The per-token KL divergence (nats) summarised (see the module docstring)."""

    mean: MeanStat
    median: float
    p90: float
    p99: float
    p99_9: float
    max: float
    min: float

    @classmethod
    def of(cls, kl: Any, counts: list[int]) -> KldSummary:
        q = dict(zip(QUANTILES, quantiles(kl, list(QUANTILES.values()))))
        return cls(MeanStat.of(kl, counts), **q, max=float(kl.max()), min=float(kl.min()))


@dataclass
class KldResult:
    kld: KldSummary
    same_top_token: MeanStat  # fraction of positions whose argmaxes agree
    ppl: float  # the model's perplexity on the same positions (as `eval ppl`)
    nll: float  # mean NLL per predicted token (nats)
    reference_ppl: float
    reference_nll: float
    tokens: int  # scored positions
    seq_len: int
    stride: int | None
    windows: int
    seconds: float
    tokens_per_second: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class WindowPair:
    """One window as both models see it: logits (S, V) float32 of each, targets (S,)."""

    ref_logits: Any
    logits: Any
    target: Any


def kld_of_windows(
    windows: list[Any],
    pair: Callable[[int], WindowPair],
    *,
    seq_len: int,
    stride: int | None = None,
    progress: Progress | None = None,
) -> KldResult:
    """The KL divergence over `windows` (`ppl.Window`s): `pair(i)` gives window i's logits of
    both models; this process runs its share (`ppl.my_windows`) and the per-token values are
    all-reduced (see the module docstring)."""
    import torch

    from infer_tool.evals.ppl import my_windows, nll_sum

    progress = progress or no_progress
    counts = [w.scored for w in windows]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    N, W = offsets[-1], len(windows)
    # one flat buffer, all-reduced at once: KL (N) | same top (N) | reference NLL (W) | model NLL (W)
    buf = torch.zeros(2 * N + 2 * W, dtype=torch.float64)
    kl, top, ref_nll, nll = buf[:N], buf[N : 2 * N], buf[2 * N : 2 * N + W], buf[2 * N + W :]
    mine, world = my_windows(W)
    t0 = time.perf_counter()
    done, running = 0, 0.0
    for j, i in enumerate(mine):
        w = pair(i)
        a, b = offsets[i], offsets[i + 1]
        kl[a:b] = token_kl(w.ref_logits, w.logits).cpu()
        top[a:b] = same_top(w.ref_logits, w.logits).cpu().double()
        ref_nll[i] = nll_sum(w.ref_logits, w.target)
        nll[i] = nll_sum(w.logits, w.target)
        del w
        done += b - a
        running += float(kl[a:b].sum())
        progress(
            "kl divergence", j + 1, len(mine), tok_s=done / max(time.perf_counter() - t0, 1e-9), kld=running / done
        )
    if world > 1:
        import torch.distributed as dist

        from infer_tool.calib.distributed import collective

        with collective():
            dist.all_reduce(buf)  # each slot is non-zero on exactly one process: exact
    seconds = time.perf_counter() - t0
    nll_mean = math.fsum(nll.tolist()) / N
    ref_mean = math.fsum(ref_nll.tolist()) / N
    return KldResult(
        kld=KldSummary.of(kl, counts),
        same_top_token=MeanStat.of(top, counts),
        ppl=math.exp(nll_mean),
        nll=nll_mean,
        reference_ppl=math.exp(ref_mean),
        reference_nll=ref_mean,
        tokens=N,
        seq_len=seq_len,
        stride=stride,
        windows=W,
        seconds=seconds,
        tokens_per_second=N / max(seconds, 1e-9),
    )


def evaluate_kld(
    model: Any,
    reference: Any,
    ids: Any,
    seq_len: int = 2048,
    *,
    stride: int | None = None,
    max_tokens: int | None = None,
    progress: Progress | None = None,
) -> KldResult:
    """KL(reference ‖ model) on token ids `(T,)` in the windows `evaluate_ppl` uses (same
    `seq_len`, `stride`, `max_tokens`); both models resident, run window by window."""
    from infer_tool.evals.ppl import check_vocab, make_windows, window_logits

    if max_tokens is not None:
        if max_tokens < 1:
            raise BadInput(f"--max-tokens must be >= 1 (got {max_tokens})")
        ids = ids[:max_tokens]
    check_vocab(model, ids)
    check_vocab(reference, ids)
    windows = make_windows(ids.numel(), seq_len, stride)

    def pair(i: int) -> WindowPair:
        ref_logits, target = window_logits(reference, ids, windows[i], "the reference model")
        logits, _ = window_logits(model, ids, windows[i])
        return WindowPair(ref_logits, logits.to(ref_logits.device), target)

    return kld_of_windows(windows, pair, seq_len=seq_len, stride=stride, progress=progress)
