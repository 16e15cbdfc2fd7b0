"""A lower bound on the op time of every plan in a space, to skip a pipeline cap that cannot win.

A pipeline solves its stage mesh once per batch cap (``solver/pipeline.py``) and keeps the cap
whose stages model fastest. The stage times of a sub-mesh plan (``attribute_layer_costs``) add
up each op's roofline time under its layouts plus the reshards into it, weighted by
``edge_exposure``, plus extras (recomputed ops, unfused round trips). So the LP relaxation of
that sum alone, over the space the cap solves, bounds the summed stage times of any plan the
cap can return, and through ``pipeline._bubble_bound`` its pipeline step. Left out, so the bound
stays below what the stages are charged: graph inputs' memory tie-break, a producer's pinned or
reduce-once reductions, aliased round trips and graph outputs, recomputation and the memory
rows (a relaxation may drop constraints). Exact steps only: layers shared as every variant
shares them, dominance pruning (keeps the optimum), chain elimination. Not used with
tensor-parallel overlap, which charges a reshard less than its price.

On Llama-3-70B at 16 x 128K tokens (``pp=4`` x (2, 4, 8)) the second cap's space bounds its op
time at 59.4 s (2 s to find), where the roofline floor gave 48.2 s; 54.6 s cuts the cap (its
plan, solved, was charged 81.0 s).
"""

from __future__ import annotations

import numpy as np

from ..costmodel.exposure import weight_edges
from .costs import Space, op_costs
from .ilp import prepare
from .lp import solve_relaxation
from .problem import Problem


class CapCannotWin(Exception):
    """Raised by ``plan_graph(cutoff=...)`` when the bound shows the space cannot help."""

    def __init__(self, bound: float) -> None:
        super().__init__(f"every plan of this space spends at least {bound:.6g} s in its ops")
        self.bound = bound


def op_time_bound(  # type: ignore[no-untyped-def]
    problem: Problem, space: Space, cluster, time_limit: float, share_layers: bool = True
) -> float:
    """Seconds: no plan of ``space`` (priced as ``problem``) has a smaller sum of op roofline
    times plus exposure-weighted reshards into ops; ``-inf`` when the LP fails or an op repeats
    (a scan body: stage times count one run of it)."""
    from .shrinking import shrink

    graph = space.graph
    if any(op.repeat != 1 for op in graph.ops):
        return -np.inf
    n_in = len(graph.inputs)
    costs = [np.zeros(len(space.strategies[n])) for n in range(n_in)]
    cache = space.tables
    for i, op in enumerate(graph.ops):
        costs.append(np.asarray(op_costs(op, space.strategies[space.op_node(i)], space, cluster,
                                         cache), dtype=float))  # fmt: skip
    bound = Problem(list(problem.names), costs)
    for edge in problem.edges:
        if edge.v >= n_in and edge.u != edge.v:  # reshards into an op
            bound.add_grouped_edge(edge.u, edge.v, edge.u_group, edge.v_group, edge.cost)
    weight_edges(bound, space)
    shrink(bound, space, share_layers, merge_followers=False)  # exact, or what every plan obeys
    prepared = prepare(bound)  # exact: pruning keeps the optimum, elimination is exact
    if prepared.solved_by_elimination:
        found = prepared.reduced.expand([0] * len(bound.node_costs))
        return bound.evaluate(found) * (1 - 1e-9)
    relaxation = solve_relaxation(prepared.reduced, time_limit)
    if relaxation is None:
        return -np.inf
    return (relaxation.bound + prepared.offset) * (1 - 1e-9) - 1e-12  # less GLOP's rounding


__all__ = ["CapCannotWin", "op_time_bound"]
