"""AWQ's fast ratio search (coarse to fine over the grid) against the full grid.

The reference is the full grid itself: every ratio evaluated, the first smallest loss kept
when it beats plain RTN. The fast search must choose the same ratio wherever the loss over
the grid is unimodal (checked on every unimodal shape of a 20-point grid's minimum and on
random curves), fall back to the full grid where the points it sees are not unimodal, and,
on the tiny model of every architecture in the table, pick the same ratios and so write the
same weights bit for bit.
"""

from __future__ import annotations

import random

import pytest
import torch

from infer_tool.calib.architectures import ARCHITECTURES
from infer_tool.common.errors import BadInput
from infer_tool.packers.awq import awq_search_scale, choose, search_grid, unimodal
from infer_tool.packers.scheme import AWQScheme, make_scheme


@pytest.fixture(autouse=True, scope="module")
def one_thread():  # noqa: ANN201
    """Tiny tensors: a thread pool's barriers cost more than they save on shared cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def run(curve: list[float], search: str, step: int = 4) -> tuple[int | None, set[int], bool]:
    """(chosen index with RTN at +inf, indices evaluated, fell back) of `search` on `curve`."""
    seen: dict[int, float] = {}

    def loss_at(i: int) -> float:
        seen[i] = curve[i]
        return curve[i]

    fell_back = search_grid(loss_at, len(curve), search, step)
    return choose([seen.get(i) for i in range(len(curve))], float("inf")), set(seen), fell_back


def unimodal_curve(n: int, k: int, rng: random.Random) -> list[float]:
    """Strictly decreasing to index k, strictly increasing after, random steps."""
    curve = [0.0] * n
    curve[k] = rng.uniform(0.5, 1.0)
    for i in range(k - 1, -1, -1):
        curve[i] = curve[i + 1] + rng.uniform(1e-6, 1.0)
    for i in range(k + 1, n):
        curve[i] = curve[i - 1] + rng.uniform(1e-6, 1.0)
    return curve


@pytest.mark.parametrize("n,step", [(20, 4), (20, 5), (20, 3), (10, 4), (7, 2), (3, 2)])
def test_fast_search_finds_the_minimum_of_every_unimodal_curve(n: int, step: int) -> None:
    """Every position of the minimum, 30 random shapes each: the fast search picks the full
    grid's index without falling back, in at most 12 of 20 evaluations at step 4."""
    rng = random.Random(n * 100 + step)
    most = 0
    for k in range(n):
        for _ in range(30):
            curve = unimodal_curve(n, k, rng)
            full, evaluated_full, _ = run(curve, "full", step)
            fast, evaluated, fell_back = run(curve, "fast", step)
            assert evaluated_full == set(range(n))
            assert fast == full == k and not fell_back, (curve, sorted(evaluated))
            most = max(most, len(evaluated))
    if (n, step) == (20, 4):
        assert most <= 12


def test_not_unimodal_coarse_points_fall_back_to_the_full_grid() -> None:
    """Two valleys the coarse points see: every point is evaluated and the global minimum kept."""
    curve = [5, 4, 3, 2, 1.5, 2, 3, 4, 5, 4, 3, 2, 1.0, 2, 3, 4, 5, 6, 7, 8]
    fast, evaluated, fell_back = run(curve, "fast")
    assert fell_back and evaluated == set(range(20)) and fast == 12


