"""Follower merging (Alpa's "follow"): cheap single-input ops take their producer's layout.

An op whose only non-scalar operand comes from one node, and which does little work
(elementwise, reshape, transpose, convert...), gets no decision of its own: for each strategy of
its producer it takes the cheapest matching strategy. Chains collapse into their head, which
shrinks the solver's problem several-fold on real graphs at a small, measured loss of optimality
(disable with ``merge_followers=False``).

Some cheap ops are not followers (``DECIDING_KINDS``): their strategy decides where a pending
sum is resolved, and what that choice costs falls on their consumers, which the follow cannot
see (it prices the edge from the leader only).
"""

from __future__ import annotations

from ..ir import Graph, op_info

CHEAP_FLOP_MODELS = ("none", "elementwise")

DECIDING_KINDS = frozenset({"batch_norm_stat"})
"""Cheap ops that keep a decision of their own. ``batch_norm_stat`` turns a batch norm's
per-channel sum, partial over the axes splitting the batch, into the mean or inverse deviation.
Followed, it takes the reduce-scatter (a channel split of a few hundred bytes: a few bytes less
than the all-reduce, the same latency), and then every reader that needs the whole statistic
(the normalisation, the next sum, the backward) pays an all-gather: ResNet-50 on 64 H100s ran
four latency-bound collectives per batch norm's forward instead of two and exposed 1.5 ms more
(``tests/frontend/torch/test_conv_plan.py``). Left to the solver's exact elimination, the sum
is all-reduced once, as ``SyncBatchNorm`` does."""


def follower_pairs(graph: Graph, producer_node: dict, num_inputs: int) -> list[tuple[int, int]]:
    """(follower node, leader node) pairs, deepest first (the order elimination needs)."""
    pairs = []
    for i, op in enumerate(graph.ops):
        info = op_info(op.kind)
        if info is None or info.flops not in CHEAP_FLOP_MODELS or op.kind in DECIDING_KINDS:
            continue
        big = [v for v in op.operands if v.type.numel > 1]
        if len(big) != 1 or len(op.results) != 1:
            continue
        leader, _ = producer_node[big[0]]
        pairs.append((num_inputs + i, leader))
    return list(reversed(pairs))
