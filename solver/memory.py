"""Memory of a training step as solver terms: the model the ILP and the Plan read (terms, exact
peaks, recomputation decisions) and the error when no layout fits.

Every value contributes a *term*: bytes per strategy of one decision node, live over an interval
of op indices (``passes/liveness.py``). A graph input is held in its own layout all step. An op
result is kept in the layout its *last reader* consumes it in — a partial gradient reduced
right away into the layout of the update that reads it (DDP keeps it whole, ZeRO-2 keeps a
shard), a forward activation in the layout its backward use wants. Copies made for one op only
(an all-gather before a matmul) are transient and not counted.

The terms of a graph are built in ``memory_terms.py``; the model's CP-SAT rows (reduced time
points, recomputation variables) are added by ``memory_rows.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..costmodel.memory import MemoryItem, MemoryProfile, gib, memory_profile
from ..ir import InfeasiblePlanError
from ..passes.liveness import Liveness
from .costs import Space
from .memory_rows import MemoryRows
from .problem import Problem

if TYPE_CHECKING:  # imported where a search runs (solver/ilp.py: it pulls in pandas)
    from ortools.sat.python import cp_model


@dataclass(frozen=True, slots=True)
class Term:
    """``nbytes[s]`` per device while node ``node`` takes strategy ``s``, over [start, stop]."""

    label: str
    category: str
    start: int
    stop: int
    node: int
    nbytes: np.ndarray
    freed_by: tuple[str, str] | None = None
    """(layer, mode class): recomputing that layer in that mode (or ``full``) drops the term."""


def frees(decision: str | None, mode_class: str) -> bool:
    """Whether a layer recomputed with ``decision`` frees values of ``mode_class``."""
    return decision == "full" or (decision == "selective" and mode_class == "selective")


@dataclass(eq=False)
class LagrangeTrace:
    """What the Lagrangian bound (``solver/lagrange.py``) learnt on one memory model's
    problems, for the next call and for the primal heuristic (``solver/recompute.py``)."""

    multipliers: dict[int, float] = field(default_factory=dict)
    """Time point -> the multiplier that gave its best bound (0: none raised it); the
    planner's variants of one solve share the model and differ little."""
    points: list[list[int]] = field(default_factory=list)
    """Each distinct LP minimiser's layouts (one strategy per node), in the order found."""
    seen: set[tuple[int, ...]] = field(default_factory=set)

    def remember(self, choice: list[int]) -> None:
        key = tuple(choice)
        if key not in self.seen:
            self.seen.add(key)
            self.points.append(list(choice))


