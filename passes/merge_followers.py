"""Follower merging (Alpa's "follow"): cheap single-input ops take their producer's layout.

An op whose only non-scalar operand comes from one node, and which does little work
(elementwise, reshape, transpose, convert...), gets no decision of its own: for each strategy of
its producer it takes the cheapest matching strategy. Chains collapse into their head, which
shrinks the solver's problem several-fold on real graphs at a small, measured loss of optimality
(disable with ``merge_followers=False``).
"""

from __future__ import annotations

from ..ir import Graph, op_info

CHEAP_FLOP_MODELS = ("none", "elementwise")


def follower_pairs(graph: Graph, producer_node: dict, num_inputs: int) -> list[tuple[int, int]]:
    """(follower node, leader node) pairs, deepest first (the order elimination needs)."""
    pairs = []
    for i, op in enumerate(graph.ops):
        info = op_info(op.kind)
        if info is None or info.flops not in CHEAP_FLOP_MODELS:
            continue
        big = [v for v in op.operands if v.type.numel > 1]
        if len(big) != 1 or len(op.results) != 1:
            continue
        leader, _ = producer_node[big[0]]
        pairs.append((num_inputs + i, leader))
    return list(reversed(pairs))
