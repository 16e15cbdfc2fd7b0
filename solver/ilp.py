"""CP-SAT formulation of the layout problem (DESIGN.md §6).

One Boolean per (node, strategy) with exactly-one rows. An edge whose producer or consumer has a
single layout group is linear in the other side. Otherwise the cost matrix is reduced by its row
and column minima (moved to linear terms) and each remaining positive entry (a, b) gets one
Boolean ``e >= Y_a + Z_b - 1`` (Y_a, Z_b: sums of the strategies in those groups) — XLA's
linking, which relies on minimisation and needs no equality rows. Costs are scaled to integers;
the objective is reported back in seconds re-evaluated in floating point.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .. import progress
from .dominance import prune_dominated
from .eliminate import eliminate_chains
from .lagrange import memory_lower_bound
from .lp import Relaxation, solve_relaxation
from .problem import Edge, Problem
from .recompute import improve

if TYPE_CHECKING:
    from ortools.sat.python import cp_model

# CP-SAT is imported where a search runs, not here: its module pulls in pandas (~0.75 CPU s,
# a fifth of the JAX GPT's whole plan), and a plan whose LP is integral never searches.


@dataclass(frozen=True, slots=True)
class Solution:
    choice: list[int]
    """Strategy per node, followers expanded."""
    objective: float
    bound: float
    status: str
    wall_time: float
    num_variables: int
    work: float = 0.0
    """CP-SAT deterministic seconds the search used (0 when the LP or elimination solved it)."""

    @property
    def seconds_of_budget(self) -> float:
        """The ``time_limit`` seconds the search used up (``DETERMINISTIC_PER_SECOND``)."""
        return self.work / DETERMINISTIC_PER_SECOND


DETERMINISTIC_PER_SECOND = 0.25
"""CP-SAT deterministic seconds (``max_deterministic_time``, its own count of work) per second of
the user's ``time_limit``. CP-SAT stops at that budget, so a search cut short returns the same
solution however busy or slow the machine is. Measured on a 2-core box: one deterministic
second of this formulation's search took 15-19 wall seconds with the box loaded about 4.5x
(load 9), i.e. about 4 s of an idle core; so ``time_limit=T`` stops after about ``T`` seconds
of search on an idle core of such a box (longer on a busy one, shorter on a fast one)."""

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
        if found is not None and (_gap(found) <= MEMORY_GAP or not search):
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


MEMORY_GAP = 0.02
"""A memory-bound solve (``MEMORY_BOUND_LAYERS`` or more layers) whose relative gap is at most
this is not searched further: a seed proven this close (by the LP or the Lagrangian bound) is
returned without running CP-SAT, and the Lagrangian bound is not computed when CP-SAT already
leaves at most this (the issue's target; on Llama-3-8B f32 the seed is 1.1% from the LP bound,
and CP-SAT's search then cost 25-30 s of CPU for nothing better)."""
MEMORY_BOUND_LAYERS = 8
"""Layers from which a memory-bound solve is bounded by the Lagrangian bound and may stop at
``MEMORY_GAP``: the bound's strength is grouping alike layers, and below this CP-SAT's own
search is cheap (the 2-layer test model: 45 of the bound's LPs took 48 s under load and
doubled the test), and the small problems stay solved exactly (brute-force tests)."""


def _cut_off(problem: Problem, memory, relaxation, cutoff: float | None) -> bool:  # type: ignore[no-untyped-def]
    """Whether the optimum provably exceeds ``cutoff`` (always for ``-inf``, never computed)."""
    if cutoff is None or memory is None or relaxation is None:
        return False
    if cutoff == float("-inf"):
        return True
    if relaxation.bound > cutoff:
        return True
    if len(memory.live.layers) < MEMORY_BOUND_LAYERS:
        return False  # small: the search is cheaper than the bound's LPs
    decisions = memory.decisions
    choice = problem.expand(relaxation.choice)
    bound = memory_lower_bound(
        problem, memory, choice, memory.fixed_decisions(), relaxation, cutoff,
        enough=lambda b: b > cutoff,  # proven: the rest of the bound's LPs would not matter
    )  # fmt: skip
    memory.decisions = decisions
    return bound is not None and bound > cutoff  # a tie may still win (the earlier strategy)


MEMORY_SEARCH_WORK = 0.5
"""CP-SAT deterministic seconds for a seeded memory-bound solve (``MEMORY_BOUND_LAYERS`` or
more layers) that the seed and the bounds leave more than ``MEMORY_GAP`` from proven: on
Llama-3-70B bf16 (80 layers, 8x8) and Mixtral-8x7B (32 layers, dp 8 x ep 8) the whole budget
(7.5 deterministic seconds, 150-460 s of CPU on the 2-core box) and 1 s each found nothing
better than the seed, so the search is capped here; the plan is never slower than the seed."""


def _bounded(memory) -> bool:  # type: ignore[no-untyped-def]
    """Whether a memory-bound solve is large enough for the Lagrangian bound and the
    ``MEMORY_GAP`` stop (never while pricing a hand-written strategy: its recomputation is
    forced)."""
    return (
        memory is not None
        and memory.forced is None
        and memory.allow_recompute
        and len(memory.live.layers) >= MEMORY_BOUND_LAYERS
    )


def proven_within_gap(solution: Solution, memory) -> bool:  # type: ignore[no-untyped-def]
    """Whether a large memory-bound solve (``MEMORY_BOUND_LAYERS``) is proven within
    ``MEMORY_GAP``. The planner then skips its overlap-weighted objective variant: on Llama-3-70B
    and Mixtral-8x7B that variant ended above the gap (7.2%, 2.6%), ran the capped search (16-42
    s) and its plans simulated slower (2.84 vs 2.74 s, 1.15 vs 1.14 s; docs/design.md)."""
    return bool(solution.choice) and _bounded(memory) and _gap(solution) <= MEMORY_GAP


def _gap(solution: Solution) -> float:
    if solution.objective <= 0:
        return 0.0
    return 1 - solution.bound / solution.objective


def _seeded(problem: Problem, hints: dict[int, int], memory, relaxation, start: float):  # type: ignore[no-untyped-def]
    """(the better of the seed and the heuristic's point, with the best bound known before any
    search; (that point, its recomputation) when the heuristic found it, else None). (None,
    None) when the seed (a complete warm start) does not fit: CP-SAT then starts from it anyway.

    The bound is the LP's, raised by the Lagrangian bound when the LP alone leaves more than
    ``MEMORY_GAP``; the bound and the primal heuristic (``solver/recompute.py``) take turns:
    after each Lagrangian multiplier the heuristic tries the LP layouts it found, and both stop
    once the best point is proven within ``MEMORY_GAP`` (Llama-3-70B: after the first
    multiplier; the bound alone then ran 9-15 more LPs, 3-6 s)."""
    seed = _warm_start(problem, hints, memory, start)
    if seed is None:
        return None, None
    seed = dataclasses.replace(seed, bound=min(relaxation.bound, seed.objective))
    if _gap(seed) <= MEMORY_GAP:
        return seed, None  # close enough: the bound's LPs are not worth their seconds
    best: list = [seed, dict(memory.decisions)]
    tried = [0]

    def enough(bound: float) -> bool:
        points = memory.lagrange.points[tried[0] :]  # the heuristic tried the earlier ones
        tried[0] = len(memory.lagrange.points)
        better = improve(problem, memory, best[0].objective, points)
        if better is not None:
            objective, choice, decisions = better
            elapsed = time.perf_counter() - start
            best[:] = [Solution(choice, objective, 0.0, "FEASIBLE", elapsed, 0), decisions]
        return 1 - bound / best[0].objective <= MEMORY_GAP

    bound = memory_lower_bound(
        problem, memory, seed.choice, best[1], relaxation, seed.objective, enough
    )
    found, decisions = best
    lower = seed.bound if bound is None else max(seed.bound, bound)
    bounded = dataclasses.replace(found, bound=min(lower, found.objective))
    memory.decisions = decisions
    return bounded, (None if found is seed else (bounded, decisions))


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


def _priced_memory_bound(problem: Problem, memory, solution: Solution, relaxation) -> Solution:  # type: ignore[no-untyped-def]
    """The solution with its bound raised to the Lagrangian bound on the peak row
    (``solver/lagrange.py``) when that is higher: CP-SAT's own bound ignores memory."""
    if solution.status == "OPTIMAL" or _gap(solution) <= MEMORY_GAP:
        return solution  # close enough: the bound's LPs are not worth their seconds
    decisions = memory.decisions
    bound = memory_lower_bound(
        problem, memory, solution.choice, decisions, relaxation, solution.objective
    )
    memory.decisions = decisions
    if bound is None or bound <= solution.bound:
        return solution
    return dataclasses.replace(solution, bound=min(bound, solution.objective))


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


def _fallback(problem: Problem, hints, memory, relaxation, start: float) -> Solution | None:  # type: ignore[no-untyped-def]
    """The warm start when it fits, else the LP's layouts with every layer recomputed when
    that fits, else None: what a solve returns when CP-SAT finds nothing. A memory-bound solve
    with ``search=False`` whose seed does not fit returns it without running CP-SAT first: on
    the HF-captured Llama-3-70B pipeline (``pp=4`` x (2, 4, 8), 128K, 29,803 ops) each of
    the six sub-mesh solves spent 6-8 s building and running a capped CP-SAT model that found
    no plan (``UNKNOWN``) before this same fallback (docs/design.md, "Pipelines")."""
    found = _warm_start(problem, hints, memory, start) if hints else None
    if found is None and relaxation is not None and memory is not None:
        found = _recompute_everything(problem, relaxation.choice, memory, start)
    return found


def _warm_start(problem: Problem, hints: dict[int, int], memory, start: float):
    """Fallback when CP-SAT finds nothing in time: the warm start itself (an incumbent or the
    LP's rounding) when it is complete, finite and fits (``FEASIBLE``)."""
    live = problem.live_nodes()
    if not all(n in hints for n in live):
        return None
    choice = [0] * len(problem.node_costs)
    for n in live:
        choice[n] = hints[n]
    objective = problem.evaluate(choice)
    full = problem.expand(choice)
    if not np.isfinite(objective) or not _feasible(problem, choice):
        return None
    decisions = None
    if memory is not None:
        decisions = {**(memory.hint_decisions or {}), **memory.fixed_decisions()}
        if memory.peak(full, decisions)[0] > (memory.limit or float("inf")):
            return None
        memory.decisions = decisions
        objective += memory.recompute_cost(full, decisions)
    return Solution(full, objective, 0.0, "FEASIBLE", time.perf_counter() - start, 0)


def _recompute_everything(problem: Problem, choice: list[int], memory, start: float):
    """Fallback when CP-SAT finds nothing in time: the LP's layouts with every layer fully
    recomputed, if that fits (a feasible plan, reported FEASIBLE with the LP bound as the gap)."""
    full = problem.expand(choice)
    decisions = {layer: "full" for layer in memory.live.layers}
    if not _feasible(problem, choice) or memory.peak(full, decisions)[0] > memory.limit:
        return None
    memory.decisions = decisions
    objective = problem.evaluate(choice) + memory.recompute_cost(full, decisions)
    return Solution(full, objective, 0.0, "FEASIBLE", time.perf_counter() - start, 0)


class _NoSeed(Exception):
    """The LP seed does not fit and ``solve``'s ``seed_needed`` forbids an unseeded search."""


def _lp_seed(problem: Problem, hints, seeded: bool, wanted: bool, relaxation, memory,
             needed: bool = False):  # type: ignore[no-untyped-def]  # fmt: skip
    """(hints, seeded): when ``wanted`` (``solve``'s ``lp_seed``) for a large binding solve
    that has no complete warm start, the LP's layouts with every layer fully recomputed as
    its seed if that fits (``_NoSeed`` when it does not and ``needed``). Measured on the
    405B-shaped pipeline row (126 layers, 1-sample micro-batches: no hand-written strategy
    splits the batch that little), whose unseeded sub-mesh solve ran CP-SAT for 90-140 s per
    objective variant (docs/design.md)."""
    if seeded or not wanted or relaxation is None or not _bounded(memory):
        return hints, seeded
    if _recompute_everything(problem, relaxation.choice, memory, 0.0) is None:
        if needed:
            raise _NoSeed
        return hints, seeded
    memory.hint_decisions = dict(memory.decisions)
    return {n: relaxation.choice[n] for n in problem.live_nodes()}, True


def _feasible(problem: Problem, choice: list[int]) -> bool:
    if problem.memory_limit is None:
        return True
    return problem.memory_of(choice) <= problem.memory_limit * (1 + 1e-9)


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


def _add_hints(model, x: dict, hints: dict[int, int]) -> None:
    """Every strategy variable of a hinted node (the edges hint theirs): a complete point."""
    for n, s in hints.items():
        if n in x and len(x[n]) > 1:
            for k, var in enumerate(x[n]):
                model.AddHint(var, int(k == s))


def _add_memory_model(model, problem: Problem, x: dict, terms: list, scale: float, memory) -> None:
    """Memory hook: peak rows plus recomputation variables and their cost."""
    if memory is not None:
        memory.add_to_cpsat(model, problem, x, terms, scale)


def _objective(problem: Problem, choice: list[int], memory, solver) -> float:
    """Modelled seconds of a solution; the memory hook reads recomputation and adds its cost."""
    objective = problem.evaluate(choice)
    if memory is not None:
        memory.read(solver)
        objective += memory.recompute_cost(problem.expand(choice))
    return objective


def _scale(problem: Problem) -> float:
    """Integer scaling so the largest coefficient is about 1e9 (precision ~1e-9 relative)."""
    peak = problem.cost_peak()
    return 1e9 / peak if peak > 0 else 1.0


def _group_sums(vars_: list, group: np.ndarray, ngroups: int) -> list:
    sums: list[list] = [[] for _ in range(ngroups)]
    for s, g in enumerate(group):
        sums[g].append(vars_[s])
    return sums


def _add_edge(
    model: cp_model.CpModel, e: Edge, x: dict, terms: list, scale: float, hints: dict
) -> float:
    """Add one edge's cost; returns the constant part (in seconds). Pair variables get hints
    when both ends have one: CP-SAT then starts from a complete feasible point instead of
    repairing a partial one (which on the 1-layer JAX GPT never got back to the hint's cost)."""
    cost = e.cost.copy()
    constant = 0.0
    rows, cols = cost.shape
    y = _group_sums(x[e.u], e.u_group, rows)
    z = _group_sums(x[e.v], e.v_group, cols)
    forbidden = ~np.isfinite(cost)
    for a, b in zip(*np.nonzero(forbidden), strict=True):  # impossible reshard: never both
        model.Add(sum(y[a]) + sum(z[b]) <= 1)
    cost[forbidden] = 0.0
    row_min = cost.min(axis=1)
    cost -= row_min[:, None]
    col_min = cost.min(axis=0)
    cost -= col_min[None, :]
    for groups, mins in ((y, row_min), (z, col_min)):
        for members, m in zip(groups, mins, strict=True):
            if m <= 0:
                continue
            for var in members:
                if isinstance(var, int):
                    constant += m
                else:
                    terms.append((var, round(m * scale)))
    if not np.any(cost > 0):
        return constant
    hinted = None
    if e.u in hints and e.v in hints:
        hinted = (int(e.u_group[hints[e.u]]), int(e.v_group[hints[e.v]]))
    if MARGINAL:
        _marginal_link(model, e, cost, y, z, terms, scale, hinted)
        return constant
    return constant + _implication_link(model, e, cost, y, z, terms, scale, hinted)


def _implication_link(model, e: Edge, cost, y, z, terms, scale, hinted) -> float:  # type: ignore[no-untyped-def]
    """XLA's linking: one ``e >= Y_a + Z_b - 1`` Boolean per positive entry."""
    constant = 0.0
    for a, b in zip(*np.nonzero(cost > 0), strict=True):
        if all(isinstance(v, int) for v in y[a] + z[b]):
            constant += float(cost[a, b])
            continue
        link = model.NewBoolVar(f"e{e.u}_{e.v}_{a}_{b}")
        model.Add(link >= sum(y[a]) + sum(z[b]) - 1)
        terms.append((link, round(float(cost[a, b]) * scale)))
        if hinted is not None:
            model.AddHint(link, int((a, b) == hinted))
    return constant


MARGINAL = True


def _marginal_link(
    model,
    e: Edge,
    cost: np.ndarray,
    y: list,
    z: list,
    terms: list,
    scale: float,
    hinted: tuple[int, int] | None = None,
) -> None:
    """Pair variables whose row sums equal the producer's group and column sums the consumer's.

    This is the local marginal polytope (Alpa's linking): its LP relaxation is far tighter than
    one ``e >= Y + Z - 1`` row per pair, which lets CP-SAT's LP prune instead of branching.
    """
    rows, cols = cost.shape
    pair = [[model.NewBoolVar(f"e{e.u}_{e.v}_{a}_{b}") for b in range(cols)] for a in range(rows)]
    for a in range(rows):
        model.Add(sum(pair[a]) == sum(y[a]))
    for b in range(cols):
        model.Add(sum(pair[a][b] for a in range(rows)) == sum(z[b]))
    for a, b in zip(*np.nonzero(cost > 0), strict=True):
        terms.append((pair[a][b], round(float(cost[a, b]) * scale)))
    if hinted is not None:
        for a in range(rows):
            for b in range(cols):
                model.AddHint(pair[a][b], int((a, b) == hinted))


def _add_memory(model: cp_model.CpModel, problem: Problem, x: dict) -> None:
    if problem.memory is None or problem.memory_limit is None:
        return
    expr = []
    fixed = 0
    for n in problem.live_nodes():
        mem = problem.memory[n]
        if len(x[n]) == 1:
            fixed += int(mem[0])
        else:
            expr += [int(m) * var for var, m in zip(x[n], mem, strict=True) if m]
    model.Add(sum(expr) <= int(problem.memory_limit) - fixed)
