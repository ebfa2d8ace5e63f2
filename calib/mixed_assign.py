"""The assignment of a mixed-precision plan: one candidate per linear group minimising the
summed predicted cost under a byte budget (a multiple-choice knapsack), solved by dynamic
programming over the budget in units of `unit` bytes.

Inputs: for group i and candidate j, `sizes[i][j]` (stored bytes, int) and `costs[i][j]`
(predicted cost, float; None where the candidate cannot take the group).

Exactness. With sizes rounded *up* to whole units, every plan the table returns fits its
budget B in true bytes, and its cost is at most the exact optimum under B − G·unit (G groups:
rounding adds less than one unit per group). With sizes rounded *down*, the same table gives
a lower bound on the exact optimum under B. `Plan.lower_bound` carries it, so each plan
states its own gap; with `unit=1` the table is exact. One table serves every budget: it
holds the best cost for each budget up to the largest asked for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from infer_tool.common.errors import BadInput


@dataclass(frozen=True)
class Plan:
    """choice[i]: the candidate index of group i; size: true bytes; cost: summed predicted
    cost; lower_bound: a cost no plan within the same budget can beat."""

    choice: tuple[int, ...]
    size: int
    cost: float
    lower_bound: float


class Knapsack:
    """The DP tables for groups of (sizes, costs) up to `max_bytes`, `unit` bytes a step."""

    def __init__(
        self,
        sizes: Sequence[Sequence[int]],
        costs: Sequence[Sequence[float | None]],
        max_bytes: int,
        unit: int = 1,
    ) -> None:
        if len(sizes) != len(costs) or any(len(s) != len(c) for s, c in zip(sizes, costs)):
            raise ValueError("sizes and costs must have one entry per group and candidate")
        if unit < 1:
            raise ValueError(f"unit={unit}: expected a positive number of bytes")
        self.sizes, self.costs, self.unit = sizes, costs, unit
        self.steps = max(0, max_bytes // unit)
        self.up_best, self.up_choice = self._table(math.ceil)
        self.down_best, _ = self._table(math.floor)

    def _table(self, rounding: object) -> tuple[np.ndarray, list[np.ndarray]]:
        S = self.steps
        best = np.zeros(S + 1)  # best[b]: least cost of the groups so far within b units
        choices = []
        for sizes, costs in zip(self.sizes, self.costs):
            new = np.full(S + 1, np.inf)
            pick = np.full(S + 1, -1, dtype=np.int16)
            for j, (size, cost) in enumerate(zip(sizes, costs)):
                if cost is None:
                    continue
                w = int(rounding(size / self.unit))  # type: ignore[operator]
                if w > S:
                    continue
                cand = np.full(S + 1, np.inf)
                cand[w:] = best[: S + 1 - w] + cost
                better = cand < new
                new[better], pick[better] = cand[better], j
            best = new
            choices.append(pick)
        return best, choices

    def _plan(self, b: int) -> Plan:
        choice = []
        for i in reversed(range(len(self.sizes))):
            j = int(self.up_choice[i][b])
            choice.append(j)
            b -= int(math.ceil(self.sizes[i][j] / self.unit))
        choice.reverse()
        size = sum(self.sizes[i][j] for i, j in enumerate(choice))
        cost = math.fsum(self.costs[i][j] for i, j in enumerate(choice))  # type: ignore[misc]
        return Plan(tuple(choice), size, cost, 0.0)

    def within_bytes(self, budget: int) -> Plan | None:
        """The least-cost plan of at most `budget` bytes (None when nothing fits)."""
        b = min(budget // self.unit, self.steps)
        if b < 0 or not np.isfinite(self.up_best[b]):
            return None
        plan = self._plan(b)
        lower = float(self.down_best[b]) if np.isfinite(self.down_best[b]) else plan.cost
        return Plan(plan.choice, plan.size, plan.cost, min(lower, plan.cost))

    def within_cost(self, limit: float) -> Plan | None:
        """The smallest plan (in units) whose predicted cost is at most `limit` (None when no
        plan within the table's bytes gets there); lower_bound is then a size in bytes: no plan
        of predicted cost <= limit is smaller."""
        ok = np.nonzero(self.up_best <= limit)[0]
        if ok.size == 0:
            return None
        plan = self._plan(int(ok[0]))
        low = np.nonzero(self.down_best <= limit)[0]
        return Plan(plan.choice, plan.size, plan.cost, float(int(low[0]) * self.unit) if low.size else 0.0)


def budget_bytes(target_bits: float, weights: int) -> int:
    """The byte budget of `target_bits` average bits over `weights` weights (rounded down)."""
    if not math.isfinite(target_bits) or target_bits <= 0:
        raise BadInput(f"--target-bits {target_bits}: expected a positive number of bits per weight, e.g. 4.5")
    return int(target_bits * weights // 8)
