"""plan_graph: enumerate, price, merge followers, solve with CP-SAT, and build the Plan."""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import numpy as np

from ..costmodel import get_cluster, reshard, reshard_time
from ..costmodel.cluster import Cluster
from ..costmodel.exposure import weight_edges
from ..costmodel.fusion import unfused_penalty
from ..costmodel.simulate import shared_reshards, simulate
from ..ir import Graph, InfeasiblePlanError, Mesh, Role, Sharding
from ..ir.errors import NoPlanInTime
from ..passes.merge_followers import follower_pairs
from ..passes.repeated_layers import find_repeated_layers
from . import progress
from .axis_search import AXIS_SEARCH_FROM, axis_search, live_axes
from .batch import cap_batch_split, micro_rules
from .cap_bound import CapCannotWin, op_time_bound
from .costs import (
    PERSISTENT_ROLES,
    PartialSemantics,
    Space,
    build_problem,
    build_space,
    input_cost,
    op_cost,
    op_costs,
    op_vectors_key,
    pinned_result,
    seen_layout,
)
from .ilp import Prepared, Solution, prepare, proven_within_gap, relax, solve
from .memory import infeasible_error
from .memory_terms import build_memory_model, cache_write
from .plan import Plan, Reshard, SolverStats
from .problem import Problem
from .seed import price_baselines

STEP_WORK = 1.0
"""CP-SAT deterministic-time cap of one axis-search step (``solver/axis_search.py``): a step is
warm-started by its incumbent, so stopping early loses little, and the cap does not depend on
how busy the machine is (planning stays deterministic)."""

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


def plan_graph(
    graph: Graph,
    mesh: Mesh,
    pins: Mapping[str, Sharding] | None = None,
    memory_limit: float | None = None,
    time_limit: float = 30.0,
    merge_followers: bool | None = None,
    share_layers: bool = True,
    recompute: bool | dict[str, str | None] = True,
    overlap: bool = True,
    semantics: PartialSemantics | None = None,
    activation_scale: float = 1.0,
    batch_split_limit: int | None = None,
    fallback: Callable[[], tuple[str, Plan] | None] | None = None,
    lp_seed: bool = False,
    memory_search: bool = True,
    cutoff: Callable[[float], bool] | None = None,
    micro_sizes: bool = True,
) -> Plan:
    """Choose a layout for every value of ``graph`` on ``mesh`` minimising modelled step time.

    The memory limit (per device, bytes; default the cluster's device memory) bounds the
    modelled peak of the step: persistent state plus live activations (``solver/memory.py``).
    ``recompute``: True lets the solver recompute layers, False forbids it, a dict fixes it.
    ``semantics``: how the target runtime treats pending sums (frontends declare it).
    ``overlap``: also solve with overlap-aware edge prices (gradient syncs and parameter
    gathers mostly hidden, ``costmodel.simulate.edge_exposure``) and keep whichever of the two
    plans the two-stream simulator finds faster; ``plan.step_time`` is the simulated step.
    ``batch_split_limit``: every op's layouts hold on a micro-batch of this many samples (a
    pipeline's cap; ``solver/batch.py``): no op splits the batch over more devices than that,
    and a merged ``(b s)`` may split ``s`` under a ``b`` split that many ways
    (``micro_sizes=False``: the whole-batch space filtered by the cap, where neither is).
    ``merge_followers``: True or False: solve with or without follower merging
    (``passes/merge_followers.py``); None (default): merged, and graphs of at most
    ``MERGE_FOLLOWERS_ABOVE`` ops are also solved exactly; the simulator picks among them.
    ``fallback``: called when the solver finds no plan in time (not when none fits); it
    returns ``(name, plan)`` of the best fitting hand-written strategy (``sp.plan`` passes
    ``evaluate.best_baseline``), which is returned with a warning and status ``FALLBACK``.
    ``lp_seed``: when the limit binds and no hand-written strategy seeds the solve (or none is
    priced: a pipeline's sub-mesh solve, ``solver/pipeline.py``), the LP's layouts with every
    layer fully recomputed are the seed (``ilp.solve``'s ``lp_seed``).
    ``memory_search=False``: a seeded memory-bound solve keeps its seed's or the primal
    heuristic's point instead of running CP-SAT's capped search (``ilp.solve``'s ``search``;
    a pipeline's sub-mesh solves).
    ``cutoff``: given a lower bound on the op time of every plan a space can return
    (``solver/cap_bound.py``), True raises ``CapCannotWin`` before that space is solved (a
    pipeline's batch cap that cannot beat an earlier one).
    """
    graph.mesh = mesh
    if pins:
        from ..passes.annotate import annotate

        annotate(graph, pins)
    cluster = get_cluster(mesh.cluster)
    limit = memory_limit if memory_limit is not None else cluster.hbm_capacity
    clock = _Clock()
    baseline = _Once(fallback) if fallback is not None else None
    options = _Options(
        cluster, limit, time.perf_counter() + time_limit, time_limit, merge_followers,
        share_layers, recompute, overlap, activation_scale, batch_split_limit, clock, baseline,
        lp_seed, memory_search, cutoff, micro_sizes,
    )  # fmt: skip
    # a pipeline's cap: enumerate by micro-batch sizes (``batch.micro_rules``)
    sized = batch_split_limit is not None and micro_sizes
    rules = micro_rules(graph, batch_split_limit) if sized else None  # type: ignore[arg-type]
    try:
        if len(live_axes(mesh)) >= AXIS_SEARCH_FROM:
            best = axis_search(graph, mesh, semantics, partial(_plan_space, options), rules)
        else:
            space = clock("enumerate", build_space, graph, mesh, semantics, rules=rules)
            best, _, _ = _plan_space(options, space)
    except NoPlanInTime as error:
        best = _fall_back(baseline, error) if baseline is not None else None
        if best is None:
            raise
    if baseline is not None and baseline.called and best.solver.status != "FALLBACK":
        best = _not_slower(best, baseline())
    graph.mesh = mesh
    return dataclasses.replace(best, timings=dict(clock.seconds))


