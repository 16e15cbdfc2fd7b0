"""LP relaxation of the layout problem over the local marginal polytope (GLOP).

Pair variables p[a][b] per edge with row sums equal to the producer's layout-group indicator and
column sums equal to the consumer's. On layout problems this relaxation is very often integral
(autoparallel reports the same for its ILP); when it is, the LP optimum *is* the integer optimum,
proven, and CP-SAT is not needed. When it is fractional, its value is a lower bound and its
rounding a warm start for CP-SAT.

The model is built as one sparse matrix (numpy + ``scipy.sparse``) and handed to GLOP whole:
building it variable by variable through ``pywraplp`` took as long as solving it (measured on
the unrolled JAX GPT: 118K variables, docs/design.md "Planning speed").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from ortools.linear_solver.python import model_builder_helper as mbh
from scipy import sparse

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
    scale = _scale(problem)  # GLOP's tolerances are absolute: bring costs to order 1e3
    live = problem.live_nodes()
    if not live:
        return Relaxation([0] * len(problem.node_costs), True, 0.0, [])
    lp = _Builder(problem, live, scale)
    for e in problem.edges:
        cost = e.cost * scale
        if np.all(np.isfinite(cost)):  # move what is separable to the endpoints' own costs
            row_min = cost.min(axis=1, keepdims=True)
            col_min = (cost - row_min).min(axis=0, keepdims=True)
            lp.coef[e.u] = lp.coef[e.u] + row_min.reshape(-1)[e.u_group]
            lp.coef[e.v] = lp.coef[e.v] + col_min.reshape(-1)[e.v_group]
            cost = cost - row_min - col_min
            if not np.any(cost > 0):
                continue
        lp.pair_block(e.u, e.u_group, e.v, e.v_group, cost)
    values = lp.solve(time_limit)
    if values is None:
        return None
    x, objective = values
    choice = [0] * len(problem.node_costs)
    fractional = []
    for n in live:
        weights = x[lp.offset[n] : lp.offset[n] + len(problem.node_costs[n])]
        choice[n] = int(np.argmax(weights))
        if not np.all((weights < INTEGRALITY_TOLERANCE) | (weights > 1 - INTEGRALITY_TOLERANCE)):
            fractional.append(n)
    return Relaxation(choice, not fractional, objective / scale, fractional)


class _Builder:
    """Columns (node strategies, then pair blocks) and equality rows as coordinate lists."""

    def __init__(self, problem: Problem, live: list[int], scale: float) -> None:
        self.problem = problem
        self.offset: dict[int, int] = {}
        self.coef: dict[int, np.ndarray] = {}
        self.columns = 0
        for n in live:
            costs = problem.node_costs[n]
            self.offset[n] = self.columns
            self.columns += len(costs)
            self.coef[n] = np.where(np.isfinite(costs), costs, np.inf) * scale
        self.pair_costs: list[np.ndarray] = []
        self.rows, self.cols, self.vals = [], [], []  # type: ignore[var-annotated]
        self.count = len(live)  # one exactly-one row per node first
        for r, n in enumerate(live):
            size = len(problem.node_costs[n])
            self._entries(np.full(size, r), self.offset[n] + np.arange(size), 1.0)

    def _entries(self, rows: np.ndarray, cols: np.ndarray, value: float) -> None:
        self.rows.append(rows)
        self.cols.append(cols)
        self.vals.append(np.full(len(rows), value))

    def pair_block(self, u: int, u_group, v: int, v_group, cost: np.ndarray) -> None:
        """Pair variables p[a][b]: rows sum to u's group indicator, columns to v's."""
        rows, cols = cost.shape
        pairs = (self.columns + np.arange(rows * cols)).reshape(rows, cols)
        self.columns += rows * cols
        self.pair_costs.append(cost.reshape(-1))
        first = self.count  # rows: sum_b p[a][b] - sum_{s in a} x_u[s] = 0
        self._entries(np.repeat(first + np.arange(rows), cols), pairs.reshape(-1), 1.0)
        self._entries(first + u_group, self.offset[u] + np.arange(len(u_group)), -1.0)
        first += rows  # columns: sum_a p[a][b] - sum_{s in b} x_v[s] = 0
        self._entries(first + np.tile(np.arange(cols), rows), pairs.reshape(-1), 1.0)
        self._entries(first + v_group, self.offset[v] + np.arange(len(v_group)), -1.0)
        self.count = first + cols

    def solve(self, time_limit: float) -> tuple[np.ndarray, float] | None:
        cost = np.concatenate([*self.coef.values(), *self.pair_costs])
        upper = np.where(np.isfinite(cost), 1.0, 0.0)  # an impossible choice is fixed to 0
        cost = np.where(np.isfinite(cost), cost, 0.0)
        lower_rows = np.zeros(self.count)
        lower_rows[: len(self.offset)] = 1.0  # the exactly-one rows; the rest are = 0
        upper_rows = lower_rows.copy()
        if (limit := self._memory_row()) is not None:
            lower_rows, upper_rows = np.append(lower_rows, -np.inf), np.append(upper_rows, limit)
        matrix = sparse.csr_matrix(
            (np.concatenate(self.vals), (np.concatenate(self.rows), np.concatenate(self.cols))),
            shape=(self.count, self.columns),
        )
        model = mbh.ModelBuilderHelper()
        model.fill_model_from_sparse_data(
            np.zeros(self.columns), upper, cost, lower_rows, upper_rows, matrix
        )
        solver = mbh.ModelSolverHelper("glop")
        solver.set_solver_specific_parameters(GLOP_PARAMETERS)
        solver.set_time_limit_in_seconds(max(0.001, time_limit))
        solver.solve(model)
        if solver.status() != mbh.SolveStatus.OPTIMAL:
            return None
        return solver.variable_values(), solver.objective_value()

    def _memory_row(self) -> float | None:
        """One row: the persistent bytes of the chosen strategies fit the limit (returned)."""
        problem = self.problem
        if problem.memory is None or problem.memory_limit is None:
            return None
        row = self.count
        self.count += 1
        for n, start in self.offset.items():
            mem = np.asarray(problem.memory[n], dtype=float)
            nonzero = np.nonzero(mem)[0]
            if len(nonzero):
                self.rows.append(np.full(len(nonzero), row))
                self.cols.append(start + nonzero)
                self.vals.append(mem[nonzero])
        return float(problem.memory_limit)


def _scale(problem: Problem) -> float:
    peak = problem.cost_peak()
    return 1e3 / peak if peak > 0 else 1.0
