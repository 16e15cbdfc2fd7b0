"""The rows of the layout problem's CP-SAT model: edge costs linked through pair variables (the
local marginal polytope, or XLA's implication rows), the persistent-memory row, the memory
model's hook, warm-start hints, the integer cost scale and the objective read back."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .problem import Edge, Problem

if TYPE_CHECKING:
    from ortools.sat.python import cp_model


def _add_hints(model, x: dict, hints: dict[int, int]) -> None:
    """Every strategy variable of a hinted node (the edges hint theirs): a complete point."""
    for n, s in hints.items():
        if n in x and len(x[n]) > 1:
            for k, var in enumerate(x[n]):
                model.AddHint(var, int(k == s))


def _add_memory_model(model, problem: Problem, x: dict, terms: list, scale: float, memory) -> None:
    """Memory hook: peak rows plus recomputation variables and their cost."""
    if memory is not None:
        memory.add_to_cpsat(model, problem, x, terms, scale)


def _objective(problem: Problem, choice: list[int], memory, solver) -> float:
    """Modelled seconds of a solution; the memory hook reads recomputation and adds its cost."""
    objective = problem.evaluate(choice)
    if memory is not None:
        memory.read(solver)
        objective += memory.recompute_cost(problem.expand(choice))
    return objective


def _scale(problem: Problem) -> float:
    """Integer scaling so the largest coefficient is about 1e9 (precision ~1e-9 relative)."""
    peak = problem.cost_peak()
    return 1e9 / peak if peak > 0 else 1.0


def _group_sums(vars_: list, group: np.ndarray, ngroups: int) -> list:
    sums: list[list] = [[] for _ in range(ngroups)]
    for s, g in enumerate(group):
        sums[g].append(vars_[s])
    return sums


def _add_edge(
    model: cp_model.CpModel, e: Edge, x: dict, terms: list, scale: float, hints: dict
) -> float:
    """Add one edge's cost; returns the constant part (in seconds). Pair variables get hints
    when both ends have one: CP-SAT then starts from a complete feasible point instead of
    repairing a partial one (which on the 1-layer JAX GPT never got back to the hint's cost)."""
    cost = e.cost.copy()
    constant = 0.0
    rows, cols = cost.shape
    y = _group_sums(x[e.u], e.u_group, rows)
    z = _group_sums(x[e.v], e.v_group, cols)
    forbidden = ~np.isfinite(cost)
    for a, b in zip(*np.nonzero(forbidden), strict=True):  # impossible reshard: never both
        model.Add(sum(y[a]) + sum(z[b]) <= 1)
    cost[forbidden] = 0.0
    row_min = cost.min(axis=1)
    cost -= row_min[:, None]
    col_min = cost.min(axis=0)
    cost -= col_min[None, :]
    for groups, mins in ((y, row_min), (z, col_min)):
        for members, m in zip(groups, mins, strict=True):
            if m <= 0:
                continue
            for var in members:
                if isinstance(var, int):
                    constant += m
                else:
                    terms.append((var, round(m * scale)))
    if not np.any(cost > 0):
        return constant
    hinted = None
    if e.u in hints and e.v in hints:
        hinted = (int(e.u_group[hints[e.u]]), int(e.v_group[hints[e.v]]))
    if MARGINAL:
        _marginal_link(model, e, cost, y, z, terms, scale, hinted)
        return constant
    return constant + _implication_link(model, e, cost, y, z, terms, scale, hinted)


def _implication_link(model, e: Edge, cost, y, z, terms, scale, hinted) -> float:  # type: ignore[no-untyped-def]
    """XLA's linking: one ``e >= Y_a + Z_b - 1`` Boolean per positive entry."""
    constant = 0.0
    for a, b in zip(*np.nonzero(cost > 0), strict=True):
        if all(isinstance(v, int) for v in y[a] + z[b]):
            constant += float(cost[a, b])
            continue
        link = model.NewBoolVar(f"e{e.u}_{e.v}_{a}_{b}")
        model.Add(link >= sum(y[a]) + sum(z[b]) - 1)
        terms.append((link, round(float(cost[a, b]) * scale)))
        if hinted is not None:
            model.AddHint(link, int((a, b) == hinted))
    return constant


MARGINAL = True


def _marginal_link(
    model,
    e: Edge,
    cost: np.ndarray,
    y: list,
    z: list,
    terms: list,
    scale: float,
    hinted: tuple[int, int] | None = None,
) -> None:
    """Pair variables whose row sums equal the producer's group and column sums the consumer's.

    This is the local marginal polytope (Alpa's linking): its LP relaxation is far tighter than
    one ``e >= Y + Z - 1`` row per pair, which lets CP-SAT's LP prune instead of branching.
    """
    rows, cols = cost.shape
    pair = [[model.NewBoolVar(f"e{e.u}_{e.v}_{a}_{b}") for b in range(cols)] for a in range(rows)]
    for a in range(rows):
        model.Add(sum(pair[a]) == sum(y[a]))
    for b in range(cols):
        model.Add(sum(pair[a][b] for a in range(rows)) == sum(z[b]))
    for a, b in zip(*np.nonzero(cost > 0), strict=True):
        terms.append((pair[a][b], round(float(cost[a, b]) * scale)))
    if hinted is not None:
        for a in range(rows):
            for b in range(cols):
                model.AddHint(pair[a][b], int((a, b) == hinted))


def _add_memory(model: cp_model.CpModel, problem: Problem, x: dict) -> None:
    if problem.memory is None or problem.memory_limit is None:
        return
    expr = []
    fixed = 0
    for n in problem.live_nodes():
        mem = problem.memory[n]
        if len(x[n]) == 1:
            fixed += int(mem[0])
        else:
            expr += [int(m) * var for var, m in zip(x[n], mem, strict=True) if m]
    model.Add(sum(expr) <= int(problem.memory_limit) - fixed)
