"""The planner's linear stand-in for the step simulation: the share of each edge's collective
that lengthens the step (prefetched parameters and overlapped gradient reductions hide most of
theirs), applied to a solver problem's edges."""

from __future__ import annotations

from shardplan.ir.graph import Graph, Op, Role, Value

from .per_graph import PerGraph
from .phases import Phase, op_phases

GRADIENT_EXPOSURE = 0.2
"""Fraction of a gradient reduction (backward -> update edge) the step still waits for: it runs
under the rest of backward; what stays exposed is the last layers' share (DDP's last bucket)."""


PREFETCH_EXPOSURE = 0.2
"""Fraction of a parameter / optimizer-state collective that stays exposed: with a one-layer
prefetch it hides behind the previous layer's compute except for the first layer."""


def edge_exposure(value: Value, consumer: Op | None, graph: Graph) -> float:
    """Fraction in [0, 1] of the reshard cost on ``value -> consumer`` that lengthens the step.

    The planner's linear stand-in for ``simulate`` (``solver/costs.py`` multiplies edge costs
    by it): collectives on parameters and optimizer states are prefetchable
    (``PREFETCH_EXPOSURE``), gradient reductions feeding the update overlap backward
    (``GRADIENT_EXPOSURE``), an updated parameter's way back to its stored layout
    (``consumer=None``) overlaps the next step's start like a prefetch, and everything else -
    tensor-parallel collectives between forward or backward ops - is on the critical path
    (1.0). It cannot see saturation (more communication than compute to hide it behind);
    ``simulate`` reports that afterwards.
    """
    if value.producer is None:
        return PREFETCH_EXPOSURE if value.role in (Role.PARAMETER, Role.OPTIMIZER_STATE) else 1.0
    if consumer is None:
        return PREFETCH_EXPOSURE
    phases = _PHASES(graph)
    producer, user = phases.get(value.producer), phases.get(consumer)
    if user is Phase.UPDATE and producer is Phase.BACKWARD:
        return GRADIENT_EXPOSURE
    return 1.0


def weight_edges(problem, space) -> None:
    """Multiply each edge of a solver ``Problem`` by ``edge_exposure`` (before elimination).

    Duck-typed over ``solver.costs.Space`` / ``solver.problem.Problem`` so the cost model does
    not import the solver: an edge ``u -> v`` joins the node of the producer of a value (a graph
    input or an op) to the node of its consumer (an op, or for an alias round trip the input
    it replaces). A multi-result producer takes the largest exposure of its results.
    """
    graph = space.graph
    n_in = len(graph.inputs)
    weighted: dict = {}  # alike edges share one matrix, and so one weighted matrix (pruning
    # caches its maxima per matrix object: per-edge copies made it re-derive them per edge)
    for edge in problem.edges:
        consumer = graph.ops[edge.v - n_in] if edge.v >= n_in else None
        if edge.u < n_in:
            values = [graph.inputs[edge.u]]
        else:
            values = list(graph.ops[edge.u - n_in].results)
        factor = max(edge_exposure(v, consumer, graph) for v in values)
        key = (id(edge.cost), factor)
        if key not in weighted:
            weighted[key] = (edge.cost, edge.cost * factor)  # the original kept: ids stay unique
        edge.cost = weighted[key][1]


_PHASES: PerGraph[dict[Op, Phase]] = PerGraph(op_phases)
"""Each op's phase, found once per graph (the planner weights every edge with it)."""
