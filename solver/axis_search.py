"""Plan meshes of three or more axes by exact search over one-axis neighbourhoods.

Every op strategy is one coordinate per mesh axis (the factor the axis splits, a pending sum,
or nothing), so an op has up to ``(factors + 2) ** axes`` strategies: a (4, 4, 16, 16) tensor
has 123 layouts on a (2, 2, 2) mesh (214 with pending sums) and 591 on (2, 2, 2, 2), and edge
tables have their square. Pricing and solving that whole space took minutes for a one-layer
model (docs/design.md, "Meshes of three and four axes"). Instead:

1. *Start*: solve the graph exactly on a two-axis mesh, the outer axes merged into one (as many
   devices; a two-axis space stays small), and give each outer axis the coordinate the merged
   axis had: the best plan in which the outer axes act together (data parallel, FSDP, either
   with tensor parallelism on the inner axis) is where the search starts.
2. *Improve*: solve exactly over the strategies within one axis of the incumbent (any op may
   change what one of its axes does; different ops may change different axes), warm-started by
   the incumbent, which is in the neighbourhood. Repeat until a step gains under
   ``IMPROVEMENT`` (with followers merged greedily a step can come out worse: the search stops
   there too; the first step also stops it when it gains that little over the start); then
   solve the best step's neighbourhood as a one- or two-axis mesh is solved (every objective
   variant, the simulator picks; an exact step's optimal solve of the plain objective is
   reused).

Pins are honoured: on the merged mesh where they can be expressed, in every step exactly.
Each step's space grows linearly with the mesh rank. The solver is exact on what it keeps (the
neighbourhood); the result is a local optimum of the full space, not a certified global one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

from ..ir import Graph, Mesh, Sharding, ShardingRule
from ..passes.enumerate_strategies import Coords, layout_coords, op_coords
from .costs import PartialSemantics, Space, build_space
from .plan import Plan

AXIS_SEARCH_FROM = 3
"""Meshes with this many axes of size > 1 or more are planned by the axis search (one and two
axes enumerate every strategy, which stays small)."""
MAX_STEPS = 8
STEP_SHARE = 0.25
"""Wall-clock safety net of one step, as a share of the time limit; what normally ends a step's
CP-SAT search is its deterministic work cap (``planner.STEP_WORK``): the step is warm-started by
the incumbent, so a step cut short still returns a plan at least as good."""
START_WORK = 0.1
"""CP-SAT deterministic-time cap of the merged-mesh start (the steps take ``planner.STEP_WORK``,
1.0): the start only has to be a good centre, and the steps are exact on their
neighbourhoods. On Llama-3-70B's stage mesh (2, 4, 8) under a batch cap the start is
memory-bound and CP-SAT spent its whole budget proving (``FEASIBLE`` at a 15.9% gap) after
finding the LP-hinted plan at once: 12.4 CPU s at 1.0, 6.3 at 0.1, the same start and plan."""
SHARED_START_STEPS = 0
"""Steps of a search that starts from the previous search's best (``shared_start``: a
pipeline's later batch caps): none, the finish solves that centre's neighbourhood with every
objective variant. On Llama-3-70B (``pp=4`` x (2, 4, 8), 16 x 128K) the second cap's two steps
(~9 CPU s of capped CP-SAT each) left the centre where it was and the cap lost by 50%; a later
cap's plan is the best within one axis of the earlier cap's, not a local optimum of its own."""
IMPROVEMENT = 2e-3
"""Relative objective improvement below which the search stops (measured from a flat start on
Llama-3-8B, 2x4x8: the last three steps gained 0.4% in all, at ~2 s each)."""

PlanSpace = Callable[..., tuple[Plan | None, list[int], float]]


def live_axes(mesh: Mesh) -> list[str]:
    return [name for name, size in mesh.axes if size > 1]


def axis_search(
    graph: Graph,
    mesh: Mesh,
    semantics: PartialSemantics | None,
    plan_space: PlanSpace,
    rules: Mapping[int, ShardingRule] | None = None,
) -> Plan:
    """The best plan found from the flat start by one-axis moves.

    ``plan_space(space, hints, share, quick)`` prices and solves one space and returns its plan
    (None when ``quick``), choice and solver objective. The moves are steered by the plain
    objective (``quick``); the last neighbourhood is then solved with every objective variant
    and the simulator picks the plan, as for one- and two-axis meshes. ``rules``: as
    ``build_space``'s (a pipeline's micro-batch sizes), for every space of the search."""
    shared = _STARTS.get(id(graph))
    steps = MAX_STEPS
    if shared is not None and shared[0] is graph and shared[1] == mesh and shared[2]:
        center, repeated, start = list(shared[2]), None, math.inf  # the previous search's best
        steps = SHARED_START_STEPS
    else:
        center, repeated, start = _merged_start(graph, mesh, semantics, plan_space, rules)
    for n, value in enumerate(graph.inputs):  # a pinned input sits on its pin
        if value.pinned and value.sharding is not None:
            center[n] = layout_coords(value.sharding, mesh)
    prices: dict = {}
    lists: dict = {}
    tables: dict = {}

    def neighbourhood(center: list[Coords]) -> Space:
        nonlocal repeated
        space = build_space(graph, mesh, semantics, around=center, lists=lists, rules=rules)
        space.repeated = repeated  # layers are a property of the graph: found once
        # Neighbourhoods overlap: a node whose centre did not move keeps its strategy list,
        # and with it its op costs and edge tables; most reshards are priced once.
        space.prices, space.tables = prices, tables
        return space

    best, best_space = math.inf, None
    for step in range(steps):
        space = neighbourhood(center)
        _, choice, objective = plan_space(space, _index(space, center), STEP_SHARE, True)
        repeated = space.repeated
        if objective >= best * (1 - IMPROVEMENT):
            break
        best, best_space, center = objective, space, coordinates(space, choice)
        if step == 0 and objective >= start * (1 - IMPROVEMENT):
            break  # the first step gained little over the start (the same plan on as many
            # devices): on Llama-3-8B (2,4,8) it gained 0.07% and the next step nothing
    # The best step's own neighbourhood again, with every objective variant: with followers
    # merged (greedily) the next one need not reproduce its plan, this one does (the same
    # problem; the step's optimal plain solve is reused, ``planner._reusable_step``).
    space = best_space if best_space is not None else neighbourhood(center)  # no steps taken
    plan, _, _ = plan_space(space, _index(space, center), 1.0, False)
    assert plan is not None
    if shared is not None and shared[0] is graph:
        _STARTS[id(graph)] = (graph, mesh, list(center))  # the best step's plan
    return plan


def _merged_start(graph: Graph, mesh: Mesh, semantics, plan_space: PlanSpace, rules=None):  # type: ignore[no-untyped-def]
    """(the start centre, the layers found, its objective): the graph solved on the two-axis mesh
    whose outer axes are merged into one, each outer axis given the merged axis's coordinate."""
    axes = live_axes(mesh)
    outer, inner = axes[:-1], axes[-1]
    name = "_".join(outer)
    merged = mesh.with_axes(
        {name: math.prod(mesh.axis_size(a) for a in outer), inner: mesh.axis_size(inner)}
    )
    with _merged_pins(graph, outer, name):  # pins the merged mesh cannot express are left out
        start_space = build_space(graph, merged, semantics, rules=rules)
        _, choice, start = plan_space(start_space, None, STEP_SHARE, True, START_WORK)
    start_space.solved = None  # another mesh: nothing to reuse
    center = [c[:1] * len(outer) + c[1:] for c in coordinates(start_space, choice)]
    return center, start_space.repeated, start


