"""The memory-bound primal heuristic (``solver/recompute.py``): given layouts, its outer-first
recomputation is the cheapest of all 3^L assignments that fit (brute force), and a solve that
uses it returns a plan that fits, no slower than the seed, with an honest bound."""

from __future__ import annotations

import itertools

import pytest
import shardplan as sp
from shardplan.ir.models import TransformerConfig, training_step
from shardplan.solver.lp import solve_relaxation
from shardplan.solver.memory_terms import build_memory_model
from shardplan.solver.recompute import cheapest_fit

CONFIG = TransformerConfig("t", 4, 256, 4, 1024, 512, 64)
MESH = sp.Mesh({"dp": 2, "tp": 2}, cluster="h100-sxm")


@pytest.fixture(scope="module")
def setup(shrunk_step):  # type: ignore[no-untyped-def]
    space, cluster, problem = shrunk_step(CONFIG, MESH, None)
    lp = solve_relaxation(problem.copy())
    assert lp is not None
    return space, cluster, problem, problem.expand(lp.choice)


@pytest.mark.parametrize("fraction", [0.15, 0.5, 0.85])
def test_outer_first_recomputation_is_the_cheapest_that_fits(setup, fraction) -> None:  # type: ignore[no-untyped-def]
    space, cluster, problem, choice = setup
    probe = build_memory_model(space, cluster, None)
    layers = list(probe.live.layers)
    none = probe.peak(choice, {})[0]
    full = probe.peak(choice, dict.fromkeys(layers, "full"))[0]
    assert full < none  # recomputing frees memory on this model
    limit = full + fraction * (none - full)
    memory = build_memory_model(space, cluster, limit)
    best = None
    for modes in itertools.product((None, "selective", "full"), repeat=len(layers)):
        decisions = {layer: m for layer, m in zip(layers, modes, strict=True) if m}
        if memory.peak(choice, decisions)[0] <= limit:
            cost = memory.recompute_cost(choice, decisions)
            best = cost if best is None else min(best, cost)
    found = cheapest_fit(problem, memory, choice)
    assert found is not None
    assert best is not None
    cost, decisions = found
    assert memory.peak(choice, decisions)[0] <= limit
    assert cost == pytest.approx(best, rel=1e-12, abs=1e-15)
    assert cost == pytest.approx(memory.recompute_cost(choice, decisions))


def test_nothing_fits_gives_none(setup) -> None:  # type: ignore[no-untyped-def]
    space, cluster, problem, choice = setup
    probe = build_memory_model(space, cluster, None)
    full = probe.peak(choice, dict.fromkeys(probe.live.layers, "full"))[0]
    memory = build_memory_model(space, cluster, full - 1)
    assert cheapest_fit(problem, memory, choice) is None


def test_a_proven_memory_bound_plan_skips_the_other_objective(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``sp.plan`` under a binding limit on 8 layers (``MEMORY_BOUND_LAYERS``): the plain
    objective's solve is proven within ``MEMORY_GAP`` (here 5%: the seed is 2.6% from its
    bound), so the overlap-weighted variant is neither prepared nor solved, and the plan fits
    and reports an honest gap."""
    from shardplan.api import idle_devices
    from shardplan.solver import memory_solve, shrinking, solve_pass

    monkeypatch.setattr(memory_solve, "MEMORY_GAP", 0.05)
    # the free plan's solves only: the idle-devices check plans its own data-parallel
    # alternatives (tests/test_idle_devices.py)
    monkeypatch.setattr(idle_devices, "check_idle_devices", lambda free, *a, **k: free)
    solves, shrinks = [], []
    solve, shrink_ = solve_pass.solve, shrinking.shrink
    monkeypatch.setattr(solve_pass, "solve", lambda *a, **k: solves.append(1) or solve(*a, **k))
    monkeypatch.setattr(shrinking, "shrink", lambda *a, **k: shrinks.append(1) or shrink_(*a, **k))
    graph = training_step(TransformerConfig("t", 8, 256, 4, 1024, 512, 64), batch=8)
    limit = 164 * 2**20  # the LP optimum peaks at 167.6 MiB (tests/solver/test_memory_gap.py)
    plan = sp.plan(graph, mesh=MESH, memory_limit=limit)
    s = plan.solver
    assert s.status == "FEASIBLE"
    assert 0 <= s.objective - s.bound <= memory_solve.MEMORY_GAP * s.objective
    assert plan.peak_memory_bytes <= limit
    assert len(solves) == 1  # the plain objective only
    assert shrinks == [1]  # the seed's shrink, reused by the plain variant
