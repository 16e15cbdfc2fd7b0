"""A Lagrangian lower bound for the memory-bound layout problem (issue 15).

CP-SAT's own bound on a memory-bound solve is weak: the LP relaxation ignores the peak rows, so
a plan that must shard or recompute to fit is measured against the unconstrained optimum (the
70B row reported 16.7% "gap" that was mostly this). Pricing the peak row of one time point
``k`` with a multiplier ``lam >= 0`` gives, for every ``lam``,

    LB(lam) = min_{x, r} cost(x) + recompute(x, r) + lam * (bytes_k(x, r) - limit)  <=  OPT

(any plan that fits has ``bytes_k <= limit``, so its priced cost is at most its cost). Given
the layouts ``x``, each layer picks its recomputation mode alone; layers that are alike at ``k``
(the same window and recomputed-op terms on the same solver nodes, which repeated layers share)
pick the same mode, and a layer whose window does not cover ``k`` recomputes nothing (it would
only add time). So the inner minimum is a minimum over one mode per group of alike layers of an
*unconstrained* layout problem with modified node costs, and each of those is bounded from below
by its LP relaxation (``solver/lp.py``, usually integral on these problems). The bound is
concave in ``lam``; it is maximised by bisecting on the sign of the peak row's excess at the
minimiser. Deterministic: GLOP and fixed iteration counts.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .lp import Relaxation, solve_relaxation
from .memory import MemoryModel
from .memory_rows import _resolution
from .problem import Problem

MODES: tuple[str | None, ...] = (None, "selective", "full")
MAX_PATTERNS = 27
"""Mode assignments (one mode per group of alike layers) priced per multiplier; with more
groups the bound is not computed (None)."""
STEPS = 6
"""Multiplier updates (growing, then bisection): each costs one LP per mode assignment."""
MAX_LPS = 24
"""LPs one bound may solve over all its time points (each LB(lam) is a valid bound, so stopping
early only leaves it lower). On the 2-layer test model 45 LPs cost 48 s under load."""
RELAX_SHARE = 16
"""A group of alike layers holding at most 1/this of the layers that choose a mode at a time
point is priced without a mode (``_Group.relaxed``): a bound a little lower, but one LP per
multiplier instead of three for it. On Llama-3-70B the 80 layers form groups of 79 and 1,
whose 9 mode patterns per multiplier become 3."""
RELAXED = "relaxed"
"""The pattern entry of a relaxed group."""
LP_SLACK = 1e-6
"""Relative slack taken off each LP value (GLOP's tolerances), so the bound stays below."""


@dataclass(frozen=True, slots=True)
class _Group:
    """Alike layers covering ``k``: per mode, the node-cost deltas of one layer."""

    count: int
    modes: tuple[str | None, ...]
    cost: dict[str | None, dict[int, np.ndarray]]
    """Mode -> leader node -> recomputed seconds of one layer per strategy."""
    kept: dict[str | None, dict[int, np.ndarray]]
    """Mode -> leader node -> window bytes of one layer still live at ``k`` per strategy."""
    relaxed: bool = False
    """Priced without a mode: each node takes, per strategy, its smallest priced delta over
    the modes (``RELAX_SHARE``)."""

    def cheapest(self, lam: float, costs: list[np.ndarray]) -> dict[int, np.ndarray]:
        """Per node, the smallest over the modes of one layer's seconds plus ``lam`` times its
        kept bytes, per strategy (``relaxed``). The sum over nodes of per-node minima is at
        most any one mode's sum, so LB(lam) computed with it stays a lower bound."""
        nodes = sorted({n for m in self.modes for n in (*self.cost[m], *self.kept[m])})
        out = {}
        for n in nodes:
            zero = np.zeros(len(costs[n]))
            out[n] = np.min(
                [self.cost[m].get(n, zero) + lam * self.kept[m].get(n, zero) for m in self.modes],
                axis=0,
            )
        return out

    def mode_at(self, lam: float, choice: list[int]) -> str | None:
        """The mode a relaxed group's layers would take at ``choice`` (the cheapest priced)."""

        def priced(m: str | None) -> float:
            total = sum(float(v[choice[n]]) for n, v in self.cost[m].items())
            return total + lam * sum(float(v[choice[n]]) for n, v in self.kept[m].items())

        return min(self.modes, key=lambda m: (priced(m), self.modes.index(m)))


def memory_lower_bound(
    problem: Problem,
    memory: MemoryModel,
    choice: list[int],
    decisions: dict[str, str],
    free: Relaxation | None = None,
    incumbent: float | None = None,
    enough: Callable[[float], bool] | None = None,
) -> float | None:
    """A lower bound on the optimum of ``problem`` under ``memory``'s peak rows (seconds): the
    best of the bounds priced at the time point where the unconstrained LP optimum peaks (the
    row it breaks) and where the solution ``choice`` (full, with ``decisions``) peaks; None
    when the limit is absent or the layers form too many groups. ``free``: the unconstrained
    LP of ``problem`` when the caller has it (it is LB(0), not solved again). Multipliers found
    on one problem are kept on ``memory`` and tried first on the next (the planner's variants
    of one solve share the memory model and differ little); a row no multiplier raised there
    is not priced again (Mixtral-8x7B: 8 s of LPs per variant for nothing). ``incumbent``: the
    objective of a plan that fits, which steers the first multiplier. ``enough``: called with
    the best bound so far after each multiplier; True stops there (every LB(lam) is a valid
    bound, so stopping early only leaves it lower): a cut-off proven, or a gap closed (on
    Llama-3-70B the first multiplier's bound already closes it, with the heuristic's point;
    the rest were 9-15 of its LPs)."""
    if memory.limit is None:
        return None
    free = free if free is not None else solve_relaxation(problem)
    if free is None:
        return None
    memory.lagrange.remember(free.choice)
    points = [memory.peak(problem.expand(free.choice), memory.fixed_decisions())[1]]
    points.append(memory.peak(choice, decisions)[1])
    best, budget = None, [MAX_LPS]
    known = memory.lagrange.multipliers
    for k in dict.fromkeys(points):
        if known.get(k) == 0.0:
            continue  # no multiplier raised this row's bound on a sibling problem
        priced = _Priced.at(problem, memory, k, free, budget)
        if priced is None:
            continue
        found = priced.maximise(float(memory.limit), known.get(k), incumbent, _with(enough, best))
        if found is None:
            continue
        known[k] = found[1]
        if best is None or found[0] > best:
            best = found[0]
        if found[2]:
            break
    return best


class _Priced:
    """The Lagrangian subproblems of one time point."""

    def __init__(
        self,
        problem: Problem,
        base: dict[int, np.ndarray],
        groups: list[_Group],
        free: Relaxation,
        budget: list[int],
    ):
        self.problem, self.base, self.groups = problem, base, groups
        self.free, self.budget = free, budget
        self.memory: MemoryModel | None = None

    @classmethod
    def at(
        cls, problem: Problem, memory: MemoryModel, k: int, free: Relaxation, budget: list[int]
    ) -> _Priced | None:
        resolve = _resolution(problem)

        def add(into: dict[int, np.ndarray], node: int, vec: np.ndarray) -> None:
            leader, mapping = resolve.get(node, (node, None))
            v = np.asarray(vec if mapping is None else vec[mapping], dtype=float)
            into[leader] = into[leader] + v if leader in into else v

        base: dict[int, np.ndarray] = {}
        windows: dict[str, list] = {}
        for t in memory.terms:
            if not t.start <= k <= t.stop:
                continue
            if t.freed_by is not None and memory.allow_recompute:
                windows.setdefault(t.freed_by[0], []).append(t)
            else:
                add(base, t.node, t.nbytes)
        forced = memory.forced or {}
        groups: dict[tuple, list] = {}
        for layer in memory.live.layers:
            terms = windows.get(layer, [])
            if memory.forced is not None:
                modes: tuple[str | None, ...] = (forced.get(layer),)
            else:  # recomputing a layer that frees nothing at k only adds time
                modes = MODES if terms else (None,)
            cost: dict[str | None, dict[int, np.ndarray]] = {}
            kept: dict[str | None, dict[int, np.ndarray]] = {}
            for mode in modes:
                cost[mode], kept[mode] = {}, {}
                for n, vec in memory.recompute_ops.get((layer, mode), []) if mode else []:
                    add(cost[mode], n, vec)
                for t in terms:
                    if not _frees(mode, t.freed_by[1]):
                        add(kept[mode], t.node, t.nbytes)
            key = (modes, _key(cost), _key(kept))  # alike layers: the same terms, same nodes
            groups.setdefault(key, [cost, kept, 0])[2] += 1
        choosing = sum(count for key, (_, _, count) in groups.items() if len(key[0]) > 1)
        built = [
            _Group(count, key[0], cost, kept, len(key[0]) > 1 and count * RELAX_SHARE <= choosing)
            for key, (cost, kept, count) in groups.items()
        ]
        if np.prod([1 if g.relaxed else len(g.modes) for g in built], dtype=float) > MAX_PATTERNS:
            return None
        priced = cls(problem, base, built, free, budget)
        priced.memory = memory
        return priced

    def value(self, lam: float) -> tuple[float, float] | None:
        """(LB(lam) + lam * limit, the peak row's bytes at the minimiser); None when an LP
        fails or the LP budget is spent. At ``lam = 0`` the minimiser recomputes nothing
        (recomputation only adds seconds): the unconstrained LP, already solved."""
        if lam == 0.0 and all(None in g.modes for g in self.groups):
            return self._scored(self.free, (None,) * len(self.groups))
        patterns = list(
            itertools.product(*((RELAXED,) if g.relaxed else g.modes for g in self.groups))
        )
        if self.budget[0] < len(patterns):
            return None
        self.budget[0] -= len(patterns)
        best: tuple[float, float] | None = None
        for pattern in patterns:
            delta = self._delta(pattern, lam)
            original = {n: self.problem.node_costs[n] for n in delta}
            for n, v in delta.items():
                self.problem.node_costs[n] = original[n] + v
            try:
                relaxation = solve_relaxation(self.problem)
            finally:
                for n, v in original.items():
                    self.problem.node_costs[n] = v
            if relaxation is None:
                return None
            if self.memory is not None:  # a layout for ``solver/recompute.py``
                self.memory.lagrange.remember(relaxation.choice)
            scored = self._scored(relaxation, pattern, lam)
            if best is None or scored[0] < best[0]:
                best = scored
        return best

    def _delta(self, pattern: tuple, lam: float) -> dict[int, np.ndarray]:
        """Per node, what the multiplier and ``pattern`` add to its cost."""
        delta = {n: lam * v for n, v in self.base.items()}
        for g, mode in zip(self.groups, pattern, strict=True):
            if mode == RELAXED:
                for n, v in g.cheapest(lam, self.problem.node_costs).items():
                    delta[n] = delta[n] + g.count * v if n in delta else g.count * v
                continue
            for n, v in g.cost[mode].items():
                delta[n] = delta[n] + g.count * v if n in delta else g.count * v
            for n, v in g.kept[mode].items():
                add = lam * g.count * v
                delta[n] = delta[n] + add if n in delta else add
        return delta

    def _scored(
        self, relaxation: Relaxation, pattern: tuple, lam: float = 0.0
    ) -> tuple[float, float]:
        """(the LP value less its slack, the peak row's bytes at its choice under ``pattern``;
        a relaxed group's layers count as the mode cheapest there)."""
        value = relaxation.bound - abs(relaxation.bound) * LP_SLACK
        used = sum(float(v[relaxation.choice[n]]) for n, v in self.base.items())
        for g, mode in zip(self.groups, pattern, strict=True):
            if mode == RELAXED:
                mode = g.mode_at(lam, relaxation.choice)
            used += g.count * sum(float(v[relaxation.choice[n]]) for n, v in g.kept[mode].items())
        return value, used

    def maximise(
        self,
        limit: float,
        known: float | None = None,
        incumbent: float | None = None,
        enough: Callable[[float], bool] | None = None,
    ) -> tuple[float, float, bool] | None:
        """(max over lam of LB(lam), the lam that gave it, whether ``enough`` stopped it early:
        it is asked after each multiplier): lam = 0 (the LP bound), then a
        first multiplier, growing x4 while the row is over, then bisection on its excess. The
        first: ``known`` (found on a sibling problem), else the slope from the LP optimum to
        the ``incumbent`` (seconds per byte over the limit: the price at which the two tie),
        else the scale where memory is worth the step's seconds."""
        first = self.value(0.0)
        if first is None:
            return None
        best = (first[0], 0.0)
        if first[1] <= limit:
            return (*best, False)  # the unconstrained minimiser's row fits: no multiplier raises it
        if enough is not None and enough(best[0]):
            return (*best, True)
        lo, hi, growing = 0.0, max(abs(first[0]), 1e-12) / limit, True
        if incumbent is not None and incumbent > first[0]:
            hi = (incumbent - first[0]) / (first[1] - limit)
        if known:
            hi = known
        for _ in range(STEPS):  # multiply by 4 until the row fits, then bisect
            lam = hi if growing else (lo + hi) / 2
            found = self.value(lam)
            if found is None:
                return (*best, False)
            if found[0] - lam * limit > best[0]:
                best = (found[0] - lam * limit, lam)
            if enough is not None and enough(best[0]):
                return (*best, True)
            if found[1] > limit:  # the row is still over: memory is worth more
                lo, hi = lam, 4 * lam if growing else hi
            else:
                hi, growing = lam, False
        return (*best, False)


def _with(enough: Callable[[float], bool] | None, best: float | None):  # type: ignore[no-untyped-def]
    """``enough`` asked about the better of a time point's bound and ``best`` (the other
    points' so far)."""
    if enough is None or best is None:
        return enough
    return lambda bound: enough(max(bound, best))


def _frees(mode: str | None, cls: str) -> bool:
    return mode == "full" or (mode == "selective" and cls == "selective")


def _key(per_mode: dict) -> tuple:
    return tuple(
        (mode, tuple(sorted((n, v.tobytes()) for n, v in nodes.items())))
        for mode, nodes in per_mode.items()
    )