_STARTS: dict[int, tuple[Graph, Mesh | None, list[Coords]]] = {}
"""Graph id -> (the graph, the mesh and best centre of its last search), inside ``shared_start``."""


@contextmanager
def shared_start(graph: Graph) -> Iterator[None]:
    """Inside, an axis search on ``graph`` starts from the previous search's best centre on the
    same mesh instead of the merged-mesh solve: a pipeline solves its stage mesh once per batch
    cap (``solver/pipeline.py``), and the caps are searched from the smallest, whose plan every
    larger cap also allows. On Llama-3-70B at 16 x 128K tokens (``pp=4`` x (2, 4, 8)) each
    merged-mesh start was a 20 s CP-SAT solve. Scoped: a later planning call starts afresh."""
    outer = id(graph) in _STARTS
    if not outer:
        _STARTS[id(graph)] = (graph, None, [])
    try:
        yield
    finally:
        if not outer:
            del _STARTS[id(graph)]


@contextmanager
def _merged_pins(graph: Graph, outer: list[str], name: str) -> Iterator[None]:
    """Pins rewritten for the merged mesh while the start is planned (restored after): a pin
    that splits a dim by all outer axes in order takes the merged axis; one that uses only some
    of them is dropped for the start (the steps then honour it)."""
    saved = [(v, v.sharding, v.pinned) for v in graph.values() if v.pinned]
    try:
        for value, sharding, _ in saved:
            translated = _to_merged(sharding, outer, name) if sharding is not None else None
            value.sharding, value.pinned = translated, translated is not None
        yield
    finally:
        for value, sharding, pinned in saved:
            value.sharding, value.pinned = sharding, pinned


def _to_merged(layout: Sharding, outer: list[str], name: str) -> Sharding | None:
    """``layout`` on the merged mesh, or None when it splits by only some outer axes."""
    dims = []
    for group in layout.dims:
        mine = [a for a in group if a in outer]
        if not mine:
            dims.append(tuple(group))
        elif list(group[: len(outer)]) == list(outer):
            dims.append((name, *group[len(outer) :]))
        else:
            return None
    partial = set(layout.partial)
    if partial & set(outer):
        if not set(outer) <= partial:
            return None
        partial = (partial - set(outer)) | {name}
    return Sharding(tuple(dims), frozenset(partial))


def coordinates(space: Space, choice: list[int]) -> list[Coords]:
    """Per node, the coordinates of its chosen strategy."""
    out: list[Coords] = []
    for n, options in enumerate(space.strategies):
        strategy = options[choice[n]]
        if n < space.num_inputs:
            out.append(layout_coords(strategy.results[0], space.mesh))
        else:
            out.append(op_coords(strategy, space.mesh))
    return out


def _index(space: Space, center: list[Coords]) -> dict[int, int]:
    """Per node, the index of the incumbent's strategy in the neighbourhood (the warm start)."""
    hints: dict[int, int] = {}
    for n, c in enumerate(center):
        found = _find(space, n, c)
        if found is not None:
            hints[n] = found
    return hints


def _find(space: Space, n: int, center: Coords) -> int | None:
    for s, strategy in enumerate(space.strategies[n]):
        if n < space.num_inputs:
            if layout_coords(strategy.results[0], space.mesh) == center:
                return s
        elif op_coords(strategy, space.mesh) == center:
            return s
    return None