def test_ties_fall_back_to_the_full_grid() -> None:
    """A flat bottom: the choice would depend on the points looked at, so the full grid decides (first of equals)."""
    curve = [9, 8, 7, 6, 5, 4, 3, 2, 1, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    fast, evaluated, fell_back = run(curve, "fast")
    full, _, _ = run(curve, "full")
    assert fell_back and evaluated == set(range(20)) and fast == full == 8


def test_a_dip_between_coarse_points_is_the_known_limit() -> None:
    """What the fast search cannot see: a dip at an index no coarse or bracket point falls
    on, while every point seen is unimodal. It then keeps the bracket's minimum; the full
    grid finds the dip. (Measured on the demo model and the tiny architectures instead.)"""
    curve = [float(abs(i - 12)) + 1 for i in range(20)]
    curve[2] = 0.5
    fast, evaluated, fell_back = run(curve, "fast")
    assert 2 not in evaluated and not fell_back and fast == 12
    assert run(curve, "full")[0] == 2


def test_unimodal() -> None:
    assert unimodal([3, 2, 1]) and unimodal([1, 2, 3]) and unimodal([2, 1, 2]) and unimodal([1])
    assert not unimodal([1, 2, 1]) and not unimodal([2, 1, 1, 2]) and not unimodal([2, 1, 2, 1, 2])


def test_scheme_refuses_unknown_search() -> None:
    assert AWQScheme().search == "full"
    assert make_scheme("awq", search="full").search == "full"
    with pytest.raises(BadInput, match="fast, full"):
        make_scheme("awq", search="golden")
    with pytest.raises(BadInput, match="search_step"):
        make_scheme("awq", search_step=1)


def _block_problem(seed: int):
    """A norm feeding two balanced linears on correlated inputs with salient channels."""
    gen = torch.Generator().manual_seed(seed)
    K = 128
    x = torch.randn(512, K, generator=gen) @ (torch.eye(K) + 0.3 * torch.randn(K, K, generator=gen))
    x[:, ::16] *= 10  # salient input channels, what AWQ protects
    weights = [torch.randn(64, K, generator=gen), torch.randn(32, K, generator=gen)]

    def block(ws: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([torch.relu(x @ w.T) for w in ws], dim=-1)

    return x.abs().mean(0), weights, block, block(weights)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("symmetric", [True, False])
def test_fast_and_full_choose_the_same_scales(seed: int, symmetric: bool) -> None:
    """On a real block search: the same ratio and bit-identical scales, at most the full
    grid's evaluations; the losses the fast search evaluated are the full grid's, bit for
    bit; the full grid's report of the fast choice is what the fast run chose."""
    x_mean, weights, block, ref = _block_problem(seed)
    full = awq_search_scale(x_mean, weights, block, ref, AWQScheme(group_size=32, symmetric=symmetric, search="full"))
    fast = awq_search_scale(x_mean, weights, block, ref, AWQScheme(group_size=32, symmetric=symmetric, search="fast"))
    assert fast.ratio == full.ratio and torch.equal(fast.scales, full.scales)
    assert full.evaluated == 20 and fast.evaluated == (20 if fast.fell_back else fast.evaluated) <= 20
    assert fast.fell_back or unimodal([v for v in fast.losses if v is not None])
    assert all(v is None or v == full.losses[i] for i, v in enumerate(fast.losses))
    assert full.fast_ratio == fast.ratio and full.fast_loss == fast.best_loss
    assert full.summary()["fast_loss_excess"] == 0.0 and fast.summary()["fell_back"] is fast.fell_back


TINY_TYPES = [t for t, a in ARCHITECTURES.items() if t != "gpt2" and a.moe is None]  # gpt2: Conv1D, no INT4 format; MoE: tests/test_moe*.py


@pytest.mark.parametrize("model_type", TINY_TYPES)
def test_tiny_architectures_fast_equals_full(model_type: str) -> None:
    """The pipeline tests' tiny model of each architecture: the fast search writes the same
    weights bit for bit (their losses over alpha are rarely unimodal: it mostly falls back),
    each report entry says which search ran, and the full grid's entries name the ratio the
    fast search would choose on the same losses."""
    from test_pipeline import ids, tiny_model

    from infer_tool.calib.pipeline import quantize_model
    from infer_tool.calib.quantizers.awq import QUANTIZER

    runs = {}
    for search in ("full", "fast"):
        scheme = make_scheme("awq", group_size=32, search=search)
        runs[search] = (quantize_model(tiny_model(model_type), ids(), scheme, batch_size=4, device="cpu"), scheme)
    (full, full_scheme), (fast, fast_scheme) = runs["full"], runs["fast"]
    assert full.quantized.keys() == fast.quantized.keys()
    for name, qw in full.quantized.items():
        assert torch.equal(qw.dequantize(torch.float32), fast.quantized[name].dequantize(torch.float32)), name
    a = [e for e in full.method_report["awq"] if "losses" in e]
    b = [e for e in fast.method_report["awq"] if "losses" in e]
    assert a and len(a) == len(b)
    for x, y in zip(a, b):
        assert x["search"] == "full" and y["search"] == "fast" and x["ratio"] == y["ratio"] == x["fast_ratio"]
        assert x["evaluated"] == 20 and y["evaluated"] <= 20 and x["fast_loss_excess"] == 0.0
    assert "would choose the same ratio on" in QUANTIZER.notes(full, full_scheme)[0]
    assert "grid evaluations" in QUANTIZER.notes(fast, fast_scheme)[0]
