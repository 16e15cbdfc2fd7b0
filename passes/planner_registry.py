"""Planner passes: objects with a name, options and one ``apply(state)``, and their name table.

The planner (``solver/planner.py``) is a pipeline of these, as xDSL's ``ModulePass`` and its
name -> pass table: ``"annotate,enumerate,price,...,compare-baseline"``. A pass of scope
``"space"`` runs once per solved layout space (a 3-axis mesh's axis search solves several);
one of scope ``"graph"`` runs once per planning call. Registered graph passes
(``register_pass``: ``propagate``, ...) may appear in a planner pipeline too: they run on the
state's graph. The state's type lives in the solver (``solver/planner_state.py``); this layer
only names and parses passes.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

from shardplan.ir.errors import ArgumentError, ShardplanError

from .manager import _NAME, NoOptions, PassInfo, PassSpec, get_pass, list_passes, pipeline_entries
from .manager import parse_options as _parse_options

Scope = Literal["graph", "space"]


class PlannerPass(abc.ABC):
    """One planner stage. Subclasses set ``name`` (kebab-case), ``scope``, ``options_class``
    (a frozen dataclass, all fields defaulted) and implement ``apply(state)``, which reads and
    writes the planning state (``solver.planner_state.PlanningState``).

    Invariants:
      - ``options`` is an instance of ``options_class``.
      - ``str(p)`` is its pipeline text: ``name{field=value ...}`` with non-default fields.
    """

    name: ClassVar[str] = ""
    scope: ClassVar[Scope] = "graph"
    options_class: ClassVar[type] = NoOptions
    runs_on_error: ClassVar[bool] = False
    """Whether the pass runs after the solver found no plan in time (``fallback`` does)."""

    def __init__(self, options: Any = None) -> None:
        if options is None:
            options = self.options_class()
        if not isinstance(options, self.options_class):
            got = type(options).__name__
            raise ArgumentError(
                f"pass {self.name!r} takes {self.options_class.__name__} options, got {got}"
            )
        self.options = options

    def with_options(self, options: Any) -> PlannerPass:
        """A copy of this pass with other options (checked as the constructor checks them)."""
        made = copy.copy(self)
        PlannerPass.__init__(made, options)
        return made

    @abc.abstractmethod
    def apply(self, state: Any) -> None:
        """Run the pass on ``state`` (a ``PlanningState``), in place."""

    def __str__(self) -> str:
        return str(PassSpec(self.name, self.options))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options!r})"


class GraphPassStage(PlannerPass):
    """A registered graph pass (``register_pass``) run on the planning state's graph."""

    scope: ClassVar[Scope] = "graph"

    def __init__(self, info: PassInfo, options: Any = None) -> None:
        self.info = info
        self.name = info.name  # type: ignore[misc]  # per instance: the wrapped pass's name
        self.options_class = info.options  # type: ignore[misc]
        super().__init__(options)

    def apply(self, state: Any) -> None:
        result = self.info.fn(state.graph, self.options)
        if result is not None and result is not state.graph:
            raise ArgumentError(
                f"graph pass {self.name!r} returned a new graph; in a planner pipeline a graph "
                "pass must edit the state's graph in place (the plan refers to it)"
            )


def _unused(graph: Any, options: Any) -> None:
    """The function slot of a ``PassInfo`` made only to parse a planner pass's options."""


_PLANNER_PASSES: dict[str, type[PlannerPass]] = {}


def register_planner_pass(cls: type[PlannerPass]) -> type[PlannerPass]:
    """Class decorator: register a ``PlannerPass`` subclass under its ``name``."""
    if not _NAME.match(cls.name):
        raise ArgumentError(
            f"planner pass name {cls.name!r} must be kebab-case, like 'price-collectives'"
        )
    if not dataclasses.is_dataclass(cls.options_class):
        raise ArgumentError(
            f"options of planner pass {cls.name!r} must be a frozen dataclass, got "
            f"{cls.options_class!r}"
        )
    _PLANNER_PASSES[cls.name] = cls
    return cls


def list_planner_passes() -> list[str]:
    """Names of the registered planner passes, sorted."""
    return sorted(_PLANNER_PASSES)


def _known() -> str:
    planner = ", ".join(list_planner_passes()) or "(none)"
    graph = ", ".join(n for n in list_passes() if n not in _PLANNER_PASSES) or "(none)"
    return f"planner passes: {planner}; graph passes: {graph}"


def planner_pass(name: str, options: Any = None) -> PlannerPass:
    """The pass registered as ``name`` (snake_case accepted) with ``options``: a planner pass,
    else a graph pass run on the state's graph; an unknown name lists the known ones."""
    key = name.strip().replace("_", "-")
    cls = _PLANNER_PASSES.get(key)
    if cls is not None:
        return cls(options)
    try:
        info = get_pass(key)
    except ShardplanError:
        raise ArgumentError(f"unknown pass {name!r}; {_known()}") from None
    return GraphPassStage(info, options)


def parse_planner_pipeline(text: str) -> list[PlannerPass]:
    """Parse ``"annotate,enumerate,price{...},..."`` into planner pass objects."""
    passes = []
    for name, options in pipeline_entries(text, error=ArgumentError):
        made = planner_pass(name)
        if options is not None:
            info = PassInfo(made.name, _unused, made.options_class, "")
            made = made.with_options(_parse_options(info, options))
        passes.append(made)
    if not passes:
        raise ArgumentError(f"empty pipeline {text!r}; {_known()}")
    return passes


PipelineLike = str | Sequence["str | PlannerPass | PassSpec"]


def normalize_planner_pipeline(pipeline: PipelineLike) -> list[PlannerPass]:
    """Pass objects from a pipeline string or a list of names, pass objects, pipeline strings
    and ``PassSpec``s (a name with its options object)."""
    if isinstance(pipeline, str):
        return parse_planner_pipeline(pipeline)
    passes: list[PlannerPass] = []
    for entry in pipeline:
        if isinstance(entry, PlannerPass):
            passes.append(entry)
        elif isinstance(entry, PassSpec):
            passes.append(planner_pass(entry.name, entry.options))
        elif isinstance(entry, str):
            passes.extend(parse_planner_pipeline(entry))
        else:
            raise ArgumentError(
                f"a pipeline entry must be a pass name, a PlannerPass or a PassSpec, got "
                f"{type(entry).__name__}: {entry!r}"
            )
    if not passes:
        raise ArgumentError(f"empty pipeline; {_known()}")
    return passes


def pipeline_text(passes: Sequence[PlannerPass]) -> str:
    """The pipeline as text (options that differ from their defaults only)."""
    return ",".join(str(p) for p in passes)
