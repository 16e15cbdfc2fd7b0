"""Which part of a training step each op belongs to (forward, backward, update), from the
graph's structure alone (frontends tag no phases); ``passes.liveness`` and
``costmodel.phases`` both read it."""

from __future__ import annotations

import enum

from .graph import Graph, Op, Role, Value
from .op_cost import VIEW_KINDS


class Phase(enum.Enum):
    """Which part of a training step an op belongs to (inferred from the graph's structure)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    UPDATE = "update"


def op_phases(graph: Graph) -> list[Phase]:
    """Per op, in graph order: forward / backward / update.

    Forward ops reach a non-aliased output (the loss). Of the rest, backward ops are those that
    (or whose descendants) read a forward value - a saved activation or a data input; update
    ops read only gradients, parameters and optimizer states. A layout-only view of a forward
    value taken in backward (``x^T`` of a saved activation, read by a weight-gradient matmul
    ``x^T @ g``) is itself a forward value. A graph with no aliased outputs (inference) is all
    forward.
    """
    aliased = set(graph.output_aliases)
    if not aliased:
        return [Phase.FORWARD] * len(graph.ops)
    forward = _ancestors([v for j, v in enumerate(graph.outputs) if j not in aliased])
    forward_values = {r for op in forward for r in op.results}
    forward_values |= {
        v for v in graph.inputs if v.role in (Role.INPUT, Role.CONSTANT, Role.KV_CACHE)
    }
    for op in graph.ops:  # backward-time views of forward values (in order: chains propagate)
        if op not in forward and op.kind in VIEW_KINDS and op.operands[0] in forward_values:
            forward_values.update(op.results)
    reads: dict[Op, bool] = {}
    for op in reversed(graph.ops):
        reads[op] = any(v in forward_values for v in op.operands) or any(
            reads.get(u.op, False) for r in op.results for u in r.uses
        )
    return [
        Phase.FORWARD if op in forward else Phase.BACKWARD if reads[op] else Phase.UPDATE
        for op in graph.ops
    ]


def _ancestors(values: list[Value]) -> set[Op]:
    seen: set[Op] = set()
    stack = [v.producer for v in values if v.producer is not None]
    while stack:
        op = stack.pop()
        if op not in seen:
            seen.add(op)
            stack.extend(v.producer for v in op.operands if v.producer is not None)
    return seen


__all__ = ["Phase", "op_phases"]
