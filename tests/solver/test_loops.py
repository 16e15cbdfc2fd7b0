"""Loops planned once: ops that run ``repeat`` times per step; a carry tied across iterations."""

from __future__ import annotations

import pytest
import shardplan as sp
from shardplan.costmodel import get_cluster
from shardplan.ir import Role
from shardplan.ir.builder import GraphBuilder
from shardplan.solver.brute_force import brute_force
from shardplan.solver.costs import build_problem, build_space
from shardplan.solver.ilp import solve
from shardplan.solver.planner import evaluate_choice, tie_loop_carries


def loop(steps: int, batch: int, hidden: int):
    """``h = relu(h @ w)`` for ``steps`` iterations: the body once, between the carry entering
    the loop (``scan_carry``) and handed to the next iteration (``scan_loop``)."""
    b = GraphBuilder("loop")
    x = b.input("x", (batch, hidden), "bf16", role=Role.INPUT)
    w = b.param("w", (hidden, hidden), "bf16")
    h = b.op("scan_carry", [x], [x.type])
    y = b.relu(b.dot(h, w))
    out = b.op("scan_loop", [y], [y.type], carry=h.name, repeat=steps)
    for value in (y, y.producer.operands[0]):  # the body's ops run every iteration
        value.producer.attrs["repeat"] = steps
    b.output(out)
    return b.build(), h, out


def test_repeat_scales_compute_and_reshards_but_not_the_layouts() -> None:
    mesh = sp.Mesh({"x": 8}, cluster="h100-sxm")
    once, _, _ = loop(1, batch=8, hidden=16384)
    eight, h, out = loop(8, batch=8, hidden=16384)
    p1, p8 = sp.plan(once, mesh=mesh), sp.plan(eight, mesh=mesh)
    assert [p1.shardings[v.name] for v in once.values()] == [
        p8.shardings[v.name] for v in eight.values()
    ]
    assert p8.compute_time == pytest.approx(8 * p1.compute_time)
    assert p8.shardings[out.name] == p8.shardings[h.name]  # back in the layout it entered with
    looped = [r for r in p8.reshards if r.count == 8]
    assert looped  # a huge hidden splits the weight: each iteration moves the carry
    assert p8.comm_time == pytest.approx(sum(r.time for r in p8.reshards))
    assert sum(r.time for r in looped) == pytest.approx(
        8 * sum(c.time for c in looped[0].collectives)
    )


@pytest.mark.parametrize("shape", [(8, 64), (512, 16)])
def test_tied_loop_ilp_equals_brute_force(shape) -> None:
    batch, hidden = shape
    graph, h, out = loop(5, batch=batch, hidden=hidden)
    mesh = sp.Mesh({"x": 2, "y": 2}, cluster="cpu-test")
    graph.mesh = mesh
    space = build_space(graph, mesh)
    cluster = get_cluster(mesh.cluster)
    problem = build_problem(space, cluster, None)
    tie_loop_carries(problem, space)
    truth, cost = brute_force(problem)
    solution = solve(problem, 30.0)
    assert solution.objective == pytest.approx(cost, rel=1e-6, abs=1e-12)
    for choice in (truth, solution.choice):
        assert space.layout(out, choice) == space.layout(h, choice)
        # the objective counts every iteration, as a from-scratch recount does
        assert evaluate_choice(space, cluster, choice) == pytest.approx(cost, rel=1e-6)
