"""Price the hand-written strategies on the free problem: the memory-bound solve's warm start.

When the memory limit binds, CP-SAT needs a point that fits to start from (without one it may
find none in time) and ``sp.plan`` promises a plan never slower than the best fitting
hand-written strategy. Pricing each strategy as ``sp.evaluate`` does (a pinned ``plan_graph``
per strategy: enumerate, price, shrink, solve, build, simulate) took 38-57 s of CPU for 15
strategies on Llama-3 8B/70B shapes (docs/design.md, "Memory-bound planning").

A strategy pins only graph inputs and fixes recomputation, so on the same graph, mesh and
semantics its problem *is* the free problem with each pinned input restricted to its pin's
layout and each layer's recomputation forced. Here the free problem is priced and shrunk once
(alike layers share variables, followers merged, as ``sp.evaluate`` merges them), and each
strategy is a restricted copy solved with its recomputation fixed. A strategy whose persistent
state cannot fit even at its smallest is skipped without a solve (replicated 70B states). Only
the fastest fitting one is built into a ``Plan`` and simulated.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future

import numpy as np

from ..costmodel.cluster import Cluster
from ..ir import ShardplanError
from .costs import Space
from .dominance import memory_vectors
from .ilp import Solution, prepare, relax, solve
from .memory import MemoryModel
from .memory_rows import _resolution
from .problem import Problem

SEED_WORK = 2.0
"""CP-SAT deterministic-time cap per strategy (most are proven optimal by the LP, all inputs
being fixed); the cap keeps pricing deterministic on a busy machine."""


@dataclasses.dataclass(frozen=True, slots=True)
class Priced:
    """One hand-written strategy solved on the free problem."""

    name: str
    index: int
    """Position in ``strategies.for_graph`` (ties go to the earlier, as ``sp.evaluate``'s)."""
    score: float
    """Linear objective plus recomputation seconds (comparable across strategies)."""
    solution: Solution
    memory: MemoryModel


def price_baselines(
    space: Space,
    problem: Problem,
    memory: MemoryModel,
    cluster: Cluster,
    shrink,  # type: ignore[no-untyped-def]
    time_limit: float,
) -> tuple[str, object] | None:
    """``(name, plan)`` of the fastest fitting hand-written strategy (``strategies.for_graph``)
    priced on ``problem`` (unshrunk, unmodified), or None when none fits or none is a layout
    of this space. ``shrink(problem)`` shares layers and merges followers in place."""
    from .strategies import for_graph

    graph, mesh = space.graph, space.mesh
    base = problem.copy()
    shrink(base)
    resolve = _resolution(base)
    usage = memory_vectors(base, memory)  # the restricted copies differ from base in costs only
    persistent = _persistent_minimum(space, memory)
    priced: list[Priced] = []
    settled: dict[str, int] = {}  # family -> the position whose LP optimum fits
    deferred: list[tuple] = []
    layouts: dict = {}  # strategy less its recomputation -> allowed strategies per node
    for index, strategy in enumerate(for_graph(graph, mesh)):  # per family: none, sel., full
        family = strategy.name.split("+")[0]
        if family in settled:
            continue
        built = _restricted(space, base, resolve, persistent, memory, strategy, layouts)
        if built is None:
            continue
        restricted, forced = built
        # first pass: what the LP solves alone; those that need a search wait for a cutoff
        # (pruned and relaxed once: the second pass reuses both)
        prepared = prepare(restricted, None, forced, usage)
        relaxation = _done(relax(prepared, time_limit))
        solution = solve(restricted, time_limit, memory=forced, cutoff=float("-inf"),
                         prepared=prepared, relaxation=relaxation)  # fmt: skip
        if solution.status == "CUTOFF":
            deferred.append((index, strategy, restricted, forced, prepared, relaxation))
            continue
        _add(priced, index, problem, memory, strategy, solution, forced)
        if solution.status == "OPTIMAL" and solution.num_variables == 0:
            # the LP's optimum fits without the memory rows: the family's cheapest layouts, and
            # more recomputation (full re-runs a superset of selective) only adds time. Exact
            # from no recomputation; from selective, the LP ignores the recomputed ops' price,
            # so full could recompute cheaper layouts (by at most that price's spread)
            settled[family] = index
    _price_deferred(deferred, settled, priced, problem, memory, time_limit)
    if not priced:
        return None
    best = min(priced, key=lambda p: (p.score, p.index))  # ties: the earlier (simpler) one
    from .build import SEED_PLAN, build_plan, simulated

    plan = simulated(build_plan(space, cluster, best.solution, base, best.memory))
    space.tables[SEED_PLAN] = (best.solution.choice, dict(best.memory.decisions), plan)
    return best.name, plan


def _price_deferred(deferred, settled, priced, problem, memory, time_limit: float) -> None:  # type: ignore[no-untyped-def]
    """The strategies whose LP optimum did not fit (the memory limit binds): a capped search
    each, cut off at the best score so far, unless their family already settled earlier."""
    for index, strategy, restricted, forced, prepared, relaxation in deferred:
        if settled.get(strategy.name.split("+")[0], index) < index:
            continue  # a bound rules it out
        cutoff = min((p.score for p in priced), default=None)
        solution = solve(restricted, time_limit, memory=forced, work_limit=SEED_WORK,
                         cutoff=cutoff, prepared=prepared, relaxation=relaxation)  # fmt: skip
        _add(priced, index, problem, memory, strategy, solution, forced)


def _done(value: object) -> Future:
    """A future already holding ``value`` (``solve`` takes the LP as a future)."""
    future: Future = Future()
    future.set_result(value)
    return future


def _restricted(space, base, resolve, persistent, memory, strategy, layouts: dict):  # type: ignore[no-untyped-def]
    """(the free problem restricted to ``strategy``'s pins, the memory model with its
    recomputation forced), or None when its pins are no layouts here or cannot fit.
    ``layouts``: the allowed strategies per pinned node, by the strategy less its
    recomputation (the pins do not depend on it: a family's three are worked out once)."""
    key = dataclasses.replace(strategy, name="", recompute=None)
    if key not in layouts:
        layouts[key] = _layouts(space, base, resolve, persistent, memory, strategy)
    allowed = layouts[key]
    if allowed is None:
        return None
    restricted = base.copy()
    for node, ok in allowed.items():
        restricted.node_costs[node] = np.where(ok, restricted.node_costs[node], np.inf)
    forced = dataclasses.replace(
        memory,
        forced=dict.fromkeys(memory.live.layers, strategy.recompute),
        decisions={},
        hint_decisions=dict.fromkeys(memory.live.layers, strategy.recompute),
    )
    return restricted, forced


def _layouts(space, base, resolve, persistent, memory, strategy):  # type: ignore[no-untyped-def]
    """Per live pinned node, the strategies ``strategy``'s pins allow; None when its pins are
    no layouts here or its persistent state cannot fit even at its smallest."""
    try:
        pins = strategy.pins(space.graph, space.mesh)
    except (ValueError, ShardplanError):
        return None  # e.g. a sequence not divisible by a cp axis
    allowed = _allowed(space, base, resolve, pins)
    if allowed is None or _cannot_fit(allowed[1], persistent, memory.limit):
        return None
    return allowed[0]


def _add(priced, index, problem, memory, strategy, solution, forced) -> None:  # type: ignore[no-untyped-def]
    """Append the strategy's solution with its score, unless it found none or does not fit."""
    if not solution.choice:
        return
    decisions = forced.fixed_decisions()
    if memory.limit is not None and forced.peak(solution.choice, decisions)[0] > memory.limit:
        return
    score = problem.evaluate(solution.choice) + forced.recompute_cost(solution.choice, decisions)
    forced.decisions = decisions
    priced.append(Priced(strategy.name, index, score, solution, forced))


def _persistent_minimum(space: Space, memory: MemoryModel) -> list[tuple[int, np.ndarray]]:
    """(input node, bytes per strategy) of every graph input: live all step, whatever else."""
    return [(t.node, t.nbytes) for t in memory.terms if t.node < space.num_inputs]


def _allowed(space: Space, problem: Problem, resolve, pins):  # type: ignore[no-untyped-def]
    """(per live node, per input node): the strategies consistent with ``pins`` (graph-input
    name -> layout); None when some pin is not a layout of this space. A user pin (already in
    the graph) wins."""
    mask: dict[int, np.ndarray] = {}
    own: dict[int, np.ndarray] = {}
    for n, value in enumerate(space.graph.inputs):
        wanted = pins.get(value.name)
        if wanted is None or value.pinned:
            continue
        ok = np.array([s.results[0] == wanted for s in space.strategies[n]])
        if not ok.any():
            return None
        own[n] = ok
        leader, mapping = resolve.get(n, (n, None))
        ok = ok if mapping is None else ok[mapping]
        mask[leader] = mask[leader] & ok if leader in mask else ok
        if not mask[leader].any():
            return None
    for leader, ok in mask.items():
        if not (ok & np.isfinite(problem.node_costs[leader])).any():
            return None
    return mask, own


def _cannot_fit(own: dict[int, np.ndarray], persistent, limit: float | None) -> bool:  # type: ignore[no-untyped-def]
    """True when the graph inputs alone, each at its smallest allowed layout, exceed ``limit``
    (inputs are live the whole step, so this is a lower bound on any peak)."""
    if limit is None:
        return False
    total = 0.0
    for node, nbytes in persistent:
        ok = own.get(node)
        total += float(nbytes[ok].min() if ok is not None else nbytes.min())
    return total > limit
