"""The Lagrangian bound on the peak row (``solver/lagrange.py``): a valid lower bound on the
memory-bound optimum, at least the LP bound, and above it when the limit binds."""

from __future__ import annotations

import pytest
import shardplan as sp
from shardplan.models import TransformerConfig
from shardplan.solver.lagrange import memory_lower_bound
from shardplan.solver.lp import solve_relaxation
from shardplan.solver.memory import build_memory_model

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
