"""Which part of a training step each op belongs to (forward, backward, update), and its layer
block, found from the graph's structure alone (frontends tag no phases)."""

from __future__ import annotations

import enum
import re

from shardplan.ir import VIEW_KINDS
from shardplan.ir.graph import Graph, Op, Role, Value


class Phase(enum.Enum):
    """Which part of a training step an op belongs to (inferred from the graph's structure)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    UPDATE = "update"


def op_phases(graph: Graph) -> dict[Op, Phase]:
    """Forward / backward / update, from structure alone (frontends tag no phases).

    Forward ops reach a non-aliased output (the loss). Of the rest, backward ops are those that
    (or whose descendants) read a forward value - a saved activation or a data input; update
    ops read only gradients, parameters and optimizer states. A layout-only view of a forward
    value taken in backward (``x^T`` of a saved activation, read by a weight-gradient matmul
    ``x^T @ g``) is itself a forward value. A graph with no aliased outputs (inference) is all
    forward. Same logic as ``passes.liveness.op_phases`` (the two layers are peers and do not
    import each other).
    """
    aliased = set(graph.output_aliases)
    loss = {v for j, v in enumerate(graph.outputs) if j not in aliased}
    if not aliased:
        return dict.fromkeys(graph.ops, Phase.FORWARD)
    forward = _ancestors(graph, loss)
    forward_values = {r for op in forward for r in op.results}
    forward_values |= {
        v for v in graph.inputs if v.role in (Role.INPUT, Role.CONSTANT, Role.KV_CACHE)
    }
    for op in graph.ops:  # backward-time views of forward values (in order: chains propagate)
        if op not in forward and op.kind in VIEW_KINDS and op.operands[0] in forward_values:
            forward_values.update(op.results)
    reads_forward: dict[Op, bool] = {}
    phases: dict[Op, Phase] = {}
    for op in reversed(graph.ops):
        reads = any(v in forward_values for v in op.operands) or any(
            reads_forward.get(user, False) for r in op.results for user in r.users
        )
        reads_forward[op] = reads
        if op in forward:
            phases[op] = Phase.FORWARD
        else:
            phases[op] = Phase.BACKWARD if reads else Phase.UPDATE
    return {op: phases[op] for op in graph.ops}


def _ancestors(graph: Graph, values: set[Value]) -> set[Op]:
    seen: set[Op] = set()
    stack = [v.producer for v in values if v.producer is not None]
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        stack.extend(v.producer for v in op.operands if v.producer is not None)
    return seen


_LAYER = re.compile(r"(?:^|[./])(\d+)(?=$|[./])")


def layer_blocks(graph: Graph) -> list[int]:
    """Per op, the index of its block: a maximal run of ops in one numbered layer.

    The layer is the first integer component of the op's module path (``model.layers.3.mlp`` ->
    3); forward visits layers 0..L-1 and backward L-1..0, so each visit is its own block.
    """
    blocks, last, current = [], None, -1
    for op in graph.ops:
        match = _LAYER.search(op.origin.module)
        key = match.group(1) if match else None
        if key is not None and key != last:
            current, last = current + 1, key
        blocks.append(max(current, 0))
    return blocks
