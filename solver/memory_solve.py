"""How a memory-bound solve is seeded, bounded and stopped early: the ``MEMORY_GAP`` stop with
the Lagrangian bound and the primal heuristic, the LP seed with every layer recomputed, and the
fallback points (the warm start, the LP's layouts fully recomputed) when CP-SAT finds nothing."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from .lagrange import memory_lower_bound
from .problem import Problem
from .recompute import improve
from .solution import Solution

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


def within_gap(solution: Solution) -> bool:
    """Whether ``solution`` is proven within ``MEMORY_GAP`` of its bound."""
    return _gap(solution) <= MEMORY_GAP


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
