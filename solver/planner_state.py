"""The planner's options object and the state its passes read and write (``planner.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..costmodel.cluster import Cluster
from ..ir import Graph, Mesh, ShardingRule
from ..ir.errors import ArgumentError, NoPlanInTime
from . import progress
from .costs import PartialSemantics, Space
from .ilp import Prepared, Solution
from .plan import Plan
from .problem import Problem

if TYPE_CHECKING:
    from ..ir import Sharding
    from .memory import MemoryModel


@dataclass(frozen=True, slots=True)
class PlannerOptions:
    """What ``plan_graph`` is asked for (every field has the default ``sp.plan`` uses).

    Invariants: read-only for every pass; what a pass derives goes on the ``PlanningState``.
    """

    pins: Mapping[str, Sharding] | None = None
    """Value name or origin path -> required sharding (``passes/annotate.py``)."""
    memory_limit: float | None = None
    """Per-device bytes the modelled peak must fit (default: the cluster's device memory);
    persistent state plus live activations (``solver/memory.py``)."""
    time_limit: float = 30.0
    """Solver budget in seconds of CP-SAT deterministic time (``ilp.py``)."""
    merge_followers: bool | None = None
    """True or False: solve with or without follower merging (``passes/merge_followers.py``);
    None: merged, and graphs of at most ``MERGE_FOLLOWERS_ABOVE`` ops also exactly; the
    simulator picks among them."""
    share_layers: bool = True
    """Repeated layers share one set of solver variables (``passes/repeated_layers.py``)."""
    recompute: bool | dict[str, str | None] = True
    """True lets the solver recompute layers, False forbids it, a dict fixes it."""
    overlap: bool = True
    """Also solve with overlap-aware edge prices (``costmodel.simulate.edge_exposure``) and keep
    whichever plan the two-stream simulator finds faster."""
    semantics: PartialSemantics | None = None
    """How the target runtime treats pending sums (frontends declare it)."""
    activation_scale: float = 1.0
    """Scale of the activations' bytes in the memory model (a pipeline stage's share)."""
    batch_split_limit: int | None = None
    """Every op's layouts hold on a micro-batch of this many samples (a pipeline's cap;
    ``solver/batch.py``)."""
    fallback: Callable[[], tuple[str, Plan] | None] | None = None
    """Called when the solver finds no plan in time (not when none fits): ``(name, plan)`` of
    the best fitting hand-written strategy, returned with a warning and status ``FALLBACK``."""
    lp_seed: bool = False
    """When the limit binds and no hand-written strategy seeds the solve, the LP's layouts
    with every layer fully recomputed are the seed (``ilp.solve``'s ``lp_seed``)."""
    memory_search: bool = True
    """False: a seeded memory-bound solve keeps its seed's or the primal heuristic's point
    instead of running CP-SAT's capped search (a pipeline's sub-mesh solves)."""
    cutoff: Callable[[float], bool] | None = None
    """Given a lower bound on the op time of every plan a space can return
    (``solver/cap_bound.py``), True raises ``CapCannotWin`` before that space is solved."""
    micro_sizes: bool = True
    """With ``batch_split_limit``: enumerate by micro-batch sizes (False: the whole-batch
    space filtered by the cap)."""


class FallbackWarning(UserWarning):
    """The solver found no plan in time; the plan is the best fitting hand-written strategy."""


@dataclass(eq=False, slots=True)
class PlanningState:
    """What the planner's passes share: the inputs, the options, and what each pass found.

    Invariants: ``graph``, ``mesh``, ``options`` and ``cluster`` (resolved once,
    ``cluster_of(mesh)``) do not change during a run. The space fields (``space`` to ``result``)
    belong to the space being solved and are reset before each (``enter_space``).
    """

    graph: Graph
    mesh: Mesh
    options: PlannerOptions
    cluster: Cluster
    limit: float
    """The memory limit in bytes (the option, or the cluster's device memory)."""
    clock: Clock
    baseline: Once | None = None
    """The best fitting hand-written strategy, priced once: the memory-bound solve's warm
    start, the fallback, and the plan returned if the solver's is slower."""
    rules: Mapping[int, ShardingRule] | None = None
    """Per-op rules of a pipeline's micro-batch sizes (``batch.micro_rules``), or None."""
    spaces: Any = None
    """Set by ``enumerate``: runs the space passes on each space it solves (``run(body)``)."""
    plan: Plan | None = None
    error: NoPlanInTime | None = None
    """The solver found no plan in time; ``fallback`` may replace it by a plan."""
    ran: dict[str, float] = field(default_factory=dict)
    """Pass name -> seconds, in the order the passes first ran (``plan.timings``)."""
    # -- the space being solved (``enter_space``) --
    space: Space | None = None
    hints: dict[int, int] | None = None
    share: float = 1.0
    quick: bool = False
    work: float = 1.0
    problem: Problem | None = None
    memory: MemoryModel | None = None
    binds: bool = False
    merges: list[bool] = field(default_factory=lambda: [True])
    warm: dict[int, int] = field(default_factory=dict)
    step: tuple | None = None
    seeded: bool = False
    shrunk: list[Problem] = field(default_factory=list)
    objectives: list | None = None
    plans: list[tuple[Plan, list[int], float]] = field(default_factory=list)
    result: tuple[Plan | None, list[int], float] | None = None
    """(the space's plan, its choice, its solver objective): what the space passes return."""

    def enter_space(self, space: Space, hints, share: float, quick: bool, work: float) -> None:  # type: ignore[no-untyped-def]
        """Start on ``space``: forget what the space passes found on the previous one."""
        self.space, self.hints, self.share, self.quick, self.work = (
            space, hints, share, quick, work
        )  # fmt: skip
        self.problem = self.memory = self.step = self.objectives = self.result = None
        self.binds = self.seeded = False
        self.merges, self.warm, self.shrunk, self.plans = [True], {}, [], []

    def need(self, name: str, by: str, after: str) -> Any:
        """``getattr(self, name)``, or an error saying which pass must run before ``by``."""
        found = getattr(self, name)
        if found is None:
            raise ArgumentError(
                f"planner pass {by!r} needs the {name} that {after!r} makes; put {after!r} "
                f"before {by!r} in the pipeline (the default: shardplan plan --print-passes)"
            )
        return found


class Clock:
    """Accumulates wall seconds per planning phase (reported as ``plan.timings``) and logs each
    phase's end with what it found (``progress.py``: ``verbose=True``, on in the CLI)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def __call__(self, phase: str, fn, *args, **kwargs):  # type: ignore[no-untyped-def]
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


class Once:
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
