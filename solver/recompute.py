"""A primal heuristic for memory-bound solves: the Lagrangian LPs' layouts, each with the
cheapest recomputation that fits.

The Lagrangian bound (``solver/lagrange.py``) solves LPs whose node costs price memory; their
minimisers are layouts that trade time for memory, often near what the optimum picks. Given
layouts, choosing recomputation is a small problem: recomputing more only frees memory and full
re-runs a superset of selective's ops, so layers ordered outermost first (the window that covers
most time points first, as ``memory.alike_pairs`` orders alike layers) are given ``n_full``
full and then the fewest selective that fit, found by bisection (the peak only falls as more is
recomputed). Each candidate is a complete plan checked by the exact peak
(``MemoryModel.peak``); the best one that fits and beats the incumbent replaces it. Only the
point is heuristic: the bound stays the Lagrangian's, so the reported gap stays honest.
Deterministic (the LPs are GLOP's, the order fixed).
"""

from __future__ import annotations

import numpy as np

from .memory import MemoryModel
from .problem import Problem

MAX_POINTS = 8
"""Distinct LP layouts tried, cheapest first (each costs a few dozen numpy peaks)."""


def cheapest_fit(
    problem: Problem, memory: MemoryModel, choice: list[int]
) -> tuple[float, dict[str, str]] | None:
    """(recomputation seconds, decisions) of the cheapest outer-first pattern under which the
    full ``choice`` fits ``memory.limit``; None when none does."""
    limit = memory.limit if memory.limit is not None else float("inf")
    fixed = memory.fixed_decisions()
    layers = sorted(
        (name for name, layer in memory.live.layers.items() if name not in fixed),
        key=lambda name: (memory.live.layers[name].forward_end, name),
    )

    def decisions(full: int, selective: int) -> dict[str, str]:
        out = dict(fixed)
        out.update(dict.fromkeys(layers[:full], "full"))
        out.update(dict.fromkeys(layers[full : full + selective], "selective"))
        return out

    peak = memory.peaks(choice)

    def fits(full: int, selective: int) -> bool:
        return peak(decisions(full, selective))[0] <= limit

    best: tuple[float, dict[str, str]] | None = None
    for full in range(len(layers) + 1):
        rest = len(layers) - full
        if not fits(full, rest):
            continue
        lo, hi = 0, rest  # the fewest selective layers that fit: fits(full, hi) holds
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(full, mid) else (mid + 1, hi)
        chosen = decisions(full, hi)
        cost = memory.recompute_cost(choice, chosen)
        if best is None or cost < best[0]:
            best = (cost, chosen)
        if hi == 0:
            break  # more full layers only add seconds
    return best


def improve(
    problem: Problem,
    memory: MemoryModel,
    objective: float,
    points: list[list[int]] | None = None,
) -> tuple[float, list[int], dict[str, str]] | None:
    """(objective, full choice, decisions) of the best Lagrangian LP layout that fits with its
    cheapest recomputation and is below ``objective``; None when none is. ``points``: the
    layouts to try (default: every one the bound found, ``memory.lagrange.points``)."""
    points = memory.lagrange.points if points is None else points
    scored = []
    for choice in points:
        if not _persistent_fits(problem, choice):
            continue
        base = problem.evaluate(choice)
        if np.isfinite(base) and base < objective:
            scored.append((base, choice))
    scored.sort(key=lambda p: p[0])
    best = None
    for base, choice in scored[:MAX_POINTS]:
        if best is not None and base >= best[0]:
            break
        full = problem.expand(choice)
        found = cheapest_fit(problem, memory, full)
        if found is None:
            continue
        total = base + found[0]
        if total < objective and (best is None or total < best[0]):
            best = (total, full, found[1])
    return best


def _persistent_fits(problem: Problem, choice: list[int]) -> bool:
    if problem.memory_limit is None:
        return True
    return problem.memory_of(choice) <= problem.memory_limit * (1 + 1e-9)
