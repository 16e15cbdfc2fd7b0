"""CP-SAT stops at a deterministic-time budget, not at a wall-clock one: a search cut short by
``time_limit`` returns the same plan however much wall time it was given or how busy the
machine is (solver/ilp.py, ``DETERMINISTIC_PER_SECOND`` and ``WALL_BACKSTOP``)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from shardplan.solver import ilp
from shardplan.solver.problem import Problem

TIME_LIMIT = 0.4
"""Seconds of ``time_limit``: 0.1 deterministic seconds, about 1 s of wall time on a busy
2-core box, far from enough to prove this problem optimal (checked below)."""


def _problem(seed: int = 0, nodes: int = 30, k: int = 4, degree: int = 3) -> Problem:
    """A random sparse graph with dense edge matrices: no node can be eliminated cheaply and
    the LP is fractional, so CP-SAT searches until its limit stops it."""
    rng = np.random.default_rng(seed)
    problem = Problem([f"n{i}" for i in range(nodes)], [rng.uniform(0, 1, k) for _ in range(nodes)])
    for u in range(nodes):
        for v in rng.choice(nodes, size=degree, replace=False):
            if v != u:
                problem.add_grouped_edge(
                    u, int(v), np.arange(k), np.arange(k), rng.uniform(0, 1, (k, k))
                )
    return problem


def _solve(time_limit: float = TIME_LIMIT) -> ilp.Solution:
    """Warm-started from all-zero choices (an incumbent from the start, as the LP gives)."""
    problem = _problem()
    hints = dict.fromkeys(range(len(problem.node_costs)), 0)
    return ilp.solve(problem, time_limit=time_limit, hints=hints)


@pytest.fixture(scope="module")
def reference() -> ilp.Solution:
    return _solve()


def test_the_budget_cuts_the_search(reference: ilp.Solution) -> None:
    """The case is not trivial: CP-SAT used its whole deterministic budget and did not prove
    optimality (a larger budget finds a better plan)."""
    assert reference.status == "FEASIBLE"
    assert reference.work == pytest.approx(TIME_LIMIT * ilp.DETERMINISTIC_PER_SECOND, rel=0.05)
    assert _solve(2.5 * TIME_LIMIT).objective < reference.objective


def test_same_plan_under_another_wall_clock_budget(
    reference: ilp.Solution, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ilp, "WALL_BACKSTOP", 1000.0)
    other = _solve()
    assert other.choice == reference.choice
    assert other.objective == reference.objective


def test_same_plan_on_a_busier_machine(reference: ilp.Solution) -> None:
    """Two processes spinning on the CPU while it solves: slower in wall time, same plan."""
    spin = "import time\nend = time.time() + 30\nwhile time.time() < end: pass"
    hogs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]
    try:
        busy = _solve()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert busy.choice == reference.choice
    assert busy.objective == reference.objective