@dataclass(frozen=True, slots=True)
class _Options:
    """What ``plan_graph`` was asked for, shared by every space it solves."""

    cluster: Cluster
    limit: float
    deadline: float
    time_limit: float
    merge_followers: bool | None
    share_layers: bool
    recompute: bool | dict[str, str | None]
    overlap: bool
    activation_scale: float
    batch_split_limit: int | None
    clock: _Clock
    baseline: _Once | None = None
    """The best fitting hand-written strategy, priced once when the memory limit binds: the
    solver's warm start, and the plan returned if the solver's is slower."""
    lp_seed: bool = False
    """Seed a binding solve from the LP when no baseline does (``plan_graph``'s ``lp_seed``)."""
    memory_search: bool = True
    """CP-SAT's capped search after a seeded memory-bound solve (``plan_graph``'s)."""
    cutoff: Callable[[float], bool] | None = None
    """``plan_graph``'s ``cutoff``: checked before a space's plans are solved."""
    micro_sizes: bool = True
    """``plan_graph``'s ``micro_sizes``: how ``batch_split_limit`` caps each space."""


def _plan_space(
    options: _Options,
    space: Space,
    hints: dict[int, int] | None = None,
    share: float = 1.0,
    quick: bool = False,
    work: float = STEP_WORK,
) -> tuple[Plan | None, list[int], float]:
    """Price, shrink and solve one space: the best plan (by the simulator), its choice and its
    solver objective. ``share``: the fraction of the user's time limit it may take at most.
    ``quick``: only the plain objective, merged as the finish will solve it, and no plan built
    (the choice and objective steer the axis search); the solve is kept on the space
    (``Space.solved``) so that a finish on the same space reuses it when it was optimal.
    ``work``: CP-SAT's deterministic-time cap when ``share < 1`` (the axis search's steps and,
    lower, its start)."""
    o, clock, cluster, limit = options, options.clock, options.cluster, options.limit
    space.graph.mesh = space.mesh
    if o.batch_split_limit is not None:
        hints = _capped_hints(space, hints, o.batch_split_limit, clock, o.micro_sizes)
    problem = clock("price", build_problem, space, cluster, limit)
    _check_cutoff(o, space, problem, quick)
    _check_memory_feasible(space, problem, limit)
    memory = clock(
        "memory", build_memory_model, space, cluster, limit, o.recompute, o.activation_scale
    )
    binds = not memory.cannot_bind(problem)
    merges = _merge_variants(o, space, quick, binds)
    warm = {**_hints(space), **(hints or {})}
    step = None if quick else _reusable_step(space, o, merges)  # a finish: the step stands
    seeded = (o.baseline is not None or o.lp_seed) and not quick and o.recompute is True
    seeded = seeded and step is None  # the step's optimum is a complete, fitting warm start
    shrunk: list[Problem] = []  # the seed's shrunk copy of ``problem``
    if seeded and binds and o.baseline is not None:  # the limit binds: start from a baseline
        warm = {**_seed_warm(o, space, problem, memory, shrunk), **warm}
    objectives: list = [problem]
    if o.overlap and not quick:
        weighted = partial(_weighted, clock, problem, space)
        # a seeded memory-bound solve often ends at the plain variant (proven within the gap):
        # the weighted copy is then made only if reached (70B: 1 s), from ``problem``, which
        # the plain variant leaves unshrunk when it takes the seed's shrunk copy
        lazy = bool(shrunk) and merges == [True]
        objectives.append(weighted if lazy else weighted())
    last = len(merges) - 1  # shrinking changes a problem: earlier merge choices take copies
    variants = [
        (p if n == last or callable(p) else p.copy(), m) for n, m in enumerate(merges)
        for p in objectives
    ]  # fmt: skip
    if shrunk and variants[0] == (problem, True):  # the same shrink: reuse it (70B: 2.7 s)
        variants[0] = (shrunk[0], True)
    plans: list[tuple[Plan, list[int], float]] = []
    chosen: list[list[int]] = []
    variants = _take_step(clock, space, cluster, step, variants, plans, chosen)
    left = share * o.time_limit  # spent in CP-SAT's deterministic time, not wall time (ilp.py)
    with ThreadPoolExecutor(max_workers=LP_THREADS) as pool:
        ahead = _prepare_ahead(variants, space, o, warm, memory, pool, left, seeded and binds,
                               frozenset(map(id, shrunk)))  # fmt: skip
        for index, ((_, merge), (candidate, prepared, relaxation)) in enumerate(
            zip(variants, ahead, strict=True)
        ):
            budget = max(1.0, left) / (len(variants) - index)  # the limit covers every variant
            capped = work if share < 1 else None  # a step cut short is still deterministic
            solution = clock("solve", solve, candidate, budget, warm, memory=memory,
                             work_limit=capped, prepared=prepared, relaxation=relaxation,
                             lp_seed=seeded and binds, search=o.memory_search,
                             seed_needed=_micro_capped(o))  # fmt: skip
            left = max(0.0, left - solution.seconds_of_budget)  # what one leaves, the next gets
            if not solution.choice and plans and not merge:
                continue  # the exact variant is extra: a merged plan stands
            if not solution.choice:
                if solution.status == "INFEASIBLE":  # memory hook: say what the minimum is
                    raise infeasible_error(memory, candidate, limit)
                raise NoPlanInTime(
                    f"the solver found no plan ({solution.status}) within {o.time_limit:.0f} s; "
                    "raise time_limit or the memory limit"
                )
            if quick:
                space.solved = (merge, candidate, solution, memory)
                return None, solution.choice, solution.objective
            if solution.choice in chosen:
                continue  # the same layouts: the plan is already built and simulated
            chosen.append(solution.choice)
            plans.append(_built(clock, space, cluster, candidate, solution, memory))
            if (
                seeded
                and binds
                and solution.status != "OPTIMAL"
                and proven_within_gap(solution, memory)
            ):  # the limit shaped the plan (a search, not the LP) and it is proven close:
                break  # the other objective is not solved (an OPTIMAL one's is cheap: the
                # README demo's 16-layer Llama, 20 of 74 GiB, keeps its 0.1% better plan)
    return min(plans, key=lambda p: p[0].step_time)  # ties keep the plain objective's plan


