"""A seeded memory-bound solve stops at a proven gap (``memory_solve.MEMORY_GAP``): the seed is
returned without a search when the LP bound is already that close, and the exact search finds
nothing better than the bound allows."""

from __future__ import annotations

import numpy as np
import pytest
import shardplan as sp
from shardplan.ir.models import TransformerConfig
from shardplan.solver import ilp, memory_solve
from shardplan.solver.lp import solve_relaxation
from shardplan.solver.memory_terms import build_memory_model

CONFIG = TransformerConfig("t", 8, 256, 4, 1024, 512, 64)  # MEMORY_BOUND_LAYERS layers
MESH = sp.Mesh({"dp": 2, "tp": 2}, cluster="h100-sxm")
LIMIT = 164 * 2**20
"""The LP optimum peaks at 167.6 MiB; recomputing the outermost layer selectively, 163.3 MiB
for 2.6% more time."""


@pytest.fixture(scope="module")
def setup(shrunk_step):  # type: ignore[no-untyped-def]
    space, cluster, problem = shrunk_step(CONFIG, MESH, LIMIT)
    lp = solve_relaxation(problem.copy())
    assert lp is not None
    return space, cluster, problem, {n: lp.choice[n] for n in problem.live_nodes()}


def _solve(setup, gap: float, monkeypatch):  # type: ignore[no-untyped-def]
    """(solution, CP-SAT searches run) with ``MEMORY_GAP`` at ``gap``."""
    space, cluster, problem, hints = setup
    monkeypatch.setattr(memory_solve, "MEMORY_GAP", gap)
    searches = []
    search = ilp._solve_cpsat
    monkeypatch.setattr(ilp, "_solve_cpsat", lambda *a, **k: searches.append(1) or search(*a, **k))
    memory = build_memory_model(space, cluster, LIMIT)
    assert len(memory.live.layers) >= memory_solve.MEMORY_BOUND_LAYERS
    memory.hint_decisions = {"layers.0": "selective"}  # the seed: the LP's layouts, one layer
    solution = ilp.solve(problem.copy(), 30.0, dict(hints), memory=memory, work_limit=0.5)
    assert solution.choice
    assert memory.profile(solution.choice).peak <= LIMIT
    return solution, len(searches)


def test_a_seed_within_the_gap_is_returned_without_a_search(setup, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    stopped, searches = _solve(setup, 0.05, monkeypatch)  # the seed is 2.6% above the LP bound
    assert searches == 0
    assert stopped.status == "FEASIBLE"
    assert 0 < stopped.objective - stopped.bound <= 0.05 * stopped.objective
    searched, searches = _solve(setup, 0.0, monkeypatch)  # no stop: CP-SAT searches
    assert searches == 1
    assert stopped.bound <= searched.objective <= stopped.objective  # from the seed, not below


def test_the_fast_peak_equals_the_profile(setup) -> None:  # type: ignore[no-untyped-def]
    space, cluster, problem, _ = setup
    memory = build_memory_model(space, cluster, LIMIT)
    rng = np.random.default_rng(0)
    layers = list(memory.live.layers)
    for _ in range(20):
        choice = [int(rng.integers(len(c))) for c in problem.node_costs]
        decisions = {
            layer: mode
            for layer in layers
            if (mode := (None, "selective", "full")[int(rng.integers(3))]) is not None
        }
        profile = memory.profile(choice, decisions)
        assert memory.peak(choice, decisions) == (profile.peak, profile.peak_time)
