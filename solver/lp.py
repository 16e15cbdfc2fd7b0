"""LP relaxation of the layout problem over the local marginal polytope (GLOP).

Pair variables p[a][b] per edge with row sums equal to the producer's layout-group indicator and
column sums equal to the consumer's. On layout problems this relaxation is very often integral
(autoparallel reports the same for its ILP); when it is, the LP optimum *is* the integer optimum,
proven, and CP-SAT is not needed. When it is fractional, its value is a lower bound and its
rounding a warm start for CP-SAT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from ortools.linear_solver import pywraplp

from .problem import Problem

INTEGRALITY_TOLERANCE = 1e-6
GLOP_PARAMETERS = "use_dual_simplex: true"


@dataclass(frozen=True, slots=True)
class Relaxation:
    choice: list[int]
    """Per node, the strategy with the largest LP weight."""
    integral: bool
    bound: float
    """LP optimum in seconds: a lower bound on the integer optimum."""
    fractional: list[int]
    """The nodes whose strategy weights are not all 0 or 1."""


def solve_relaxation(problem: Problem, time_limit: float = 30.0) -> Relaxation | None:
    """Solve the LP; None if GLOP fails or runs out of time (then CP-SAT alone decides)."""
    lp = pywraplp.Solver.CreateSolver("GLOP")
    if lp is None:
        return None
    lp.SetTimeLimit(max(1, int(time_limit * 1000)))
    # Dual simplex: 1.4 s instead of 7.5 s on the scanned JAX GPT's LP (55K pair variables),
    # the same optimum (docs/design.md, "Meshes of three and four axes").
    lp.SetSolverSpecificParametersAsString(GLOP_PARAMETERS)
    scale = _scale(problem)  # GLOP's tolerances are absolute: bring costs to order 1e3
    live = problem.live_nodes()
    coef = {n: np.where(np.isfinite(c := problem.node_costs[n]), c, np.inf) * scale for n in live}
    x = {n: _node_vars(lp, len(problem.node_costs[n])) for n in live}
    objective = lp.Objective()
    for e in problem.edges:
        cost = e.cost * scale
        if np.all(np.isfinite(cost)):  # move what is separable to the endpoints' own costs
            row_min = cost.min(axis=1, keepdims=True)
            col_min = (cost - row_min).min(axis=0, keepdims=True)
            coef[e.u] = coef[e.u] + row_min.reshape(-1)[e.u_group]
            coef[e.v] = coef[e.v] + col_min.reshape(-1)[e.v_group]
            cost = cost - row_min - col_min
            if not np.any(cost > 0):
                continue
        _pair_block(lp, objective, x[e.u], e.u_group, x[e.v], e.v_group, cost)
    for n in live:
        for var, c in zip(x[n], coef[n].tolist(), strict=True):
            _set_cost(objective, var, c)
    _memory_row(lp, problem, x)
    objective.SetMinimization()
    if lp.Solve() != pywraplp.Solver.OPTIMAL:
        return None
    choice = [0] * len(problem.node_costs)
    fractional = []
    for n, vars_ in x.items():
        values = np.array([v.solution_value() for v in vars_])
        choice[n] = int(np.argmax(values))
        if not np.all((values < INTEGRALITY_TOLERANCE) | (values > 1 - INTEGRALITY_TOLERANCE)):
            fractional.append(n)
    return Relaxation(choice, not fractional, objective.Value() / scale, fractional)


def _pair_block(lp, objective, xu: list, u_group, xv: list, v_group, cost: np.ndarray) -> None:
    """Pair variables p[a][b]: rows sum to u's group indicator, columns to v's."""
    rows, cols = cost.shape
    pair = [[lp.NumVar(0.0, 1.0, "") for _ in range(cols)] for _ in range(rows)]
    for a, members in enumerate(_members(xu, u_group, rows)):
        row = lp.Constraint(0.0, 0.0)
        for var in pair[a]:
            row.SetCoefficient(var, 1.0)
        for var in members:
            row.SetCoefficient(var, -1.0)
    for b, members in enumerate(_members(xv, v_group, cols)):
        col = lp.Constraint(0.0, 0.0)
        for a in range(rows):
            col.SetCoefficient(pair[a][b], 1.0)
        for var in members:
            col.SetCoefficient(var, -1.0)
    for a, line in enumerate(cost.tolist()):
        for b, c in enumerate(line):
            _set_cost(objective, pair[a][b], c)


def _members(variables: list, group, count: int) -> list[list]:
    """Per group, the strategy variables that select it."""
    members: list[list] = [[] for _ in range(count)]
    for s, g in enumerate(group.tolist()):
        members[g].append(variables[s])
    return members


def _memory_row(lp, problem: Problem, x: dict) -> None:
    if problem.memory is None or problem.memory_limit is None:
        return
    row = lp.Constraint(-lp.infinity(), float(problem.memory_limit))
    for n, vars_ in x.items():
        for var, m in zip(vars_, problem.memory[n], strict=True):
            if m:
                row.SetCoefficient(var, float(m))


def _node_vars(lp: pywraplp.Solver, count: int) -> list:
    vars_ = [lp.NumVar(0.0, 1.0, "") for _ in range(count)]
    one = lp.Constraint(1.0, 1.0)
    for var in vars_:
        one.SetCoefficient(var, 1.0)
    return vars_


def _set_cost(objective, var, cost: float) -> None:
    if math.isfinite(cost):
        if cost:
            objective.SetCoefficient(var, cost)
    else:
        var.SetUb(0.0)  # an impossible choice


def _scale(problem: Problem) -> float:
    peak = problem.cost_peak()
    return 1e3 / peak if peak > 0 else 1.0