def _micro_capped(o: _Options) -> bool:
    """A pipeline cap enumerated by micro-batch sizes: its memory-bound solve runs only from
    its LP seed (``ilp.solve``'s ``seed_needed``); without one it finds no plan at once and
    the pipeline solves the cap again in the whole-batch space (``pipeline._sized``)."""
    return o.micro_sizes and o.batch_split_limit is not None


def _check_cutoff(o: _Options, space: Space, problem: Problem, quick: bool) -> None:
    """Raise ``CapCannotWin`` when ``o.cutoff`` finds the space's op-time bound too high (not
    in an axis-search step: its plan only steers the search)."""
    if o.cutoff is not None and not quick:
        bound = o.clock(
            "cutoff", op_time_bound, problem, space, o.cluster, o.time_limit, o.share_layers
        )
        progress.report("cutoff", "the plans here spend >= %.2f s in ops", bound)
        if o.cutoff(bound):
            raise CapCannotWin(bound)


def _seed_warm(o: _Options, space: Space, problem: Problem, memory, shrunk: list) -> dict:  # type: ignore[no-untyped-def]
    """The warm start from the best fitting hand-written strategy, priced once on ``problem``
    (not one plan_graph per strategy); the pricing's shrunk copy of ``problem`` goes to
    ``shrunk`` (the plain variant's shrink is the same)."""
    if not o.baseline.called:  # type: ignore[union-attr]
        merged = partial(shrink, space=space, share_layers=o.share_layers, merge_followers=True)
        found = o.clock("seed", price_baselines, space, problem, memory, o.cluster,
                        lambda p: merged(p) or shrunk.append(p), o.time_limit)  # fmt: skip
        o.baseline.set(found)  # type: ignore[union-attr]
    return o.clock("seed", _seed, space, memory, o.baseline())  # type: ignore[misc]


