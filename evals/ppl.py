"""Token-level perplexity over fixed windows of a tokenized corpus.

Protocol (the one behind the GPTQ and AWQ papers' WikiText-2 tables): tokenize the
corpus once with no special tokens, keep the first `max_tokens`, cut it into
non-overlapping windows of `seq_len` tokens (a trailing partial window is dropped), run
each window on its own, and sum the next-token NLL over every predicted position
(`seq_len - 1` per window); ppl = exp(total NLL / predicted tokens). With `stride`, the
windows start every `stride` tokens (sliding-window evaluation, as in the transformers
perplexity guide) and each token is scored once, with up to `seq_len - 1` tokens of
context. lm-evaluation-harness reports *word* perplexity (NLL per word), a different,
larger number.

Under `accelerate launch` (or torchrun) the windows are dealt round-robin to the
processes; each process returns its per-window NLL sums in float64 and every process
gathers all of them and adds them in window order, so the result is bit-identical to a
single-process run.

What this module does not know: how the model was loaded or quantized.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

from infer_tool.common.errors import BadInput
from infer_tool.common.progress import Progress, no_progress

PROTOCOL = (
    "token-level perplexity: corpus tokenized once without special tokens, first "
    "max_tokens kept, non-overlapping seq_len windows (trailing partial window dropped; "
    "with stride: sliding windows, each token scored once), NLL summed over every predicted "
    "position, ppl = exp(sum NLL / predicted tokens)"
)


@dataclass(frozen=True)
class Window:
    """Tokens `[begin, end)` of the corpus; the last `scored` of them are predicted."""

    begin: int
    end: int
    scored: int


@dataclass
class PplResult:
    ppl: float
    nll: float  # mean NLL per predicted token (nats)
    nll_sum: float
    tokens: int  # predicted tokens
    seq_len: int
    stride: int | None
    windows: int
    seconds: float
    tokens_per_second: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_windows(n_tokens: int, seq_len: int, stride: int | None = None) -> list[Window]:
    """The evaluation windows over `n_tokens` tokens (see the module docstring)."""
    if seq_len < 2:
        raise BadInput(f"--seq-len must be >= 2 (got {seq_len})")
    if n_tokens < seq_len:
        raise BadInput(
            f"the text has {n_tokens} tokens, shorter than one {seq_len}-token window: "
            "use a longer corpus or a smaller --seq-len"
        )
    if stride is None:
        return [Window(b, b + seq_len, seq_len - 1) for b in range(0, n_tokens - seq_len + 1, seq_len)]
    if not 1 <= stride <= seq_len:
        raise BadInput(f"--stride must be between 1 and --seq-len ({seq_len}) (got {stride})")
    windows, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + seq_len, n_tokens)
        scored = end - prev_end if prev_end else end - begin - 1
        if scored > 0 and end - begin >= 2:
            windows.append(Window(begin, end, min(scored, end - begin - 1)))
        prev_end = end
        if end == n_tokens:
            break
    return windows


def finish_distributed() -> None:
    """Leave the process group cleanly (`calib/distributed.finish`)."""
    from infer_tool.calib.distributed import finish

    finish()


def window_logits(model: Any, ids: Any, window: Window, who: str = "the model") -> tuple[Any, Any]:
    """(logits (scored, V) float32, targets (scored,)): the model's next-token logits at the
    positions that predict the window's last `scored` tokens, and those tokens. BadInput
    naming `who` and the window when a logit is NaN or infinite (a score of them would be
    meaningless)."""
    import torch

    device = next(model.parameters()).device
    x = ids[window.begin : window.end].unsqueeze(0).to(device)  # (1, L)
    with torch.inference_mode():
        logits = model(input_ids=x, use_cache=False).logits[0]  # (L, V)
    logits = logits[-window.scored - 1 : -1].float()
    finite = torch.isfinite(logits.sum(dim=1))  # (scored,): NaN and inf reach a row's sum, no (S, V) mask made
    if not bool(finite.all()):
        finite = torch.isfinite(logits).all(dim=1)  # a sum can also overflow from finite logits
    if not bool(finite.all()):
        first = int((~finite).nonzero()[0, 0])
        raise BadInput(
            f"{who} gives NaN or infinite logits in the window of tokens {window.begin}..{window.end} (first where "
            f"it predicts token {window.end - window.scored + first}): its weights or activations overflow, so no "
            "perplexity or KL divergence can be scored"
        )
    return logits, x[0, -window.scored :]


def nll_sum(logits: Any, target: Any) -> float:
    """Sum of next-token NLL (float64) of `target` (S,) under `logits` (S, V) float32."""
    import torch.nn.functional as F

    return F.cross_entropy(logits, target, reduction="sum").double().item()


def window_nll(model: Any, ids: Any, window: Window) -> float:
    """Sum of next-token NLL (float64) over the window's last `scored` positions."""
    return nll_sum(*window_logits(model, ids, window))


