"""The accept/resample step reproduces the target distribution; warping matches transformers."""

import pytest
import torch

from infer_tool.spec.sampling import residual, verify, warp

# 99.9% quantiles of chi-square (df = 3 and 15), from standard tables.
CHI2_999 = {3: 16.266, 15: 37.697}


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = n * probs
    return float(((counts - expected) ** 2 / expected).sum())


def _rand_probs(g: torch.Generator, v: int) -> torch.Tensor:
    return torch.softmax(2.0 * torch.randn(v, generator=g), -1)


@pytest.mark.parametrize("seed", [0, 1])
def test_one_step_reproduces_p(seed: int) -> None:
    """k = 1, x ~ q: the emitted token follows p (chi-square, 20000 draws, df = 3)."""
    g = torch.Generator().manual_seed(seed)
    V, N = 4, 20000
    p, q = _rand_probs(g, V), _rand_probs(g, V)
    counts = torch.zeros(V)
    P = torch.stack([p, p])  # (k+1, V); the bonus row is never used when rejected first
    for _ in range(N):
        x = torch.multinomial(q, 1, generator=g)
        n, y = verify(P, q[None], x, g)
        counts[x.item() if n == 1 else y] += 1
    assert _chi2(counts, p) < CHI2_999[V - 1]


def test_acceptance_rate_is_sum_min() -> None:
    g = torch.Generator().manual_seed(5)
    V, N = 4, 8000
    p, q = _rand_probs(g, V), _rand_probs(g, V)
    accepted = 0
    for _ in range(N):
        x = torch.multinomial(q, 1, generator=g)
        accepted += verify(torch.stack([p, p]), q[None], x, g)[0]
    assert abs(accepted / N - float(torch.minimum(p, q).sum())) < 5 * 0.0056  # 5 binomial sd


def test_two_step_block_reproduces_p_pairs() -> None:
    """k = 2 with context-free p and q: the first two emitted tokens are i.i.d. p
    (chi-square on the 16 pairs, df = 15). Covers accept-then-reject and the bonus token."""
    g = torch.Generator().manual_seed(2)
    V, N = 4, 20000
    p, q = _rand_probs(g, V), _rand_probs(g, V)
    P, Q = torch.stack([p, p, p]), torch.stack([q, q])
    counts = torch.zeros(V, V)
    for _ in range(N):
        x = torch.multinomial(q, 2, replacement=True, generator=g)
        n, y = verify(P, Q, x, g)
        emitted = x[:n].tolist() + [y]
        if len(emitted) < 2:  # rejected at once: the next round starts afresh from p
            emitted.append(int(torch.multinomial(p, 1, generator=g)))
        counts[emitted[0], emitted[1]] += 1
    assert _chi2(counts.flatten(), torch.outer(p, p).flatten()) < CHI2_999[15]


def test_deterministic_draft_one_hot() -> None:
    """A one-hot q (prompt lookup): accept with probability p(x), else sample p without x."""
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.0, 1.0, 0.0])
    r = residual(p, q)
    assert torch.allclose(r, torch.tensor([0.5 / 0.7, 0.0, 0.2 / 0.7]))
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    for _ in range(5000):
        n, y = verify(torch.stack([p, p]), q[None], torch.tensor([1]), g)
        counts[1 if n == 1 else y] += 1
    assert _chi2(counts, p) < 13.816  # chi-square 99.9%, df = 2


def test_greedy_is_argmax_agreement() -> None:
    logits_p = torch.tensor([[0.1, 2.0, 0.3], [1.0, 0.0, 0.5], [0.0, 0.0, 3.0]])
    logits_q = torch.tensor([[0.0, 1.0, 0.9], [0.0, 2.0, 0.5]])
    p, q = warp(logits_p, 0.0, 1.0), warp(logits_q, 0.0, 1.0)
    assert verify(p, q, torch.tensor([1, 1]), None) == (1, 0)  # agree, then target says 0
    assert verify(p[[0, 2]], q[:1], torch.tensor([1]), None) == (1, 2)  # all accepted: bonus argmax


@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.3, 0.9), (1.0, 0.5)])
def test_warp_matches_transformers(temperature: float, top_p: float) -> None:
    """Independent reference: transformers' temperature and top-p logits warpers."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    logits = 3.0 * torch.randn(8, 50, generator=g)
    ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(None, ref)
    ref = torch.softmax(ref, -1)
    assert torch.allclose(warp(logits, temperature, top_p), ref, atol=1e-6)