LP_THREADS = 2
"""Threads for the variants' LPs: GLOP releases the GIL, so one variant's LP runs while the
next is shrunk and pruned, and two LPs run at once (measured on the README's JAX GPT: the two
LPs 1.9-2.5 s one after the other, 1.6-1.9 s side by side, same solutions)."""


def _prepare_ahead(variants, space: Space, o: _Options, warm, memory, pool, left: float,
                   lazy: bool = False, shrunk: frozenset[int] = frozenset()):  # fmt: skip
    """Per variant, in order: shrink, prune and eliminate it here, and hand its LP to ``pool``
    at once. Every step is what ``solve`` would do itself, in the same order; only the LPs run
    concurrently, so the plans are the same. ``lazy`` (seeded memory-bound solves): each
    variant is prepared only when the loop reaches it, since one proven within
    ``ilp.MEMORY_GAP`` ends the loop (70B: 2.7 s of shrinking, 1.8 s of pruning and an LP).
    ``shrunk``: ids of problems already shrunk (the seed's copy of the plain one)."""
    if lazy:
        return (_prepare_one(c, m, space, o, warm, memory, pool, left, shrunk)
                for c, m in variants)  # fmt: skip
    return [_prepare_one(c, m, space, o, warm, memory, pool, left, shrunk) for c, m in variants]


def _built(clock, space: Space, cluster: Cluster, problem: Problem, solution: Solution, memory):  # type: ignore[no-untyped-def]
    """(the simulated plan, its choice, its solver objective)."""
    seed = space.tables.get(SEED_PLAN)
    if (
        seed is not None
        and memory is not None
        and seed[0] == solution.choice
        and seed[1] == memory.decisions
    ):  # the seed's own layouts and recomputation (Llama-3-8B f32): built and simulated once
        plan = dataclasses.replace(seed[2], solver=_stats(solution, problem))
        return plan, solution.choice, solution.objective
    plan = clock("build", build_plan, space, cluster, solution, problem, memory)
    return clock("simulate", _simulated, plan), solution.choice, solution.objective


SEED_PLAN = ("seed_plan",)
"""Key in ``Space.tables`` of the priced seed's (choice, recomputation, simulated plan)
(``solver/seed.py``): a solve that returns that same point reuses the plan, since
``build_plan`` and the simulator depend only on the layouts and the recomputation."""


def _reusable_step(space: Space, o: _Options, merges: list[bool]) -> tuple | None:
    """(problem, solution, memory) of the axis-search step that solved ``space``'s plain
    objective, when the finish's first variant is that same problem (merged or exact alike, no
    batch cap re-indexing the lists) and the step proved its optimum: solving it again gives
    the same objective, so the finish reuses it and solves only the other variant. Such a
    finish is not seeded from the hand-written strategies either: the step's optimum is a
    complete warm start that fits (Llama-3-8B on (2,4,8): 2.1 s of pricing them, and the plain
    variant's shrink, prune and solve, saved; docs/design.md, "Meshes of three and four
    axes")."""
    found, space.solved = space.solved, None
    if found is None or o.batch_split_limit is not None:
        return None
    merge, problem, solution, memory = found
    if merges[0] != merge or solution.status != "OPTIMAL":
        return None
    return problem, solution, memory


def _take_step(clock, space, cluster, step, variants, plans, chosen) -> list:  # type: ignore[no-untyped-def]
    """The variants left once ``step`` (``_reusable_step``), if any, is built as the first."""
    if step is None:
        return variants
    plans.append(_built(clock, space, cluster, *step))
    chosen.append(step[1].choice)
    return variants[1:]