@dataclass(eq=False)
class MemoryModel:
    """The memory side of one planning problem (built once, read by the ILP and the Plan)."""

    space: Space
    live: Liveness
    terms: list[Term]
    limit: float | None
    recompute_ops: dict[tuple[str, str], list[tuple[int, np.ndarray]]]
    """(layer, mode) -> (node, compute seconds per strategy) of the ops it re-runs."""
    forced: dict[str, str | None] | None = None
    """Layer -> fixed decision (hand-written strategies); None lets the solver choose."""
    allow_recompute: bool = True
    decisions: dict[str, str] = field(default_factory=dict)
    """Layer -> mode of the last solution (empty: nothing recomputed)."""
    hint_decisions: dict[str, str] | None = None
    """Layer -> mode of a warm start (the seed's recomputation); None: hint full everywhere."""
    derived: dict = field(default_factory=dict, repr=False)
    """What depends only on ``terms`` (the peak table, the worst-case peak), computed once:
    ``dataclasses.replace`` copies share it, so the seed's forced models (``solver/seed.py``)
    do not rebuild it per strategy (0.1-0.4 s each on Llama-3-70B)."""
    lagrange: LagrangeTrace = field(default_factory=LagrangeTrace, init=False, repr=False)
    """What the Lagrangian bound found on this model's problems (``solver/lagrange.py``); a
    ``replace`` copy starts empty."""

    # -- exact evaluation ------------------------------------------------------------------
    def items(self, choice: list[int], decisions: dict[str, str] | None = None) -> list:
        decisions = self.decisions if decisions is None else decisions
        out = []
        for t in self.terms:
            if t.freed_by is not None and frees(decisions.get(t.freed_by[0]), t.freed_by[1]):
                continue
            out.append(
                MemoryItem(t.label, t.category, t.start, t.stop, int(t.nbytes[choice[t.node]]))
            )
        return out

    def profile(self, choice: list[int], decisions: dict[str, str] | None = None) -> MemoryProfile:
        return memory_profile(self.items(choice, decisions), self.live.end)

    def peak(self, choice: list[int], decisions: dict[str, str] | None = None) -> tuple[int, int]:
        """``(profile.peak, profile.peak_time)`` without building the items (numpy): the
        memory-bound path asks for it 20-30 times per plan (6-12 s of 70B's as ``profile``)."""
        return self.peaks(choice)(self.decisions if decisions is None else decisions)

    def peaks(self, choice: list[int]):  # type: ignore[no-untyped-def]
        """``decisions -> peak(choice, decisions)`` with the choice's bytes looked up once (the
        recomputation heuristic, ``solver/recompute.py``, asks for dozens per layout)."""
        table = self._peak_table()
        chosen = table.nbytes[table.rows, np.asarray(choice, dtype=np.int64)[table.nodes]]
        size = self.live.end + 2

        def peak(decisions: dict[str, str]) -> tuple[int, int]:
            values = chosen
            dropped = [index for (layer, cls), index in table.freed.items()
                       if frees(decisions.get(layer), cls)]  # fmt: skip
            if dropped:
                values = chosen.copy()
                values[np.concatenate(dropped)] = 0
            # float64 bins are exact here: every partial sum is far below 2**53 bytes
            weights = values.astype(np.float64)
            delta = np.bincount(table.starts, weights, size) - np.bincount(
                table.stops + 1, weights, size
            )
            live = np.cumsum(delta.astype(np.int64)[: self.live.end + 1])
            if len(live) == 0 or live.max() <= 0:
                return 0, 0
            at = int(np.argmax(live))  # the first maximum: ties go to the earliest point
            return int(live[at]), at

        return peak

    def _peak_table(self) -> _PeakTable:
        table = self.derived.get("peak_table")
        if table is None or table.terms is not self.terms:
            table = self.derived["peak_table"] = _PeakTable.of(self.terms, self.live.end)
        return table

    def _worst_peak(self) -> int:
        """The peak with every term at its largest (at the point where those sum highest)."""
        worst = self.derived.get("worst_peak")
        if worst is None or worst[0] is not self.terms:
            items = [MemoryItem(t.label, t.category, t.start, t.stop, int(t.nbytes.max()))
                     for t in self.terms]  # fmt: skip
            worst = self.derived["worst_peak"] = (
                self.terms,
                memory_profile(items, self.live.end).peak,
            )
        return worst[1]

    def fixed_decisions(self) -> dict[str, str]:
        return {k: v for k, v in (self.forced or {}).items() if v}

    def cannot_bind(self, problem: Problem) -> bool:
        """True when no choice can reach the limit: neither the peak (every term at its
        largest, at the time point where those maxima sum highest) nor the row of persistent
        inputs (``problem.memory``; the terms hold the inputs too, so the two are separate
        bounds, not a sum). The peak rows are then redundant and recomputing only adds time,
        so the solver may leave both out (exact). Forced recomputation keeps the model.

        Summing every term at once and adding the inputs again called a Llama-3-8B decode
        step on tp=8 (50 GB at most of an 80 GB device) memory-bound: the step was then solved
        only with followers merged, whose greedy layouts cost 13% more than the exact
        optimum (docs/design.md, "Planning speed")."""
        if self.limit is None or self.fixed_decisions():
            return False
        inputs = 0.0
        if problem.memory is not None:
            inputs = sum(float(problem.memory[n].max()) for n in problem.live_nodes())
        return max(self._worst_peak(), inputs) <= self.limit

    def fits(self, choice: list[int]) -> bool:
        """Whether a full choice without solver-chosen recomputation fits the limit."""
        if self.limit is None:
            return True
        return self.peak(choice, self.fixed_decisions())[0] <= self.limit

    def recompute_cost(self, choice: list[int], decisions: dict[str, str] | None = None) -> float:
        decisions = self.decisions if decisions is None else decisions
        return sum(
            float(vec[choice[n]])
            for layer, mode in decisions.items()
            for n, vec in self.recompute_ops.get((layer, mode), [])
        )

    # -- CP-SAT ----------------------------------------------------------------------------
    def add_to_cpsat(self, model, problem: Problem, x: dict, terms: list, scale: float) -> None:
        """Peak rows under ``self.limit`` and recomputation variables with their cost."""
        self._vars: dict = {}
        if self.limit is None and not self.forced:
            return
        self._vars = MemoryRows(self, model, problem, x).build(
            int(self.limit or 2**62), terms, scale
        )

    def read(self, solver: cp_model.CpSolver | None) -> None:
        """Record the recomputation decisions of a CP-SAT solution (None: the LP's, none)."""
        if solver is None or not getattr(self, "_vars", None):
            self.decisions = self.fixed_decisions()
            return
        self.decisions = {
            layer: mode for (layer, mode), var in self._vars.items() if solver.Value(var)
        }

    def minimum(
        self, problem: Problem, time_limit: float = 10.0
    ) -> tuple[int, list[int], dict] | None:
        """The smallest modelled peak any choice reaches (recomputing allowed), and the choice;
        None when CP-SAT finds no choice within ``time_limit``."""
        from ortools.sat.python import cp_model

        model = cp_model.CpModel()
        x = {}
        for n in problem.live_nodes():
            x[n] = [model.NewBoolVar("") for _ in problem.node_costs[n]]
            model.AddExactlyOne(x[n])
        peak = model.NewIntVar(0, 2**50, "peak")
        self._vars = MemoryRows(self, model, problem, x).build(peak, None, 1.0)
        model.Minimize(peak)
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = time_limit
        solver.parameters.num_workers = 1
        status = solver.Solve(model)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        choice = [0] * len(problem.node_costs)
        for n, vars_ in x.items():
            choice[n] = next(s for s, v in enumerate(vars_) if solver.Value(v))
        self.read(solver)
        full = problem.expand(choice)
        return self.profile(full).peak, full, dict(self.decisions)


