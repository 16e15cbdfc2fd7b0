"""CP-SAT formulation of the layout problem (DESIGN.md §6).

One Boolean per (node, strategy) with exactly-one rows. An edge whose producer or consumer has a
single layout group is linear in the other side. Otherwise the cost matrix is reduced by its row
and column minima (moved to linear terms) and each remaining positive entry (a, b) gets one
Boolean ``e >= Y_a + Z_b - 1`` (Y_a, Z_b: sums of the strategies in those groups) — XLA's
linking, which relies on minimisation and needs no equality rows. Costs are scaled to integers;
the objective is reported back in seconds re-evaluated in floating point.

This module runs a solve (prepare, LP, CP-SAT search); the model's rows are built in
``cpsat_model.py``, a memory-bound solve's seeds, bounds and early stops are ``memory_solve.py``,
and what a solve returns is ``solution.py``.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from . import progress
from .cpsat_model import _add_edge, _add_hints, _add_memory, _add_memory_model, _objective, _scale
from .dominance import prune_dominated
from .eliminate import eliminate_chains
from .lp import Relaxation, solve_relaxation
from .memory_solve import (
    MEMORY_SEARCH_WORK,
    _bounded,
    _cut_off,
    _fallback,
    _feasible,
    _lp_seed,
    _NoSeed,
    _priced_memory_bound,
    _seeded,
    within_gap,
)
from .problem import Problem
from .solution import DETERMINISTIC_PER_SECOND, Solution

# CP-SAT is imported where a search runs, not here: its module pulls in pandas (~0.75 CPU s,
# a fifth of the JAX GPT's whole plan), and a plan whose LP is integral never searches.


WALL_BACKSTOP = 10.0
"""The wall clock (``max_time_in_seconds``) is only a backstop, at this many times the
``time_limit`` the budget came from: it fires only on a machine so slow or loaded that the
search would run on far past what the user asked for; only then can a plan depend on load (it
is still a valid plan, status ``FEASIBLE``)."""


@dataclass(slots=True)
class Prepared:
    """A problem pruned and reduced, ready for the LP and CP-SAT (``prepare``); its LP may be
    solved on another thread (``relax``: GLOP releases the GIL) while the caller prepares the
    next variant."""

    problem: Problem
    """The pruned problem (strategies another one beats forbidden)."""
    reduced: Problem
    """What the solvers see: ``problem`` with nodes of degree <= 2 eliminated, or ``problem``
    itself when peak rows name every node."""
    offset: float
    """The eliminated nodes' cost, outside ``reduced``'s objective."""
    memory: object | None
    """The memory model when its rows can bind, else None."""

    @property
    def solved_by_elimination(self) -> bool:
        return self.reduced is not self.problem and not self.reduced.live_nodes()


def prepare(
    problem: Problem, hints: dict[int, int] | None = None, memory=None, usage=None
) -> Prepared:
    """Prune dominated strategies (exact), drop the memory rows when no choice can reach the
    limit, and eliminate nodes of degree <= 2 (exact) unless peak rows name them. ``usage``:
    ``dominance.memory_vectors`` of the problem, when the caller has it."""
    prune_dominated(problem, memory, hints, usage)  # exact: forbids strategies another one beats
    if memory is not None and memory.cannot_bind(problem):
        memory.read(None)  # nothing recomputed: it would only add time
        memory = None  # no peak rows: no choice reaches the limit
    if memory is not None or not ELIMINATE:  # peak rows name nodes: keep every one
        return Prepared(problem, problem, 0.0, memory)
    reduced = problem.copy()
    offset = eliminate_chains(reduced, _memory_nodes(reduced))
    return Prepared(problem, reduced, offset, None)


def relax(prepared: Prepared, time_limit: float = 30.0) -> Relaxation | None:
    """The LP relaxation of what the solvers will see (None when elimination solved it)."""
    if prepared.solved_by_elimination:
        return None
    return solve_relaxation(prepared.reduced, time_limit)


def solve(
    problem: Problem,
    time_limit: float = 30.0,
    hints: dict[int, int] | None = None,
    workers: int = 1,
    use_lp: bool = True,
    memory=None,
    work_limit: float | None = None,
    prepared: Prepared | None = None,
    relaxation: Future | None = None,
    cutoff: float | None = None,
    lp_seed: bool = False,
    search: bool = True,
    seed_needed: bool = False,
) -> Solution:
    """Solve exactly: the LP relaxation when it is integral, else CP-SAT warm-started by it.

    Deterministic for the same problem (GLOP is deterministic; CP-SAT runs one worker with a
    fixed seed and stops at a deterministic-time budget, not a wall-clock one). ``time_limit``:
    seconds of search on an idle core, turned into that budget (``DETERMINISTIC_PER_SECOND``;
    ``WALL_BACKSTOP`` times it is the wall-clock backstop); ``work_limit`` gives the budget in
    deterministic seconds directly (the axis search's capped steps).
    ``use_lp=False`` forces CP-SAT alone. ``memory`` (a ``solver.memory.MemoryModel``) adds
    the peak-memory rows and recomputation choices (memory hook). Without peak rows, nodes of
    degree <= 2 are first eliminated exactly (``solver/eliminate.py``) and the reduced problem
    is solved. ``cutoff`` (with ``memory``; the pricing of hand-written strategies,
    ``solver/seed.py``): when the LP's layouts do not fit, return no plan (status ``CUTOFF``)
    instead of searching if a lower bound (the Lagrangian bound of the peak row) exceeds
    ``cutoff``; ``-inf`` returns at once, without a bound (the pricing's first pass).
    ``prepared`` (``prepare`` of this problem, hints and memory) and ``relaxation``
    (a future of ``relax(prepared)``) let a caller run those steps ahead, e.g. the LP of one
    variant while it prepares the next. ``lp_seed`` (a seeded memory-bound solve whose
    hand-written strategies gave no warm start, ``space_passes.WarmStart``): a large
    (``MEMORY_BOUND_LAYERS``) binding solve without a complete warm start takes the LP's
    layouts with every layer fully recomputed as its seed when that fits, so the primal
    heuristic, the Lagrangian bound and the ``MEMORY_GAP`` stop apply as after a seed.
    ``search=False``: such a seeded memory-bound solve returns its best point (the seed's or
    the primal heuristic's, with the LP / Lagrangian bound) without CP-SAT's capped search
    (``MEMORY_SEARCH_WORK``), which on the 405B-shaped pipeline caps found no plan at all
    while building its memory rows cost more than the rest of the solve (docs/design.md);
    such a solve without a fitting seed returns ``_fallback``'s point, when there is one,
    without CP-SAT too.
    ``seed_needed`` (with ``lp_seed``): when that seed does not fit, return no plan (status
    ``UNKNOWN``) at once instead of an unseeded search (a pipeline's micro-batch-sized cap,
    which then solves again in the whole-batch space, ``solver/pipeline.py``).
    """
    start = time.perf_counter()
    if prepared is None:
        prepared = prepare(problem, hints, memory)
    memory = prepared.memory
    if prepared.reduced is problem:  # peak rows name nodes: every one kept
        try:
            return _solve(problem, time_limit, hints, workers, use_lp, memory, work_limit,
                          start, relaxation, cutoff, lp_seed, search, seed_needed)  # fmt: skip
        except _NoSeed:  # ``seed_needed``: no unseeded search
            return Solution([], float("inf"), 0.0, "UNKNOWN", time.perf_counter() - start, 0)
    return _solve_eliminated(problem, prepared, time_limit, hints, workers, use_lp, work_limit,
                             start, relaxation)  # fmt: skip


def _solve_eliminated(problem: Problem, prepared: Prepared, time_limit, hints, workers, use_lp,
                      work_limit, start: float, relaxation) -> Solution:  # type: ignore[no-untyped-def]  # fmt: skip
    """``solve`` without peak rows: the problem reduced by exact elimination, solved, and its
    choice priced on the original problem (the bound shifted by the eliminated offset)."""
    if prepared.solved_by_elimination:  # a forest: elimination alone solved it
        choice = prepared.reduced.expand([0] * len(problem.node_costs))
        objective = problem.evaluate(choice)
        return Solution(choice, objective, objective, "OPTIMAL", time.perf_counter() - start, 0)
    reduced, offset = prepared.reduced, prepared.offset
    solution = _solve(reduced, time_limit, hints, workers, use_lp, None, work_limit, start,
                      relaxation)  # fmt: skip
    if not solution.choice:
        return solution
    objective = problem.evaluate(solution.choice)  # the original problem's own arithmetic
    bound = objective if solution.status == "OPTIMAL" else min(objective, solution.bound + offset)
    return Solution(
        solution.choice, objective, bound, solution.status, solution.wall_time,
        solution.num_variables, solution.work,
    )  # fmt: skip


ELIMINATE = True
"""Eliminate nodes of degree <= 2 exactly before solving (tests compare with brute force on
and off)."""


def _memory_nodes(problem: Problem) -> frozenset[int]:
    """Nodes the persistent-memory row names (not eliminated); none when the row cannot bind
    (then it is dropped)."""
    if problem.memory is None or problem.memory_limit is None:
        return frozenset()
    live = problem.live_nodes()
    if sum(float(np.max(problem.memory[n])) for n in live) <= problem.memory_limit:
        problem.memory_limit = None
        return frozenset()
    return frozenset(n for n in live if np.any(problem.memory[n]))


def _solve(
    problem: Problem,
    time_limit: float,
    hints: dict[int, int] | None,
    workers: int,
    use_lp: bool,
    memory,
    work_limit: float | None,
    start: float,
    ahead: Future | None = None,
    cutoff: float | None = None,
    lp_seed: bool = False,
    search: bool = True,
    seed_needed: bool = False,
) -> Solution:
    """The LP (``ahead``: its future, solved elsewhere), then CP-SAT if the LP is not
    integral, then the fallbacks."""
    relaxation = _relaxation(problem, time_limit, use_lp, ahead)
    if (
        relaxation is not None
        and relaxation.integral
        and _feasible(problem, relaxation.choice)
        and (memory is None or memory.fits(problem.expand(relaxation.choice)))  # memory hook
    ):
        if memory is not None:  # memory hook: no solver-chosen recomputation on this path
            memory.read(None)
        objective = problem.evaluate(relaxation.choice)
        elapsed = time.perf_counter() - start
        return Solution(
            problem.expand(relaxation.choice), objective, objective, "OPTIMAL", elapsed, 0
        )
    if _cut_off(problem, memory, relaxation, cutoff):
        return Solution([], float("inf"), float("inf"), "CUTOFF", time.perf_counter() - start, 0)
    seeded = all(n in (hints or {}) for n in problem.live_nodes())  # an incumbent (the seed)
    hints, seeded = _lp_seed(problem, hints, seeded, lp_seed, relaxation, memory, seed_needed)
    if relaxation is not None and not seeded:
        hints = {n: relaxation.choice[n] for n in problem.live_nodes()}
    lagrangian, heuristic = None, None
    if seeded and relaxation is not None and _bounded(memory):
        found, heuristic = _seeded(problem, hints, memory, relaxation, start)
        if found is not None and (within_gap(found) or not search):
            return found  # proven within MEMORY_GAP, or no search asked: CP-SAT is not run
        lagrangian = found.bound if found is not None else None
        budget = time_limit * DETERMINISTIC_PER_SECOND if work_limit is None else work_limit
        work_limit = min(budget, MEMORY_SEARCH_WORK)
    solution = _search_or_fallback(problem, time_limit, hints, workers, start, memory,
                                   work_limit, heuristic, relaxation, search)  # fmt: skip
    if relaxation is not None and solution.choice:
        bound = max(solution.bound, min(relaxation.bound, solution.objective))
        solution = dataclasses.replace(solution, bound=bound)
    if lagrangian is not None and solution.choice:  # a bound on the problem, not the point
        solution = dataclasses.replace(
            solution, bound=max(solution.bound, min(lagrangian, solution.objective))
        )
    elif solution.choice and relaxation is not None and _bounded(memory):
        solution = _priced_memory_bound(problem, memory, solution, relaxation)
    return solution


def _relaxation(problem: Problem, time_limit: float, use_lp: bool, ahead: Future | None):
    """The LP relaxation: ``ahead``'s result when it was solved elsewhere (``relax``)."""
    if not use_lp:
        return None
    return ahead.result() if ahead is not None else solve_relaxation(problem, time_limit)


def proven_within_gap(solution: Solution, memory) -> bool:  # type: ignore[no-untyped-def]
    """Whether a large memory-bound solve (``MEMORY_BOUND_LAYERS``) is proven within
    ``MEMORY_GAP``. The planner then skips its overlap-weighted objective variant: on Llama-3-70B
    and Mixtral-8x7B that variant ended above the gap (7.2%, 2.6%), ran the capped search (16-42
    s) and its plans simulated slower (2.84 vs 2.74 s, 1.15 vs 1.14 s; docs/design.md)."""
    return bool(solution.choice) and _bounded(memory) and within_gap(solution)


def _search(problem, time_limit, hints, workers, start, memory, work_limit, heuristic) -> Solution:  # type: ignore[no-untyped-def]
    """CP-SAT, hinted with the heuristic's recomputation when it found a point (then that
    point when the search finds nothing better)."""
    seed_decisions = memory.hint_decisions if memory is not None else None
    if heuristic is not None:  # the search starts from the better point
        hints = {n: heuristic[0].choice[n] for n in problem.live_nodes()}
        memory.hint_decisions = heuristic[1]
    try:
        solution = _solve_cpsat(problem, time_limit, hints, workers, start, memory, work_limit)
    finally:
        if memory is not None:
            memory.hint_decisions = seed_decisions
    if heuristic is not None and progress.enabled():
        progress.report(
            "solve",
            "capped search from the heuristic's %s: %s",
            progress.seconds_text(heuristic[0].objective),
            progress.seconds_text(solution.objective) if solution.choice else "no plan",
        )
    if heuristic is not None and (
        not solution.choice or heuristic[0].objective < solution.objective
    ):
        solution, memory.decisions = heuristic[0], heuristic[1]
    return solution


def _search_or_fallback(problem, time_limit, hints, workers, start, memory, work_limit,
                        heuristic, relaxation, search: bool) -> Solution:  # type: ignore[no-untyped-def]  # fmt: skip
    """CP-SAT, then ``_fallback`` when it finds nothing; a large memory-bound solve with
    ``search=False`` (no seed that fits, else it returned already) takes ``_fallback``'s point
    first and runs CP-SAT only when there is none."""
    if not search and _bounded(memory) and relaxation is not None:
        found = _fallback(problem, hints, memory, relaxation, start)
        if found is not None:
            return found
    solution = _search(problem, time_limit, hints, workers, start, memory, work_limit, heuristic)
    if solution.choice:
        return solution
    return _fallback(problem, hints, memory, relaxation, start) or solution


def _solve_cpsat(
    problem: Problem,
    time_limit: float,
    hints: dict[int, int] | None,
    workers: int,
    start: float,
    memory=None,
    work_limit: float | None = None,
) -> Solution:
    from ortools.sat.python import cp_model  # lazily: see the note at the imports

    live = problem.live_nodes()
    scale = _scale(problem)
    model = cp_model.CpModel()
    terms: list[tuple[object, int]] = []
    x, constant = _add_nodes(model, problem, live, scale, terms)
    hints = hints or {}
    for e in problem.edges:
        constant += _add_edge(model, e, x, terms, scale, hints)
    _add_memory(model, problem, x)
    _add_memory_model(model, problem, x, terms, scale, memory)
    model.Minimize(sum(coef * var for var, coef in terms if coef))
    _add_hints(model, x, hints)
    solver = cp_model.CpSolver()
    budget = work_limit if work_limit is not None else time_limit * DETERMINISTIC_PER_SECOND
    solver.parameters.max_deterministic_time = budget  # the limit: the same on any machine
    backstop = WALL_BACKSTOP * budget / DETERMINISTIC_PER_SECOND
    solver.parameters.max_time_in_seconds = backstop  # fires only far beyond the budget
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = 0
    progress_callback = _progress(constant, scale) if progress.enabled() else None
    status = solver.Solve(model, progress_callback)
    name = _status_name(status)
    work = solver.ResponseProto().deterministic_time
    if name not in ("OPTIMAL", "FEASIBLE"):
        elapsed = time.perf_counter() - start
        return Solution([], float("inf"), float("inf"), name, elapsed, 0, work)
    choice = [0] * len(problem.node_costs)
    for n in live:
        choice[n] = 0 if len(x[n]) == 1 else next(s for s, v in enumerate(x[n]) if solver.Value(v))
    objective = _objective(problem, choice, memory, solver)
    bound = min(objective, constant + solver.BestObjectiveBound() / scale)
    if name == "OPTIMAL":
        bound = objective
    nvars = len(model.Proto().variables)
    elapsed = time.perf_counter() - start
    return Solution(problem.expand(choice), objective, bound, name, elapsed, nvars, work)


def _add_nodes(model, problem: Problem, live: list[int], scale: float, terms: list):  # type: ignore[no-untyped-def]
    """One Boolean per strategy of each live node (exactly one true; an infinite cost
    forbids it), their scaled costs above the node's cheapest into ``terms``: (the
    variables per node, the constant of the cheapest costs)."""
    x: dict[int, list] = {}
    constant = 0.0
    for n in live:
        costs = problem.node_costs[n]
        if len(costs) == 1:
            x[n] = [1]
            constant += float(costs[0])
            continue
        x[n] = [model.NewBoolVar(f"s{n}_{s}") for s in range(len(costs))]
        model.AddExactlyOne(x[n])
        for var, c in zip(x[n], costs, strict=True):
            if not np.isfinite(c):
                model.Add(var == 0)
        costs = np.where(np.isfinite(costs), costs, 0.0)
        base = float(costs.min())
        constant += base
        terms += [(var, round((c - base) * scale)) for var, c in zip(x[n], costs, strict=True)]
    return x, constant


def _status_name(status) -> str:  # type: ignore[no-untyped-def]
    from ortools.sat.python import cp_model

    names = {
        cp_model.OPTIMAL: "OPTIMAL",
        cp_model.FEASIBLE: "FEASIBLE",
        cp_model.INFEASIBLE: "INFEASIBLE",
        cp_model.MODEL_INVALID: "MODEL_INVALID",
        cp_model.UNKNOWN: "UNKNOWN",
    }
    return names.get(status, str(status))


def _progress(constant: float, scale: float):  # type: ignore[no-untyped-def]
    """A CP-SAT solution callback that logs each better solution with its bound and gap
    (``progress.py``), at most one line per ``EVERY`` seconds; attached only when progress is
    shown. Defined here so that CP-SAT is imported only when a search runs."""
    from ortools.sat.python import cp_model

    class _Progress(cp_model.CpSolverSolutionCallback):
        EVERY = 0.5

        def __init__(self) -> None:
            super().__init__()
            self.last = -self.EVERY

        def on_solution_callback(self) -> None:
            if time.perf_counter() - self.last < self.EVERY:
                return
            self.last = time.perf_counter()
            value = constant + self.ObjectiveValue() / scale
            bound = min(value, constant + self.BestObjectiveBound() / scale)
            gap = 0.0 if value <= 0 else 1 - bound / value
            progress.report(
                "solve",
                "CP-SAT incumbent %s, bound %s, gap %.2f%%",
                progress.seconds_text(value),
                progress.seconds_text(bound),
                100 * gap,
            )

    return _Progress()