def _prepare_one(candidate, merge, space, o, warm, memory, pool, left, shrunk):  # type: ignore[no-untyped-def]
    """(the variant's problem, prepared, its LP's future); a callable ``candidate`` makes it."""
    if callable(candidate):
        candidate = candidate()
    if id(candidate) not in shrunk:
        o.clock("shrink", shrink, candidate, space, o.share_layers, merge)
    prepared = o.clock("prune", prepare, candidate, warm, memory)
    return candidate, prepared, pool.submit(relax, prepared, max(1.0, left))


def _weighted(clock, problem: Problem, space: Space) -> Problem:  # type: ignore[no-untyped-def]
    """A copy of ``problem`` with overlap-weighted edge prices (``weight_edges``)."""
    weighted = clock("overlap", problem.copy)
    clock("overlap", weight_edges, weighted, space)
    return weighted


class FallbackWarning(UserWarning):
    """The solver found no plan in time; the plan is the best fitting hand-written strategy."""


def _fall_back(fallback, error: NoPlanInTime) -> Plan | None:
    """The fallback's plan, flagged (status ``FALLBACK``, no proven bound), with a warning."""
    found = fallback()
    if found is None:
        return None
    name, plan = found
    warnings.warn(
        f"{error}; returning the best fitting hand-written strategy {name!r} "
        f"({plan.step_time * 1e3:.1f} ms modelled) instead",
        FallbackWarning,
        stacklevel=3,
    )
    solver = dataclasses.replace(
        plan.solver, status="FALLBACK", objective=plan.step_time, bound=0.0, fallback=name
    )
    return dataclasses.replace(plan, solver=solver)


class _Once:
    """A memoised ``fallback``: the hand-written strategies are priced at most once."""

    def __init__(self, fn: Callable[[], tuple[str, Plan] | None]) -> None:
        self.fn, self.called, self.value = fn, False, None

    def set(self, value: tuple[str, Plan] | None) -> None:
        """The value, priced another way (``solver/seed.py``): ``fn`` is then never called."""
        self.value, self.called = value, True

    def __call__(self) -> tuple[str, Plan] | None:
        if not self.called:
            self.value, self.called = self.fn(), True
        return self.value


def _seed(space: Space, memory, found: tuple[str, Plan] | None) -> dict[int, int]:
    """A complete warm start from a baseline plan of the same graph: per node the strategy
    that consumes and produces the plan's layouts, and the plan's recomputation. Under a
    binding limit CP-SAT may otherwise find no point that fits in time (measured: a 2-layer
    model at 12 MiB on dp=2 x tp=4, UNKNOWN after 30 s)."""
    if found is None or found[1].mesh != space.mesh:
        return {}
    plan, graph, hints = found[1], space.graph, {}
    for k, value in enumerate(graph.inputs):
        wanted = plan.shardings.get(value.name)
        for s, strategy in enumerate(space.strategies[k]):
            if strategy.results and strategy.results[0] == wanted:
                hints[k] = s
                break
    for i, op in enumerate(graph.ops):
        node = space.op_node(i)
        operands = tuple(plan.operand_shardings.get((i, j)) for j in range(len(op.operands)))
        results = tuple(plan.shardings.get(r.name) for r in op.results)
        loose = None
        for s, strategy in enumerate(space.strategies[node]):
            if strategy.operands != operands:
                continue
            if tuple(strategy.results) == results:  # a pinned result: the pin, so loose
                hints[node] = s
                break
            loose = s if loose is None else loose
        else:
            if loose is not None:
                hints[node] = loose
    memory.hint_decisions = dict(plan.recompute) if memory.allow_recompute else None
    return hints


def _not_slower(best: Plan, found: tuple[str, Plan] | None) -> Plan:
    """The solver's plan unless the priced baseline is faster under the same simulator (the
    solver optimises a linear model of the step; the simulator can rank two plans otherwise)."""
    if found is None or found[1].step_time >= best.step_time:
        return best
    name, plan = found
    return dataclasses.replace(plan, solver=dataclasses.replace(best.solver, fallback=name))


