"""Shrink a priced problem: tie loop carries, share repeated layers, merge followers."""

from __future__ import annotations

import numpy as np

from ..passes.merge_followers import follower_pairs
from ..passes.repeated_layers import find_repeated_layers
from .costs import Space
from .planner_state import PlannerOptions
from .problem import Problem

MERGE_FOLLOWERS_ABOVE = 200
"""Follower merging is greedy: a follower takes the locally cheapest strategy per leader
strategy and cannot see its own consumers, so it may slice a replicated value for free and leave
gathering it back to them (measured: 4.3x the exact optimum on the JAX MLP step on dp=8, see
docs/design.md). It is a scale device: graphs up to this many ops are also solved exactly."""

EXACT_UP_TO = 1000
"""Larger graphs whose repeated layers share variables down to at most this many decisions are
solved exactly, without follower merging: exact chain elimination
(``solver/eliminate.py``) shrinks them about as much, and the merged optimum was 4x worse on
the unrolled JAX GPT (docs/design.md, "Planning speed")."""


def shrink(problem: Problem, space: Space, share_layers: bool, merge_followers: bool) -> None:
    """Tie loop carries, share variables across repeated layers, then merge followers, then
    coalesce edges."""
    tie_loop_carries(problem, space)
    representative: dict[int, int] = {}
    if share_layers:
        if space.repeated is None:  # computed once per space (both objective variants use it)
            space.repeated = find_repeated_layers(space.graph)
        representative = space.repeated.representative
        for copy, first in sorted(representative.items()):
            alive = problem.alive[copy] and problem.alive[first]
            if alive and space.strategies[copy] is space.strategies[first]:
                strategies = len(space.strategies[copy])
                problem.eliminate(copy, first, np.arange(strategies), identity=True)
        problem.coalesce()
    if merge_followers:
        for follower, leader in follower_pairs(space.graph, space.producer, space.num_inputs):
            leader = representative.get(leader, leader)
            if problem.alive[follower] and problem.alive[leader]:
                problem.eliminate(follower, leader, problem.follow_mapping(follower, leader))
        problem.coalesce()


def tie_loop_carries(problem: Problem, space: Space) -> None:
    """A loop hands its carry to the next iteration in the layout the carry entered with: each
    ``scan_loop`` op takes the strategy of the ``scan_carry`` op its ``carry`` attribute names
    (a hard constraint, not a price: the loop-back reshard is the ``scan_loop`` operand edge)."""
    loops = [(i, op) for i, op in enumerate(space.graph.ops) if op.kind == "scan_loop"]
    if not loops:
        return
    by_name = {v.name: v for v in space.graph.values()}
    for i, op in loops:
        follower, (leader, _) = space.op_node(i), space.producer[by_name[str(op.attrs["carry"])]]
        if not (problem.alive[follower] and problem.alive[leader]):
            continue
        index = {s.results[0]: n for n, s in enumerate(space.strategies[follower])}
        mapping = np.array([index[s.results[0]] for s in space.strategies[leader]])
        problem.eliminate(follower, leader, mapping)


def merge_variants(o: PlannerOptions, space: Space, quick: bool, binds: bool) -> list[bool]:
    """Which of follower-merged (True) and exact (False) to solve (``MERGE_FOLLOWERS_ABOVE``,
    ``EXACT_UP_TO``); an axis-search step (``quick``) solves one: exact when the finish also
    solves exactly and nothing is pinned (merged steps steered the tiny HF Llama's free search
    to 1.5-5x slower plans; pinned runs keep merged steps and their plans: exact steps changed
    the pinned 1-layer JAX GPT's (2,2,2) plan to one whose collectives XLA runs otherwise)."""
    if o.merge_followers is not None:
        return [o.merge_followers]
    if quick:
        exact = False in merge_variants(o, space, False, binds)
        return [False] if exact and not any(v.pinned for v in space.graph.values()) else [True]
    if len(space.graph.ops) <= MERGE_FOLLOWERS_ABOVE:
        return [True, False]  # small enough to also solve exactly
    looped = any(op.repeat != 1 for op in space.graph.ops)
    if not (binds or looped) and shared_decisions(space, o.share_layers) <= EXACT_UP_TO:
        return [False]  # exact: eliminating chains keeps it about as small as merging would
    # Not under a binding memory limit (peak rows name nodes, so nothing is eliminated), nor
    # for scan bodies: the scanned GPT's exact plan runs one all-gather XLA inserts and the
    # plan does not predict (examples/jax_gpt.py --scan's check), so loops stay merged.
    return [True]


def shared_decisions(space: Space, share_layers: bool) -> int:
    """Decision nodes left once repeated layers share variables (before follower merging)."""
    if share_layers and space.repeated is None:
        space.repeated = find_repeated_layers(space.graph)
    shared = space.repeated.num_shared if share_layers else 0  # type: ignore[union-attr]
    return len(space.strategies) - shared
