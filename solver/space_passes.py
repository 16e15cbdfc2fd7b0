"""The planner's passes before the solve, run once per layout space: cap, price, memory model,
merge variants, warm start and overlap-weighted objective (``planner.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import ClassVar

from ..costmodel.exposure import weight_edges
from ..ir import InfeasiblePlanError
from ..passes.planner_registry import PlannerPass, Scope, register_planner_pass
from . import progress, shrinking
from .batch import cap_batch_split
from .cap_bound import CapCannotWin, op_time_bound
from .costs import Space, build_problem
from .memory_terms import build_memory_model
from .planner_state import PlanningState
from .problem import Problem
from .seed import price_baselines


class SpacePass(PlannerPass):
    """A pass run on each space the ``enumerate`` pass hands over (``state.space``)."""

    scope: ClassVar[Scope] = "space"


@register_planner_pass
class CapBatchSplit(SpacePass):
    """Cap the batch split at a pipeline's micro-batch (``batch_split_limit``; else nothing)."""

    name = "cap-batch-split"

    def apply(self, state: PlanningState) -> None:
        o = state.options
        if o.batch_split_limit is not None:
            state.hints = _capped_hints(
                state.space, state.hints, o.batch_split_limit, state.clock, o.micro_sizes
            )


@register_planner_pass
class Price(SpacePass):
    """Price every strategy and edge (``costs.build_problem``); fail early if nothing fits."""

    name = "price"

    def apply(self, state: PlanningState) -> None:
        space = state.space
        state.problem = state.clock("price", build_problem, space, state.cluster, state.limit)
        _check_cutoff(state, state.problem)
        _check_memory_feasible(space, state.problem, state.limit)


@register_planner_pass
class MemoryModel(SpacePass):
    """The memory model (peak rows, recomputation; ``solver/memory.py``) and whether it binds."""

    name = "memory-model"

    def apply(self, state: PlanningState) -> None:
        o, problem = state.options, state.need("problem", self.name, "price")
        state.memory = state.clock(
            "memory", build_memory_model, state.space, state.cluster, state.limit, o.recompute,
            o.activation_scale,
        )  # fmt: skip
        state.binds = not state.memory.cannot_bind(problem)


@register_planner_pass
class MergeVariants(SpacePass):
    """Which of follower-merged and exact to solve (``shrinking.merge_variants``)."""

    name = "merge-variants"

    def apply(self, state: PlanningState) -> None:
        state.merges = shrinking.merge_variants(
            state.options, state.space, state.quick, state.binds
        )


@register_planner_pass
class WarmStart(SpacePass):
    """The warm start: pins, hints, a reusable step, the best hand-written strategy.

    The hand-written strategies are priced only under a binding memory limit
    (``solver/seed.py``); an axis-search step proven optimal on this space is reused."""

    name = "warm-start"

    def apply(self, state: PlanningState) -> None:
        o, space, quick = state.options, state.space, state.quick
        state.warm = {**_hints(space), **(state.hints or {})}
        state.step = None if quick else _reusable_step(space, o, state.merges)
        seeded = (state.baseline is not None or o.lp_seed) and not quick and o.recompute is True
        state.seeded = seeded and state.step is None  # a step's optimum fits: it is the start
        if state.seeded and state.binds and state.baseline is not None:
            problem = state.need("problem", self.name, "price")
            seed = _seed_warm(state, problem, state.shrunk)
            state.warm = {**seed, **state.warm}


@dataclass(frozen=True, slots=True)
class OverlapOptions:
    """Options of the ``overlap`` pass."""

    lazy: bool = True
    """Make the weighted copy only when the solve reaches it, when a seeded memory-bound solve
    may stop at the plain variant (proven within the gap; 70B: 1 s)."""


@register_planner_pass
class Overlap(SpacePass):
    """The objectives: the plain one and an overlap-weighted copy.

    With the ``overlap`` option, a copy with overlap-weighted edge prices (gradient syncs and
    gathers mostly hidden; ``costmodel.simulate.edge_exposure``)."""

    name = "overlap"
    options_class = OverlapOptions

    def apply(self, state: PlanningState) -> None:
        problem = state.need("problem", self.name, "price")
        state.objectives = [problem]
        if state.options.overlap and not state.quick:
            weighted = partial(_weighted, state.clock, problem, state.space)
            # the weighted copy is made from ``problem``, which the plain variant leaves
            # unshrunk when it takes the seed's shrunk copy
            lazy = self.options.lazy and bool(state.shrunk) and state.merges == [True]
            state.objectives.append(weighted if lazy else weighted())


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


def _check_cutoff(state: PlanningState, problem: Problem) -> None:
    """Raise ``CapCannotWin`` when the ``cutoff`` option finds the space's op-time bound too
    high (not in an axis-search step: its plan only steers the search)."""
    o = state.options
    if o.cutoff is not None and not state.quick:
        bound = state.clock(
            "cutoff", op_time_bound, problem, state.space, state.cluster, o.time_limit,
            o.share_layers,
        )  # fmt: skip
        progress.report("cutoff", "the plans here spend >= %.2f s in ops", bound)
        if o.cutoff(bound):
            raise CapCannotWin(bound)


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


def _reusable_step(space: Space, o, merges: list[bool]) -> tuple | None:  # type: ignore[no-untyped-def]
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


def _seed_warm(state: PlanningState, problem: Problem, shrunk: list) -> dict:
    """The warm start from the best fitting hand-written strategy, priced once on ``problem``
    (not one plan_graph per strategy); the pricing's shrunk copy of ``problem`` goes to
    ``shrunk`` (the plain variant's shrink is the same)."""
    o, space, baseline = state.options, state.space, state.baseline
    if not baseline.called:  # type: ignore[union-attr]
        merged = partial(
            shrinking.shrink, space=space, share_layers=o.share_layers, merge_followers=True
        )
        found = state.clock("seed", price_baselines, space, problem, state.memory,
                            state.cluster, lambda p: merged(p) or shrunk.append(p),
                            o.time_limit)  # fmt: skip
        baseline.set(found)  # type: ignore[union-attr]
    return state.clock("seed", _seed, space, state.memory, baseline())  # type: ignore[misc]


def _seed(space: Space, memory, found) -> dict[int, int]:  # type: ignore[no-untyped-def]
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
        found_at = _seed_strategy(space, node, plan, i, op)
        if found_at is not None:
            hints[node] = found_at
    memory.hint_decisions = dict(plan.recompute) if memory.allow_recompute else None
    return hints


def _seed_strategy(space: Space, node: int, plan, i: int, op) -> int | None:  # type: ignore[no-untyped-def]
    """The strategy of ``node`` that consumes the plan's operand layouts of op ``i`` and
    produces its result layouts, else the first that consumes them (a pinned result)."""
    operands = tuple(plan.operand_shardings.get((i, j)) for j in range(len(op.operands)))
    results = tuple(plan.shardings.get(r.name) for r in op.results)
    loose = None
    for s, strategy in enumerate(space.strategies[node]):
        if strategy.operands != operands:
            continue
        if tuple(strategy.results) == results:  # a pinned result: the pin, so loose
            return s
        loose = s if loose is None else loose
    return loose


def _weighted(clock, problem: Problem, space: Space) -> Problem:  # type: ignore[no-untyped-def]
    """A copy of ``problem`` with overlap-weighted edge prices (``weight_edges``)."""
    weighted = clock("overlap", problem.copy)
    clock("overlap", weight_edges, weighted, space)
    return weighted
