"""Exact elimination of nodes with at most two neighbours (min-sum variable elimination).

A node ``n`` with one neighbour ``m`` costs, for each layout group ``b`` of ``m`` on their edge,
``min_s node[n][s] + E[g(s), b]``: that minimum folds into ``m``'s own costs and ``n`` leaves
the problem. A node with two neighbours ``a`` and ``b`` becomes one edge between them,
``E'[i, j] = min_s E_a[i, g_a(s)] + node[n][s] + E_b[g_b(s), j]``. Both are exact (the reduced
problem has the same optimum, and the eliminated node's best strategy is read back from its
neighbours' choices), unlike follower merging, which fixes a follower's strategy from one
leader before its consumers are seen. Chains of elementwise ops and single-use values are the
common case: the unrolled JAX GPT's exact problem drops from 595 to 272 decisions and its LP
from 112K to 77K pair variables (docs/design.md, "Planning speed").

Only nodes whose memory cannot matter are eliminated (``frozen``: the caller's memory rows
name nodes), and an edge is created only when it is no larger than the two it replaces.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from .problem import Edge, Problem, merge_parallel


@dataclass(frozen=True, slots=True)
class Eliminated:
    """How to read back an eliminated node's strategy: ``best`` indexed by the layout groups
    (on the removed edges) of the neighbours' chosen strategies."""

    node: int
    neighbours: tuple[tuple[int, np.ndarray], ...]
    """(neighbour, its strategy -> group on the removed edge), zero to two of them."""
    best: np.ndarray

    def pick(self, choice: list[int]) -> int:
        index = tuple(int(group[choice[m]]) for m, group in self.neighbours)
        return int(self.best[index]) if index else int(self.best)


def eliminate_chains(problem: Problem, frozen: frozenset[int] = frozenset()) -> float:
    """Eliminate every live node of degree <= 2 not in ``frozen``, repeatedly, in place
    (records go to ``problem.chains``; ``problem.expand`` reads them back). Returns the cost
    of the isolated nodes removed (the reduced objective plus it is the original one)."""
    offset = 0.0
    queue = [n for n in problem.live_nodes() if n not in frozen and _degree(problem, n) <= 2]
    heapq.heapify(queue)  # lowest node first: deterministic
    while queue:
        n = heapq.heappop(queue)
        if n in frozen or not problem.alive[n] or _degree(problem, n) > 2:
            continue
        for m in sorted(_neighbours(problem, n)):
            merge_parallel(problem, n, m)
        keys = sorted(problem.adjacency.get(n, ()))
        if len(keys) == 0:
            offset += _isolated(problem, n)
        elif len(keys) == 1:
            heapq.heappush(queue, _leaf(problem, n, keys[0]))
        elif (pair := _chain(problem, n, keys)) is not None:
            for m in pair:
                heapq.heappush(queue, m)
    return offset


def _degree(problem: Problem, n: int) -> int:
    return len(problem.adjacency.get(n, ()))


def _neighbours(problem: Problem, n: int) -> set[int]:
    return {_oriented(problem.edge_table[k], n)[1] for k in problem.adjacency.get(n, ())}


def _oriented(e: Edge, n: int) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
    """(n's groups, the other node, its groups, cost with n's groups as rows)."""
    if e.u == n:
        return e.u_group, e.v, e.v_group, e.cost
    return e.v_group, e.u, e.u_group, e.cost.T


def _isolated(problem: Problem, n: int) -> float:
    costs = problem.node_costs[n]
    best = int(np.argmin(costs))  # ties: the lowest index
    problem.alive[n] = False
    problem.chains.append(Eliminated(n, (), np.asarray(best)))
    return float(costs[best])


def _leaf(problem: Problem, n: int, key: int) -> int:
    """Fold a node with one neighbour into it; returns the neighbour."""
    group, m, m_group, cost = _oriented(problem.edge_table[key], n)
    total = problem.node_costs[n][:, None] + cost[group, :]  # [strategy of n, group of m]
    best = np.argmin(total, axis=0)
    problem._remove(key)
    problem.node_costs[m] = problem.node_costs[m] + total[best, np.arange(len(best))][m_group]
    problem.alive[n] = False
    problem.chains.append(Eliminated(n, ((m, m_group),), best))
    return m


def _chain(problem: Problem, n: int, keys: list[int]) -> tuple[int, int] | None:
    """Replace a node between two neighbours by one edge between them (when not larger)."""
    group_a, a, a_group, cost_a = _oriented(problem.edge_table[keys[0]], n)
    group_b, b, b_group, cost_b = _oriented(problem.edge_table[keys[1]], n)
    if cost_a.shape[1] * cost_b.shape[1] > cost_a.size + cost_b.size:
        return None  # the new edge would have more pair variables than the two it replaces
    with np.errstate(invalid="ignore"):
        total = (
            cost_a.T[:, group_a][:, :, None]  # [group of a, strategy of n, .]
            + problem.node_costs[n][None, :, None]
            + cost_b[group_b, :][None, :, :]  # [., strategy of n, group of b]
        )
    best = np.argmin(total, axis=1)
    reduced = np.take_along_axis(total, best[:, None, :], axis=1)[:, 0, :]
    problem._remove(keys[0])
    problem._remove(keys[1])
    problem.alive[n] = False
    problem.chains.append(Eliminated(n, ((a, a_group), (b, b_group)), best))
    problem.add_grouped_edge(a, b, a_group, b_group, reduced)
    merge_parallel(problem, a, b)
    return a, b
