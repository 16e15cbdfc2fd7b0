"""Exhaustive search over every strategy combination: the ground truth for small problems."""

from __future__ import annotations

import itertools
import math

from ..ir.errors import ArgumentError, InfeasiblePlanError
from .problem import Problem


def brute_force(problem: Problem, max_combinations: int = 2_000_000) -> tuple[list[int], float]:
    """The cheapest feasible assignment of the live nodes (followers expanded)."""
    live = problem.live_nodes()
    count = math.prod(len(problem.node_costs[n]) for n in live)
    if count > max_combinations:
        raise ArgumentError(f"{count} combinations exceed the brute-force limit {max_combinations}")
    best, best_cost = None, math.inf
    choice = [0] * len(problem.node_costs)
    for combo in itertools.product(*(range(len(problem.node_costs[n])) for n in live)):
        for n, s in zip(live, combo, strict=True):
            choice[n] = s
        if problem.memory_limit is not None and problem.memory_of(choice) > problem.memory_limit:
            continue
        cost = problem.evaluate(choice)
        if cost < best_cost - 1e-15:
            best, best_cost = list(choice), cost
    if best is None:
        raise InfeasiblePlanError("no feasible assignment")
    return problem.expand(best), best_cost
