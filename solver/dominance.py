"""Drop choices that another choice of the same node beats in every context (exact).

Choice ``s`` of node ``n`` is dominated by ``t`` when switching ``s`` to ``t`` can never cost
more, whatever the neighbours choose::

    cost[t] - cost[s] + sum over edges e at n of max_j (C_e[t, j] - C_e[s, j]) <= 0

and ``t`` uses no more memory than ``s`` in every memory term (persistent bytes, activation
terms, recomputation seconds). Then some optimal solution avoids ``s``, so forbidding it keeps the
optimum. A dominated strategy gets an infinite cost and its layout groups leave the edges, which
shrinks the LP's and CP-SAT's pair variables (docs/design.md, "Meshes of three and four axes").
"""

from __future__ import annotations

import numpy as np

from .problem import Edge, Problem, _compact

PASSES = 2
"""Pruning a node tightens its neighbours' maxima (fewer columns): a second pass finds more."""


def prune_dominated(  # type: ignore[no-untyped-def]
    problem: Problem,
    memory=None,
    keep: dict[int, int] | None = None,
    usage: dict[int, np.ndarray] | None = None,
) -> int:
    """Forbid dominated strategies in place; returns how many were forbidden. ``keep``: node ->
    a strategy never forbidden (a warm start's, so the hint stays a feasible point).
    ``usage``: ``memory_vectors(problem, memory)`` when the caller has it (problems that differ
    only in node costs share it: the seed's restricted copies)."""
    usage = memory_vectors(problem, memory) if usage is None else usage
    keep = keep or {}
    total = 0
    visit = [n for n in problem.live_nodes() if len(problem.node_costs[n]) > 1]
    worst: dict = {}  # alike edges (one cost matrix, same live columns) share their maxima
    for _ in range(PASSES):
        pruned, changed = 0, set()
        for n in visit:
            count = _prune_node(problem, n, usage.get(n), keep.get(n), worst)
            if count:
                pruned += count
                changed.update(_neighbours(problem, n))
        total += pruned
        if not pruned:
            break
        # Only a node next to a pruned one can lose more: with its edges' live columns
        # unchanged, dominance being transitive, it would find what its last visit found.
        visit = [n for n in visit if n in changed]
    if total:
        _drop_forbidden_groups(problem)
    return total


def _neighbours(problem: Problem, n: int) -> list[int]:
    edges = (problem.edge_table[key] for key in problem.adjacency.get(n, ()))
    return [e.v if e.u == n else e.u for e in edges]


def _prune_node(
    problem: Problem, n: int, usage: np.ndarray | None, keep: int | None, cache: dict
) -> int:
    cost = problem.node_costs[n]
    allowed = np.isfinite(cost)
    if np.count_nonzero(allowed) < 2:  # nothing to dominate (a forbidden one dominates nothing)
        return 0  # ResNet-50: 452 of its 3068 visits
    finite = np.where(allowed, cost, 0.0)
    delta = finite[:, None] - finite[None, :]  # delta[t, s]: the node's own change from s to t
    delta[~allowed, :] = np.inf  # a forbidden strategy dominates nothing
    delta[:, ~allowed] = np.inf  # and is already out
    with np.errstate(invalid="ignore"):  # inf + -inf: a forbidden pair, stays undecided
        for key in problem.adjacency.get(n, ()):
            e = problem.edge_table[key]
            mine, other = (e.u_group, e.v_group) if e.u == n else (e.v_group, e.u_group)
            rows = e.cost if e.u == n else e.cost.T
            live_cols = np.zeros(rows.shape[1], dtype=bool)
            other_node = e.v if e.u == n else e.u
            live_cols[other[np.isfinite(problem.node_costs[other_node])]] = True
            if not live_cols.any():
                continue
            key = (id(e.cost), e.u == n, live_cols.tobytes())
            worst = cache.get(key)
            if worst is None:
                worst = cache[key] = _worst(rows[:, live_cols])
            delta += worst.take(mine, axis=0).take(mine, axis=1)  # worst[ix_(mine, mine)]
    better = delta <= 0
    if usage is not None:
        better &= np.all(usage[:, :, None] <= usage[:, None, :], axis=0)
    np.fill_diagonal(better, False)
    index = np.arange(len(cost))
    strict = better & ~better.T  # t strictly better than s, or ties kept at the lower index
    ties = better & better.T & (index[:, None] < index[None, :])
    dominated = np.any(strict | ties, axis=0) & allowed
    if keep is not None:
        dominated[keep] = False  # kept: what it dominates is still dominated (by it)
    if not np.any(dominated):
        return 0
    problem.node_costs[n] = np.where(dominated, np.inf, cost)
    return int(dominated.sum())


def _worst(rows: np.ndarray) -> np.ndarray:
    """``worst[t, s] = max_j (rows[t, j] - rows[s, j])``; inf - inf counts as -inf."""
    if np.isfinite(rows).all():  # the common case: no inf - inf to mask
        return (rows[:, None, :] - rows[None, :, :]).max(axis=2)
    with np.errstate(invalid="ignore"):
        diff = rows[:, None, :] - rows[None, :, :]  # [gt, gs, j]
    diff = np.where(np.isnan(diff), -np.inf, diff)
    return diff.max(axis=2)


def _drop_forbidden_groups(problem: Problem) -> None:
    """Edges keep only the layout groups some allowed strategy selects (forbidden strategies
    point at group 0: their variables are fixed to 0, so what they select is never read)."""
    for key, e in list(problem.edge_table.items()):
        u_ok = np.isfinite(problem.node_costs[e.u])
        v_ok = np.isfinite(problem.node_costs[e.v])
        if not (u_ok.any() and v_ok.any()):
            continue
        u_group = np.where(u_ok, e.u_group, e.u_group[u_ok][0])
        v_group = np.where(v_ok, e.v_group, e.v_group[v_ok][0])
        problem.edge_table[key] = _compact(Edge(e.u, e.v, u_group, v_group, e.cost))


def memory_vectors(problem: Problem, memory) -> dict[int, np.ndarray]:  # type: ignore[no-untyped-def]
    """Per live node, every per-strategy memory (or recomputation) vector that lands on it
    (depends on the problem's eliminations and memory rows, not on its costs)."""
    from .memory_rows import _resolution

    resolve = _resolution(problem)
    vectors: dict[int, list[np.ndarray]] = {}

    def add(node: int, values: np.ndarray) -> None:
        leader, mapping = resolve.get(node, (node, None))
        vec = np.asarray(values if mapping is None else values[mapping], dtype=float)
        vectors.setdefault(leader, []).append(vec)

    if problem.memory is not None:
        for n in problem.live_nodes():
            add(n, problem.memory[n])
    if memory is not None:
        for t in memory.terms:
            add(t.node, t.nbytes)
        for ops in memory.recompute_ops.values():
            for node, vec in ops:
                add(node, vec)
    out = {}
    for n, vecs in vectors.items():
        stacked = np.stack(vecs)
        varying = np.any(stacked != stacked[:, :1], axis=1)  # constant rows never decide
        out[n] = stacked[varying]
    return out
