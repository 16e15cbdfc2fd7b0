"""The planner's graph-level passes (annotate, enumerate, fallback, compare-baseline) and the
default pipeline, the one definition both ``plan_graph`` and ``--print-passes`` use."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

from ..passes.annotate import annotate
from ..passes.planner_registry import (
    GraphPassStage,
    PlannerPass,
    pipeline_text,
    planner_pass,
    register_planner_pass,
)
from . import axis_search as axis_search_module
from . import solve_pass, space_passes  # noqa: F401  (importing them registers their passes)
from .axis_search import AXIS_SEARCH_FROM, live_axes
from .batch import micro_rules
from .costs import Space, build_space
from .plan import Plan
from .planner_state import FallbackWarning, NoPlanInTime, PlanningState

DEFAULT_PIPELINE = (
    "annotate", "enumerate", "cap-batch-split", "price", "memory-model", "merge-variants",
    "warm-start", "overlap", "solve", "choose", "fallback", "compare-baseline",
)  # fmt: skip
"""The planner as ``sp.plan`` runs it: ``annotate`` and ``enumerate`` once, the passes from
``cap-batch-split`` to ``choose`` once per layout space (one on one- and two-axis meshes; the
axis search's start and steps on three or more), then ``fallback`` and ``compare-baseline``."""


def default_pipeline() -> list[PlannerPass]:
    """Fresh pass objects of ``DEFAULT_PIPELINE`` (default options)."""
    return [planner_pass(name) for name in DEFAULT_PIPELINE]


def default_pipeline_text() -> str:
    """``DEFAULT_PIPELINE`` as a pipeline string (``shardplan plan --print-passes``)."""
    return pipeline_text(default_pipeline())


def describe_pipeline(passes: list[PlannerPass]) -> str:
    """The pipeline string, then one line per pass: its name, scope and summary."""
    lines = [pipeline_text(passes)]
    for stage in passes:
        summary = (type(stage).__doc__ or "").strip().splitlines()
        if isinstance(stage, GraphPassStage):
            summary = [stage.info.summary]
        lines.append(f"  {stage.name:<18} {stage.scope:<6} {summary[0] if summary else ''}")
    return "\n".join(lines)


@register_planner_pass
class Annotate(PlannerPass):
    """Apply the options' pins to the graph's values (``passes/annotate.py``)."""

    name = "annotate"

    def apply(self, state: PlanningState) -> None:
        if state.options.pins:
            annotate(state.graph, state.options.pins)


@register_planner_pass
class Enumerate(PlannerPass):
    """Enumerate each op's strategies: the layout spaces the space passes solve.

    One space on one- and two-axis meshes (``costs.build_space``), the axis search's start and
    neighbourhoods on three or more (``solver/axis_search.py``)."""

    name = "enumerate"

    def apply(self, state: PlanningState) -> None:
        o, graph = state.options, state.graph
        sized = o.batch_split_limit is not None and o.micro_sizes  # a pipeline's cap
        state.rules = micro_rules(graph, o.batch_split_limit) if sized else None  # type: ignore[arg-type]
        if len(live_axes(state.mesh)) >= AXIS_SEARCH_FROM:
            state.spaces = _AxisSearch()
            return
        space = state.clock(
            "enumerate", build_space, graph, state.mesh, o.semantics, rules=state.rules
        )
        state.spaces = _OneSpace(space)


class _OneSpace:
    """The one space of a one- or two-axis mesh."""

    def __init__(self, space: Space) -> None:
        self.space = space

    def run(self, state: PlanningState, plan_space: Callable) -> Plan:
        best, _, _ = plan_space(self.space)
        return best


class _AxisSearch:
    """The axis search's spaces (``solver/axis_search.py``), each solved by the space passes."""

    def run(self, state: PlanningState, plan_space: Callable) -> Plan:
        return axis_search_module.axis_search(
            state.graph, state.mesh, state.options.semantics, plan_space, state.rules
        )


@register_planner_pass
class Fallback(PlannerPass):
    """No plan in time: return the best fitting hand-written strategy instead.

    That strategy comes from the ``fallback`` option, with a ``FallbackWarning`` and status
    ``FALLBACK``; without one the solver's error is raised."""

    name = "fallback"
    runs_on_error = True

    def apply(self, state: PlanningState) -> None:
        if state.error is None or state.baseline is None:
            return
        found = state.baseline()
        if found is None:
            return
        name, plan = found
        warnings.warn(
            f"{state.error}; returning the best fitting hand-written strategy {name!r} "
            f"({plan.step_time * 1e3:.1f} ms modelled) instead",
            FallbackWarning,
            stacklevel=7,  # the caller of plan_graph (sp.plan)
        )
        solver = dataclasses.replace(
            plan.solver, status="FALLBACK", objective=plan.step_time, bound=0.0, fallback=name
        )
        state.plan, state.error = dataclasses.replace(plan, solver=solver), None


@register_planner_pass
class CompareBaseline(PlannerPass):
    """Keep the solver's plan unless the priced hand-written strategy simulates faster.

    The solver optimises a linear model of the step; the simulator can rank two plans
    otherwise."""

    name = "compare-baseline"

    def apply(self, state: PlanningState) -> None:
        baseline, best = state.baseline, state.plan
        if baseline is None or not baseline.called or best is None:
            return
        if best.solver.status == "FALLBACK":
            return
        found = baseline()
        if found is None or found[1].step_time >= best.step_time:
            return
        name, plan = found
        solver = dataclasses.replace(best.solver, fallback=name)
        state.plan = dataclasses.replace(plan, solver=solver)


__all__ = [
    "DEFAULT_PIPELINE", "NoPlanInTime", "default_pipeline", "default_pipeline_text",
    "describe_pipeline",
]  # fmt: skip