def my_windows(count: int) -> tuple[list[int], int]:
    """(the indices of the `count` windows this process evaluates, the number of processes):
    the windows are dealt round-robin under a distributed launch (all of them in one process)."""
    from infer_tool.calib.distributed import world as dist_world

    rank, world = dist_world()
    return list(range(rank, count, world)), world


def check_vocab(model: Any, ids: Any) -> None:
    """Refuse token ids the model's embedding cannot take (tokenizer/model mismatch)."""
    n_vocab = model.get_input_embeddings().weight.shape[0]
    top = int(ids.max()) if ids.numel() else -1
    if top >= n_vocab:
        raise BadInput(
            f"tokenizer produced token id {top} but the model's vocabulary has {n_vocab} "
            "entries: tokenizer and model do not match"
        )


def evaluate_ppl(
    model: Any,
    ids: Any,
    seq_len: int = 2048,
    *,
    stride: int | None = None,
    max_tokens: int | None = None,
    progress: Progress | None = None,
) -> PplResult:
    """Perplexity of `model` on token ids `(T,)`; see the module docstring."""
    import torch

    progress = progress or no_progress
    if max_tokens is not None:
        if max_tokens < 1:
            raise BadInput(f"--max-tokens must be >= 1 (got {max_tokens})")
        ids = ids[:max_tokens]
    check_vocab(model, ids)
    windows = make_windows(ids.numel(), seq_len, stride)
    mine, world = my_windows(len(windows))
    nll = torch.zeros(len(windows), dtype=torch.float64)
    t0 = time.perf_counter()
    done_tokens, running = 0, 0.0
    for j, i in enumerate(mine):
        nll[i] = window_nll(model, ids, windows[i])
        done_tokens += windows[i].scored
        running += nll[i].item()
        elapsed = time.perf_counter() - t0
        progress(
            "perplexity",
            j + 1,
            len(mine),
            tok_s=done_tokens / max(elapsed, 1e-9),
            ppl=math.exp(running / done_tokens),
        )
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(nll)  # each window is non-zero on exactly one rank: exact
    return ppl_of_nll(nll.tolist(), windows, seq_len, stride, time.perf_counter() - t0)


def ppl_of_nll(nll: list[float], windows: list[Window], seq_len: int, stride: int | None, seconds: float) -> PplResult:
    """The `PplResult` of per-window NLL sums (float64, in window order)."""
    n_tokens = sum(w.scored for w in windows)
    nll_sum = math.fsum(nll)
    return PplResult(
        ppl=math.exp(nll_sum / n_tokens),
        nll=nll_sum / n_tokens,
        nll_sum=nll_sum,
        tokens=n_tokens,
        seq_len=seq_len,
        stride=stride,
        windows=len(windows),
        seconds=seconds,
        tokens_per_second=n_tokens / max(seconds, 1e-9),
    )
