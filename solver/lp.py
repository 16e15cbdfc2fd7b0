"""LP relaxation of the layout problem over the local marginal polytope (GLOP).

Pair variables p[a][b] per edge with row sums equal to the producer's layout-group indicator and
column sums equal to the consumer's. On layout problems this relaxation is very often integral
(autoparallel reports the same for its ILP); when it is, the LP optimum *is* the integer optimum,
proven, and CP-SAT is not needed. When it is fractional, its value is a lower bound and its
rounding a warm start for CP-SAT.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from ortools.linear_solver import pywraplp

from .problem import Problem

INTEGRALITY_TOLERANCE = 1e-6


@dataclass(frozen=True, slots=True)
class Relaxation:
    choice: list[int]
    """Per node, the strategy with the largest LP weight."""
    integral: bool
    bound: float
    """LP optimum in seconds: a lower bound on the integer optimum."""


def solve_relaxation(problem: Problem) -> Relaxation | None:
    """Solve the LP; None if GLOP fails (the caller then relies on CP-SAT alone)."""
    lp = pywraplp.Solver.CreateSolver("GLOP")
    if lp is None:
        return None
    objective = lp.Objective()
    scale = _scale(problem)  # GLOP's tolerances are absolute: bring costs to order 1e3
    x = {n: _node_vars(lp, objective, problem.node_costs[n] * scale) for n in problem.live_nodes()}
    for e in problem.edges:
        rows, cols = e.cost.shape
        y = [[x[e.u][s] for s in np.nonzero(e.u_group == a)[0]] for a in range(rows)]
        z = [[x[e.v][s] for s in np.nonzero(e.v_group == b)[0]] for b in range(cols)]
        pair = [[lp.NumVar(0.0, 1.0, "") for _ in range(cols)] for _ in range(rows)]
        for a in range(rows):
            lp.Add(sum(pair[a]) == sum(y[a]))
        for b in range(cols):
            lp.Add(sum(pair[a][b] for a in range(rows)) == sum(z[b]))
        for a in range(rows):
            for b in range(cols):
                _set_cost(objective, pair[a][b], e.cost[a, b] * scale)
    if problem.memory is not None and problem.memory_limit is not None:
        memory = [
            float(m) * v for n in x for v, m in zip(x[n], problem.memory[n], strict=True) if m
        ]
        if memory:
            lp.Add(sum(memory) <= float(problem.memory_limit))
    objective.SetMinimization()
    if lp.Solve() != pywraplp.Solver.OPTIMAL:
        return None
    choice = [0] * len(problem.node_costs)
    integral = True
    for n, vars_ in x.items():
        values = np.array([v.solution_value() for v in vars_])
        choice[n] = int(np.argmax(values))
        integral &= bool(
            np.all((values < INTEGRALITY_TOLERANCE) | (values > 1 - INTEGRALITY_TOLERANCE))
        )
    return Relaxation(choice, integral, objective.Value() / scale)


def _scale(problem: Problem) -> float:
    finite = [c[np.isfinite(c)] for c in problem.node_costs]
    finite += [e.cost[np.isfinite(e.cost)] for e in problem.edges]
    peak = max([float(np.max(np.abs(c))) for c in finite if c.size] + [0.0])
    return 1e3 / peak if peak > 0 else 1.0


def _node_vars(lp: pywraplp.Solver, objective, costs: np.ndarray) -> list:
    vars_ = [lp.NumVar(0.0, 1.0, "") for _ in costs]
    lp.Add(sum(vars_) == 1)
    for var, cost in zip(vars_, costs, strict=True):
        _set_cost(objective, var, cost)
    return vars_


def _set_cost(objective, var, cost: float) -> None:
    if np.isfinite(cost):
        if cost:
            objective.SetCoefficient(var, float(cost))
    else:
        var.SetUb(0.0)  # an impossible choice
