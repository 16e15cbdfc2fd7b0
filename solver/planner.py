"""plan_graph: the planner as a pipeline of registered passes over one planning state.

The default pipeline (``planner_passes.DEFAULT_PIPELINE``; ``shardplan plan --print-passes``)
annotates the pins, enumerates the layout spaces, and per space caps, prices, builds the memory
model, picks the merge variants and the warm start, solves with CP-SAT, builds and simulates
each plan and keeps the fastest; then falls back to, or compares with, the best hand-written
strategy. ``plan_graph(..., passes=...)`` runs another pipeline (``passes/planner_registry.py``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from ..costmodel import cluster_of
from ..ir import Graph, Mesh
from ..ir.errors import ArgumentError
from ..passes.planner_registry import PipelineLike, PlannerPass, normalize_planner_pipeline
from .build import build_plan, evaluate_choice, memory_breakdown
from .plan import Plan
from .planner_passes import DEFAULT_PIPELINE, default_pipeline, default_pipeline_text
from .planner_state import (
    Clock,
    FallbackWarning,
    NoPlanInTime,
    Once,
    PlannerOptions,
    PlanningState,
)
from .shrinking import EXACT_UP_TO, MERGE_FOLLOWERS_ABOVE, shrink, tie_loop_carries

STEP_WORK = 1.0
"""CP-SAT deterministic-time cap of one axis-search step (``solver/axis_search.py``): a step is
warm-started by its incumbent, so stopping early loses little, and the cap does not depend on
how busy the machine is (planning stays deterministic)."""


def plan_graph(
    graph: Graph,
    mesh: Mesh,
    options: PlannerOptions | None = None,
    *,
    passes: PipelineLike | None = None,
    **fields: object,
) -> Plan:
    """Choose a layout for every value of ``graph`` on ``mesh`` minimising modelled step time.

    Args:
      graph: the captured step; its pins are applied in place and ``graph.mesh`` is set to
        ``mesh`` (passes after planning read it: ``propagate``, the printer, ``verify``).
      mesh: the device mesh; its cluster is resolved once, here.
      options: what is asked for (``PlannerOptions``); ``fields`` are the same fields as
        keywords (``plan_graph(g, mesh, pins=..., time_limit=10)``), over ``options``.
      passes: the pipeline to run (a pipeline string, or names, ``PlannerPass`` objects and
        ``PassSpec``s); default ``DEFAULT_PIPELINE``.
    Returns:
      the plan; ``plan.timings`` has each phase's seconds and, as ``"pass:<name>"``, each
      pass's, in the order the passes ran.
    """
    options = planner_options(options, fields)
    pipeline = default_pipeline() if passes is None else normalize_planner_pipeline(passes)
    graph.mesh = mesh
    cluster = cluster_of(mesh)
    limit = options.memory_limit if options.memory_limit is not None else cluster.hbm_capacity
    baseline = Once(options.fallback) if options.fallback is not None else None
    state = PlanningState(graph, mesh, options, cluster, limit, Clock(), baseline)
    best = run_planner(state, pipeline)
    timings = {**state.clock.seconds, **{f"pass:{n}": s for n, s in state.ran.items()}}
    return dataclasses.replace(best, timings=timings)


def planner_options(options: PlannerOptions | None, fields: dict) -> PlannerOptions:
    """``options`` with ``fields`` replaced (a bad field name says which ones exist)."""
    known = {f.name for f in dataclasses.fields(PlannerOptions)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ArgumentError(
            f"plan_graph got unknown option(s) {', '.join(unknown)}; PlannerOptions fields: "
            f"{', '.join(sorted(known))}"
        )
    if options is None:
        return PlannerOptions(**fields)  # type: ignore[arg-type]
    if not isinstance(options, PlannerOptions):
        raise ArgumentError(
            f"plan_graph's third argument is a PlannerOptions, got {type(options).__name__}; "
            "pass planner options by keyword (pins=..., memory_limit=...)"
        )
    return dataclasses.replace(options, **fields) if fields else options


def run_planner(state: PlanningState, passes: Sequence[PlannerPass]) -> Plan:
    """Run ``passes`` on ``state``: graph passes in order, each run of space passes on every
    space the ``enumerate`` pass hands over. After the solver found no plan in time only
    passes that run on errors (``fallback``) run; the error is raised if none made a plan."""
    index = 0
    while index < len(passes):
        if passes[index].scope == "space":
            end = index
            while end < len(passes) and passes[end].scope == "space":
                end += 1
            _run_spaces(state, passes[index:end])
            index = end
            continue
        if state.error is None or passes[index].runs_on_error:
            _timed(state, passes[index])
        index += 1
    if state.error is not None:
        raise state.error
    if state.plan is None:
        raise ArgumentError(
            f"the pipeline {','.join(p.name for p in passes)!r} made no plan: it needs "
            "'enumerate' and the space passes up to 'choose' (the default: "
            "shardplan plan --print-passes)"
        )
    return state.plan


def _run_spaces(state: PlanningState, body: Sequence[PlannerPass]) -> None:
    """Run ``body`` (space passes) on each space ``state.spaces`` solves; the plan it returns
    is ``state.plan``."""
    if state.error is not None:
        return
    spaces = state.need("spaces", body[0].name, "enumerate")

    def plan_space(space, hints=None, share=1.0, quick=False, work=STEP_WORK):  # type: ignore[no-untyped-def]
        """Price, shrink and solve one space (``axis_search.PlanSpace``): (its plan, None
        when ``quick``; its choice; its solver objective)."""
        state.enter_space(space, hints, share, quick, work)
        for stage in body:
            _timed(state, stage)
        return state.need("result", body[-1].name, "choose")

    try:
        state.plan = spaces.run(state, plan_space)
    except NoPlanInTime as error:
        state.error = error


def _timed(state: PlanningState, stage: PlannerPass) -> None:
    start = time.perf_counter()
    try:
        stage.apply(state)
    finally:
        state.ran[stage.name] = state.ran.get(stage.name, 0.0) + time.perf_counter() - start


__all__ = [
    "DEFAULT_PIPELINE", "EXACT_UP_TO", "MERGE_FOLLOWERS_ABOVE", "STEP_WORK", "FallbackWarning",
    "NoPlanInTime", "PlannerOptions", "build_plan", "default_pipeline", "default_pipeline_text",
    "evaluate_choice", "memory_breakdown", "plan_graph", "planner_options", "run_planner",
    "shrink", "tie_loop_carries",
]  # fmt: skip
