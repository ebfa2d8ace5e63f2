"""The mixed-precision assignment (calib/mixed_assign.py) against brute force over every
assignment of small random instances."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from infer_tool.calib.mixed_assign import Knapsack, budget_bytes
from infer_tool.common.errors import BadInput


def instance(rng: random.Random, groups: int, options: int) -> tuple[list[list[int]], list[list[float | None]]]:
    sizes = [[rng.randint(10, 400) for _ in range(options)] for _ in range(groups)]
    costs: list[list[float | None]] = [[rng.random() for _ in range(options)] for _ in range(groups)]
    costs[0][rng.randrange(options)] = None  # a candidate that cannot take a group
    return sizes, costs


def brute(sizes: list[list[int]], costs: list[list[float | None]], budget: int) -> float:
    best = math.inf
    for choice in itertools.product(*(range(len(s)) for s in sizes)):
        if any(costs[i][j] is None for i, j in enumerate(choice)):
            continue
        if sum(sizes[i][j] for i, j in enumerate(choice)) <= budget:
            best = min(best, sum(costs[i][j] for i, j in enumerate(choice)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_unit_one_is_brute_force_and_coarser_units_keep_their_stated_gap(seed: int) -> None:
    rng = random.Random(seed)
    sizes, costs = instance(rng, groups=5, options=3)
    top = sum(max(s) for s in sizes)
    exact = Knapsack(sizes, costs, top, unit=1)
    coarse = Knapsack(sizes, costs, top, unit=37)
    G = len(sizes)
    for budget in range(0, top + 1, 53):
        opt = brute(sizes, costs, budget)
        plan = exact.within_bytes(budget)
        if math.isinf(opt):
            assert plan is None
            continue
        assert plan is not None and plan.size <= budget
        assert plan.cost == pytest.approx(opt, abs=1e-12) and plan.lower_bound == pytest.approx(opt, abs=1e-12)
        near = coarse.within_bytes(budget)
        if near is None:  # rounding up may leave nothing: then even B - G*unit has no plan
            assert math.isinf(brute(sizes, costs, budget - G * 37))
            continue
        assert near.size <= budget  # feasible in true bytes
        assert near.lower_bound <= opt + 1e-12 <= near.cost + 2e-12  # the bound brackets the optimum
        assert near.cost <= brute(sizes, costs, budget - G * 37) + 1e-12  # at least as good as OPT(B - G·unit)


@pytest.mark.parametrize("seed", range(4))
def test_smallest_plan_under_a_cost_limit_is_brute_forces(seed: int) -> None:
    rng = random.Random(100 + seed)
    sizes, costs = instance(rng, groups=4, options=3)
    top = sum(max(s) for s in sizes)
    table = Knapsack(sizes, costs, top, unit=1)
    plans = [
        (sum(sizes[i][j] for i, j in enumerate(c)), sum(costs[i][j] for i, j in enumerate(c)))
        for c in itertools.product(range(3), repeat=4)
        if all(costs[i][j] is not None for i, j in enumerate(c))
    ]
    for limit in (0.5, 1.0, 1.5, 2.5):
        fits = [size for size, cost in plans if cost <= limit]
        plan = table.within_cost(limit)
        if not fits:
            assert plan is None
            continue
        assert plan is not None and plan.cost <= limit
        assert plan.size == min(fits) and plan.lower_bound == min(fits)


def test_budget_refuses_a_non_positive_target() -> None:
    assert budget_bytes(4.5, 1000) == 562
    with pytest.raises(BadInput, match="--target-bits -1"):
        budget_bytes(-1, 1000)
