"""Which part of a training step each op belongs to (forward, backward, update), and its layer
block, found from the graph's structure alone (frontends tag no phases)."""

from __future__ import annotations

import re

from shardplan.ir.graph import Graph, Op
from shardplan.ir.phases import Phase
from shardplan.ir.phases import op_phases as phases_in_order


def op_phases(graph: Graph) -> dict[Op, Phase]:
    """``ir.phases.op_phases`` keyed by op: forward / backward / update, from structure alone."""
    return dict(zip(graph.ops, phases_in_order(graph), strict=True))


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