@dataclass(eq=False)
class _PeakTable:
    """The terms as arrays (``MemoryModel.peak``): bytes per term and strategy (padded), node,
    clipped interval, and which terms each (layer, mode class) frees."""

    terms: list[Term]
    nbytes: np.ndarray
    rows: np.ndarray
    nodes: np.ndarray
    starts: np.ndarray
    stops: np.ndarray
    freed: dict[tuple[str, str], np.ndarray]

    @classmethod
    def of(cls, terms: list[Term], end: int) -> _PeakTable:
        kept = [i for i, t in enumerate(terms) if t.start <= t.stop]  # empty intervals: none
        width = max((len(terms[i].nbytes) for i in kept), default=1)
        nbytes = np.zeros((len(kept), width), dtype=np.int64)
        freed: dict[tuple[str, str], list[int]] = {}
        for row, i in enumerate(kept):
            t = terms[i]
            nbytes[row, : len(t.nbytes)] = [int(v) for v in t.nbytes]  # as MemoryItem: int()
            if t.freed_by is not None:
                freed.setdefault(t.freed_by, []).append(row)
        pick = [terms[i] for i in kept]
        return cls(
            terms,
            nbytes,
            np.arange(len(kept)),
            np.array([t.node for t in pick], dtype=np.int64),
            np.array([max(t.start, 0) for t in pick], dtype=np.int64),
            np.array([min(t.stop, end) for t in pick], dtype=np.int64),
            {k: np.array(v, dtype=np.int64) for k, v in freed.items()},
        )


def infeasible_error(memory: MemoryModel, problem: Problem, limit: float) -> InfeasiblePlanError:
    """The clear error: the smallest peak any layout (and recomputation) reaches, and its parts."""
    found = memory.minimum(problem)
    if found is None:
        return InfeasiblePlanError(
            f"the training step does not fit {gib(limit)} per device (the solver proved it), and "
            "its smallest peak was not found in time. Use more devices, a larger memory_limit, "
            "or a smaller batch"
        )
    peak, choice, decisions = found
    profile = memory.profile(choice, decisions)
    error = InfeasiblePlanError(
        f"the training step does not fit: its smallest modelled peak is {gib(peak)} per device "
        f"(sharding everything it can, recomputing {len(decisions)} of {len(memory.live.layers)} "
        f"layers) but the limit is {gib(limit)}. Largest at that peak: {profile.describe()}. "
        "Use more devices, a larger memory_limit, or a smaller batch"
    )
    error.minimum_bytes = peak  # type: ignore[attr-defined]
    return error