class _Clock:
    """Accumulates wall seconds per planning phase (reported as ``plan.timings``) and logs each
    phase's end with what it found (``progress.py``: ``verbose=True``, on in the CLI)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def __call__(self, phase: str, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            result = fn(*args, **kwargs)
        finally:
            seconds = time.perf_counter() - start
            self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
        if progress.enabled() and (phase in _REPORTED or seconds >= 1.0):
            progress.report(phase, "%s (%.1f s)", _found(result), seconds)
        return result


_REPORTED = frozenset({"enumerate", "price", "seed", "solve", "simulate"})
"""Phases that always print a progress line; the others only when they take a second or more."""


def _found(result: object) -> str:
    """What a phase produced, in a few words for its progress line."""
    if isinstance(result, Space):
        lists = {id(s): len(s) for s in result.strategies}
        return (
            f"{len(result.graph.ops)} ops, {len(result.strategies)} decision nodes, "
            f"{sum(lists.values())} distinct strategies"
        )
    if isinstance(result, Problem):
        return f"{len(result.live_nodes())} live choices, {len(result.edge_table)} priced edges"
    if isinstance(result, Prepared):
        reduced = result.reduced
        return f"{len(reduced.live_nodes())} choices left, {len(reduced.edge_table)} edges"
    if isinstance(result, Solution):
        gap = 0.0 if result.objective <= 0 else max(0.0, 1 - result.bound / result.objective)
        return (
            f"{result.status}, objective {progress.seconds_text(result.objective)}, bound "
            f"{progress.seconds_text(result.bound)}, gap {gap:.2%}"
        )
    if isinstance(result, Plan):
        return f"step {progress.seconds_text(result.step_time)} modelled"
    return "done"


def _simulated(plan: Plan) -> Plan:
    """The plan with its exposed communication from the two-stream simulator."""
    result = simulate(plan)
    return dataclasses.replace(plan, exposed_comm_time=result.exposed_comm_time)


def _capped_hints(
    space: Space, hints: dict[int, int] | None, cap: int, clock, micro=True
) -> dict[int, int]:  # type: ignore[no-untyped-def]
    """Cap the batch split (fewer strategies per list) and re-index the warm start to match: a
    hinted strategy the cap removes is no longer hinted (it was an index into the old list).
    ``micro``: the cap of micro-batch sizes (``batch.cap_batch_split``)."""
    chosen = {n: space.strategies[n][s] for n, s in (hints or {}).items()}
    clock("enumerate", cap_batch_split, space, cap, micro)
    out = {}
    for n, strategy in chosen.items():
        found = next((i for i, t in enumerate(space.strategies[n]) if t is strategy), None)
        if found is not None:
            out[n] = found
    return out


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


def _merge_variants(o: _Options, space: Space, quick: bool, binds: bool) -> list[bool]:
    """Which of follower-merged (True) and exact (False) to solve (``MERGE_FOLLOWERS_ABOVE``,
    ``EXACT_UP_TO``); an axis-search step (``quick``) solves one: exact when the finish also
    solves exactly and nothing is pinned (merged steps steered the tiny HF Llama's free search
    to 1.5-5x slower plans; pinned runs keep merged steps and their plans: exact steps changed
    the pinned 1-layer JAX GPT's (2,2,2) plan to one whose collectives XLA runs otherwise)."""
    if o.merge_followers is not None:
        return [o.merge_followers]
    if quick:
        exact = False in _merge_variants(o, space, False, binds)
        return [False] if exact and not any(v.pinned for v in space.graph.values()) else [True]
    if len(space.graph.ops) <= MERGE_FOLLOWERS_ABOVE:
        return [True, False]  # small enough to also solve exactly
    looped = any(op.repeat != 1 for op in space.graph.ops)
    if not (binds or looped) and _shared_decisions(space, o.share_layers) <= EXACT_UP_TO:
        return [False]  # exact: eliminating chains keeps it about as small as merging would
    # Not under a binding memory limit (peak rows name nodes, so nothing is eliminated), nor
    # for scan bodies: the scanned GPT's exact plan runs one all-gather XLA inserts and the
    # plan does not predict (examples/jax_gpt.py --scan's check), so loops stay merged.
    return [True]


def _shared_decisions(space: Space, share_layers: bool) -> int:
    """Decision nodes left once repeated layers share variables (before follower merging)."""
    if share_layers and space.repeated is None:
        space.repeated = find_repeated_layers(space.graph)
    shared = space.repeated.num_shared if share_layers else 0  # type: ignore[union-attr]
    return len(space.strategies) - shared


def _hints(space: Space) -> dict[int, int]:
    """Warm start from annotations (pins and propagated hints) on graph inputs."""
    hints = {}
    for n, value in enumerate(space.graph.inputs):
        if value.sharding is None:
            continue
        for s, strategy in enumerate(space.strategies[n]):
            if strategy.results[0] == value.sharding:
                hints[n] = s
    return hints


def _check_memory_feasible(space: Space, problem: Problem, limit: float) -> None:
    """Fail early, with the minimum needed and the largest contributors, if nothing fits."""
    assert problem.memory is not None
    minimum = [float(m.min()) for m in problem.memory]
    if sum(minimum) <= limit:
        return
    ranked = sorted(range(space.num_inputs), key=lambda n: -minimum[n])[:5]
    top = ", ".join(f"%{space.graph.inputs[n].name} {_gib(minimum[n])}" for n in ranked)
    raise InfeasiblePlanError(
        f"the model's state does not fit: even fully sharded it needs {_gib(sum(minimum))} per "
        f"device but the limit is {_gib(limit)}. Largest: {top}. Use more devices, a larger "
        "memory_limit, or a smaller model"
    )


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.3f} GiB"


