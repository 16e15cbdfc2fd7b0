"""Exact elimination of degree <= 2 nodes keeps the optimum (brute force on random problems)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from shardplan.ir.errors import InfeasiblePlanError
from shardplan.solver import ilp
from shardplan.solver.brute_force import brute_force
from shardplan.solver.eliminate import eliminate_chains
from shardplan.solver.ilp import solve
from shardplan.solver.problem import Problem


def random_problem(seed: int, memory: bool = False) -> Problem:
    """A K4 core (no node of degree <= 2: what elimination cannot remove), a chain across it, a
    pendant chain and a leaf; some impossible pairs. The first feasible draw from ``seed``."""
    for attempt in range(100):
        problem = _draw(seed * 100 + attempt, memory)
        if math.isfinite(brute_force(problem.copy())[1] if _feasible(problem) else math.inf):
            return problem
    raise AssertionError("no feasible random problem")


def _feasible(problem: Problem) -> bool:
    try:
        brute_force(problem.copy())
    except InfeasiblePlanError:
        return False
    return True


def _draw(seed: int, memory: bool) -> Problem:
    rng = np.random.default_rng(seed)
    nodes = 8
    sizes = [int(rng.integers(2, 4)) for _ in range(nodes)]
    costs = [rng.uniform(0, 1, size=k) for k in sizes]
    mem = [rng.integers(0, 4, size=k).astype(float) if memory else np.zeros(k) for k in sizes]
    problem = Problem([f"n{i}" for i in range(nodes)], costs, memory=mem)
    pairs = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]  # K4
    pairs += [(0, 4), (4, 5), (5, 2), (3, 6), (6, 7)]  # a chain across it, a pendant chain
    for u, v in pairs:
        ku, kv = sizes[u], sizes[v]
        groups_u = rng.integers(0, ku, size=ku)  # some strategies may share a layout
        groups_v = rng.integers(0, kv, size=kv)
        cost = rng.uniform(0, 1, size=(int(groups_u.max()) + 1, int(groups_v.max()) + 1))
        if rng.uniform() < 0.3 and cost.shape[1] > 1:
            cost[0, -1] = math.inf  # an impossible reshard
        problem.add_grouped_edge(u, v, groups_u, groups_v, cost)
    return problem


@pytest.mark.parametrize("seed", range(10))
def test_reduced_problem_has_the_same_optimum(seed: int) -> None:
    problem = random_problem(seed)
    _, best = brute_force(problem.copy())
    reduced = problem.copy()
    offset = eliminate_chains(reduced)
    assert 0 < len(reduced.live_nodes()) < len(problem.live_nodes())  # a real reduction
    choice, reduced_best = brute_force(reduced)
    assert reduced_best + offset == pytest.approx(best, rel=1e-9)
    assert problem.evaluate(choice) == pytest.approx(best, rel=1e-9)  # read back exactly


@pytest.mark.parametrize("seed", range(10))
def test_solve_with_elimination_equals_brute_force(seed: int) -> None:
    problem = random_problem(100 + seed)
    _, best = brute_force(problem.copy())
    solution = solve(problem.copy(), time_limit=10)
    assert solution.status == "OPTIMAL"
    assert solution.objective == pytest.approx(best, rel=1e-9)
    assert problem.evaluate(solution.choice) == pytest.approx(best, rel=1e-9)
    assert solution.bound == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_memory_row_nodes_are_kept(seed: int) -> None:
    """Nodes the persistent-memory row names are not eliminated, and the limit holds."""
    problem = random_problem(200 + seed, memory=True)
    assert problem.memory is not None
    sizes = [len(c) for c in problem.node_costs]
    points = [list(c) for c in itertools.product(*(range(k) for k in sizes))]
    finite = [c for c in points if math.isfinite(problem.evaluate(c))]
    problem.memory_limit = float(np.median([problem.memory_of(c) for c in finite]))
    feasible = [problem.evaluate(c) for c in finite if problem.memory_of(c) <= problem.memory_limit]
    solution = solve(problem.copy(), time_limit=10)
    assert problem.memory_of(solution.choice) <= problem.memory_limit
    assert solution.objective == pytest.approx(min(feasible), rel=1e-9)


def test_elimination_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    problem = random_problem(7)
    with_it = solve(problem.copy(), time_limit=10)
    monkeypatch.setattr(ilp, "ELIMINATE", False)
    without = solve(problem.copy(), time_limit=10)
    assert with_it.objective == pytest.approx(without.objective, rel=1e-9)
