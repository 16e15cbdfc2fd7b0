"""The Lagrangian bound on the peak row (``solver/lagrange.py``): a valid lower bound on the
memory-bound optimum, at least the LP bound, and above it when the limit binds."""

from __future__ import annotations

import pytest
import shardplan as sp
from shardplan.ir.models import TransformerConfig
from shardplan.solver.lagrange import memory_lower_bound
from shardplan.solver.lp import solve_relaxation
from shardplan.solver.memory_terms import build_memory_model

CONFIG = TransformerConfig("t", 2, 256, 4, 1024, 512, 64)
MESH = sp.Mesh({"dp": 2, "tp": 2}, cluster="h100-sxm")
LIMIT = 44 * 2**20  # the LP optimum peaks at 46.0 MiB, 41.8 MiB recomputing selectively


@pytest.fixture(scope="module")
def solved(shrunk_step):  # type: ignore[no-untyped-def]
    space, cluster, problem = shrunk_step(CONFIG, MESH, LIMIT)
    memory = build_memory_model(space, cluster, LIMIT)
    lp = solve_relaxation(problem.copy())
    assert lp is not None
    assert memory.profile(problem.expand(lp.choice), {}).peak > LIMIT  # the limit binds
    plan = problem.expand(lp.choice)  # a plan that fits: the LP's layouts, recomputed
    decisions = dict.fromkeys(memory.live.layers, "selective")
    assert memory.profile(plan, decisions).peak <= LIMIT
    cost = problem.evaluate(plan) + memory.recompute_cost(plan, decisions)
    return problem, memory, lp, plan, decisions, cost


def test_the_bound_lies_between_the_lp_bound_and_every_fitting_plan(solved) -> None:  # type: ignore[no-untyped-def]
    problem, memory, lp, plan, decisions, cost = solved
    bound = memory_lower_bound(problem, memory, plan, decisions)
    assert bound is not None
    assert lp.bound * 1.001 < bound <= cost  # memory priced: above the unconstrained LP bound
    full = dict.fromkeys(memory.live.layers, "full")  # another plan that fits
    if memory.profile(plan, full).peak <= LIMIT:
        assert bound <= problem.evaluate(plan) + memory.recompute_cost(plan, full)


def test_relaxed_groups_still_bound_from_below(solved, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A group priced without a mode (``RELAX_SHARE``: per node the cheapest mode's delta)
    lowers LB(lam) at every multiplier (so it stays a lower bound), with one LP per multiplier
    instead of one per mode pattern; the bound stays above the LP bound and below the plan."""
    from shardplan.costmodel import get_cluster
    from shardplan.solver import lagrange

    problem, memory, lp, plan, decisions, cost = solved
    k = memory.peak(problem.expand(lp.choice), {})[1]  # the row the LP optimum breaks
    exact = lagrange._Priced.at(problem, memory, k, lp, [100])
    monkeypatch.setattr(lagrange, "RELAX_SHARE", 1)  # every group that chooses is relaxed
    relaxed = lagrange._Priced.at(problem, memory, k, lp, [100])
    assert exact is not None
    assert relaxed is not None
    assert all(g.relaxed for g in relaxed.groups if len(g.modes) > 1)
    assert any(len(g.modes) > 1 for g in relaxed.groups)
    for scale in (0.5, 2.0, 8.0):
        lam = scale * lp.bound / LIMIT
        low, high = relaxed.value(lam), exact.value(lam)
        assert low is not None
        assert high is not None
        assert low[0] <= high[0] * (1 + 1e-9)
    assert 100 - relaxed.budget[0] == 3  # one LP per multiplier
    fresh = build_memory_model(memory.space, get_cluster(MESH.cluster), LIMIT)
    bound = memory_lower_bound(problem, fresh, plan, decisions)
    assert bound is not None
    assert lp.bound * (1 - 1e-6) <= bound <= cost