def build_plan(
    space: Space, cluster: Cluster, solution: Solution, problem: Problem, memory=None
) -> Plan:
    graph, mesh, choice = space.graph, space.mesh, solution.choice
    shardings: dict[str, Sharding] = {}
    for value in graph.values():
        shardings[value.name] = space.layout(value, choice)
    operand_shardings = {}
    assignments: dict[int, tuple] = {}
    reshards: list[Reshard] = []
    compute = 0.0
    vectors = _op_vectors(space, cluster)
    paths: dict = {}
    for i, op in enumerate(graph.ops):
        options = space.strategies[space.op_node(i)]
        strategy = options[choice[space.op_node(i)]]
        assignments[i] = strategy.assignment
        compute += float(vectors[i][choice[space.op_node(i)]])
        for k, result in enumerate(op.results):
            if pinned_result(result) is not None or result in space.reduce_once:
                produced = strategy.results[k]
                _record(
                    reshards,
                    result.name,
                    f"{'pin' if pinned_result(result) is not None else 'reduce'}:{result.name}",
                    produced,
                    shardings[result.name],
                    result,
                    mesh,
                    cluster,
                    paths,
                    op.repeat,
                )
        for j, value in enumerate(op.operands):
            operand_shardings[(i, j)] = strategy.operands[j]
            if (i, j) in space.fusion.edges:  # a reshard here breaks a fused chain
                src, dst = shardings[value.name], strategy.operands[j]
                compute += unfused_penalty(value.type, src, dst, mesh, cluster)
            _record(
                reshards,
                value.name,
                f"op:{i}:{j}",
                shardings[value.name],
                strategy.operands[j],
                value,
                mesh,
                cluster,
                paths,
                op.repeat,
            )
    outputs = []
    for j, value in enumerate(graph.outputs):
        src = shardings[value.name]
        alias = graph.output_aliases.get(j)
        if alias is not None:
            dst, label = shardings[graph.inputs[alias].name], f"alias:{j}"
        else:
            dst, label = (
                (value.sharding if value.pinned and value.sharding else src.without_partial()),
                f"output:{j}",
            )
        outputs.append(dst)
        _record(reshards, value.name, label, src, dst, value, mesh, cluster, paths)
    shared = shared_reshards(reshards)  # one buffer per (value, source, target): charged once
    comm = sum(r.time for r, leader in zip(reshards, shared, strict=True) if leader is None)
    if memory is not None:  # memory hook: the modelled peak, recomputation and its cost
        return _with_memory(
            space,
            solution,
            problem,
            memory,
            (shardings, operand_shardings, reshards, compute, comm, outputs, assignments),
        )
    memory = memory_breakdown(space, shardings)
    stats = _stats(solution, problem)
    return Plan(graph, mesh, shardings, operand_shardings, reshards, compute, comm,
                sum(memory.values()), memory, stats, outputs, assignments=assignments)  # fmt: skip


def _stats(solution: Solution, problem: Problem) -> SolverStats:
    return SolverStats(
        solution.status, solution.objective, solution.bound, solution.wall_time,
        solution.num_variables, len(problem.live_nodes()),
    )  # fmt: skip


def _op_vectors(space: Space, cluster: Cluster) -> list[np.ndarray]:
    """Per op, its seconds per strategy: the vectors ``build_problem`` priced (in
    ``space.tables``), looked up once per space and cluster (the op signature keys cost more
    than the lookups; a memory-bound plan builds two plans: the seed's and the solver's)."""
    key = op_vectors_key(space, cluster)
    found = space.tables.get(key)
    lists = space.strategies
    if (
        found is None
        or found[1] is not cluster
        or len(found[0]) != len(lists)
        or any(a is not b for a, b in zip(found[0], lists, strict=True))
    ):  # a new space or cluster, or lists replaced since (``cap_batch_split``)
        vectors = [
            op_costs(op, lists[space.op_node(i)], space, cluster, space.tables)
            for i, op in enumerate(space.graph.ops)
        ]
        found = space.tables[key] = (list(lists), cluster, vectors)
    return found[2]


def _with_memory(space, solution, problem, memory, parts) -> Plan:
    """Plan with the memory model's peak, breakdown and recomputation (memory hook)."""
    shardings, operand_shardings, reshards, compute, comm, outputs, assignments = parts
    profile = memory.profile(solution.choice)
    compute += memory.recompute_cost(solution.choice)
    stats = _stats(solution, problem)
    return Plan(space.graph, space.mesh, shardings, operand_shardings, reshards, compute, comm,
                profile.peak, dict(profile.by_category), stats, outputs,
                recompute=dict(memory.decisions), memory_limit=memory.limit,
                memory_profile=profile, assignments=assignments)  # fmt: skip


def _record(reshards, name, consumer, src, dst, value, mesh, cluster, paths, count=1) -> None:  # type: ignore[no-untyped-def]
    if src == dst:
        return
    key = (src, dst, value.type)
    if key not in paths:
        paths[key] = tuple(reshard(src, dst, value.type, mesh, cluster))
    reshards.append(Reshard(name, consumer, src, dst, paths[key], count))


def memory_breakdown(space: Space, shardings: dict[str, Sharding]) -> dict[str, int]:
    """Per-device bytes: persistent state by role plus the peak of live activations.

    Activations are live from their producer to their last use in graph order (v1 liveness;
    the memory issue refines this with the training schedule).
    """
    graph, mesh = space.graph, space.mesh
    by_role = {"parameters": 0, "optimizer_states": 0, "inputs": 0}
    key = {Role.PARAMETER: "parameters", Role.OPTIMIZER_STATE: "optimizer_states",
           Role.KV_CACHE: "kv_cache"}  # fmt: skip
    for v in graph.inputs:
        kind = key.get(v.role, "inputs")
        by_role[kind] = by_role.get(kind, 0) + v.type.nbytes // shardings[v.name].shard_count(mesh)
    last_use: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        for v in op.operands:
            last_use[v.name] = i
    for v in graph.outputs:
        last_use[v.name] = len(graph.ops)
    live, peak = 0, 0
    frees: dict[int, int] = {}
    for i, op in enumerate(graph.ops):
        for r in op.results:
            if cache_write(r):  # in place: the cache input's bytes
                continue
            size = r.type.nbytes // shardings[r.name].shard_count(mesh)
            live += size
            end = last_use.get(r.name, i)
            frees[end] = frees.get(end, 0) + size
        peak = max(peak, live)
        live -= frees.pop(i, 0)
    by_role["activations"] = peak
    return by_role


def evaluate_choice(space: Space, cluster: Cluster, choice: list[int]) -> float:
    """Modelled cost of a full assignment, recomputed from scratch (tests compare with the ILP)."""
    graph, mesh = space.graph, space.mesh
    total = 0.0
    for n, value in enumerate(graph.inputs):
        if value.role in PERSISTENT_ROLES:
            layout = space.strategies[n][choice[n]].results[0]
            total += input_cost(value.type.nbytes // layout.shard_count(mesh), cluster)
    for i, op in enumerate(graph.ops):
        strategy = space.strategies[space.op_node(i)][choice[space.op_node(i)]]
        total += op.repeat * op_cost(op, strategy, mesh, cluster, space.fusion.of(op))
        for k, result in enumerate(op.results):
            if (pin := pinned_result(result)) is not None or result in space.reduce_once:
                seen = seen_layout(strategy, k, pin)
                total += op.repeat * reshard_time(
                    strategy.results[k], seen, result.type, mesh, cluster
                )
        for j, value in enumerate(op.operands):
            src = space.layout(value, choice)
            moved = reshard_time(src, strategy.operands[j], value.type, mesh, cluster)
            if (i, j) in space.fusion.edges:
                moved += unfused_penalty(value.type, src, strategy.operands[j], mesh, cluster)
            total += op.repeat * moved
    for j, value in enumerate(graph.outputs):
        src = space.layout(value, choice)
        alias = graph.output_aliases.get(j)
        if alias is not None:
            dst = space.strategies[alias][choice[alias]].results[0]
        else:
            dst = src.without_partial()
        total += reshard_time(src, dst, value.type, mesh, cluster)
    return total


__all__ = ["build_plan", "evaluate_choice", "memory_breakdown", "plan_graph", "shrink"]
