"""Memory-bound planning (issue 15): under memory pressure the free plan fits the limit and is
never slower than the best fitting hand-written strategy, priced by the same cost model."""

from __future__ import annotations

import numpy as np
import pytest
import shardplan as sp
from shardplan.ir.models import TransformerConfig, training_step

TINY = TransformerConfig("tiny", 2, 256, 4, 1024, 512, 64)
MESH = sp.Mesh({"dp": 2, "tp": 4}, cluster="h100-sxm")


@pytest.mark.slow  # ~20 s per limit alone on the 2-core box (15 baselines priced twice)
@pytest.mark.parametrize("limit_mib", [12, 16])
def test_plan_is_never_slower_than_the_best_fitting_baseline(limit_mib: int) -> None:
    limit = limit_mib * 2**20
    graph = training_step(TINY, batch=8)
    fitting = []
    for strategy in sp.strategies.baselines(MESH):
        ev = sp.evaluate(graph, mesh=MESH, strategy=strategy, memory_limit=limit)
        if ev.fits:
            fitting.append((ev.step_time, strategy.name))
    assert fitting, "the limit leaves no hand-written strategy: the test would prove nothing"
    best_time, best_name = min(fitting)
    plan = sp.plan(graph, mesh=MESH, memory_limit=limit)
    assert plan.solver.status in ("OPTIMAL", "FEASIBLE")
    assert plan.peak_memory_bytes <= limit
    assert plan.step_time <= best_time * (1 + 1e-9), (plan.step_time, best_time, best_name)


def test_recomputing_outer_alike_layers_first_loses_nothing() -> None:
    """The symmetry-breaking rows (``memory.alike_pairs``: outer alike layers recompute at least
    as much as inner ones) keep the optimum: for every recomputation of the ordered layers, the
    same modes sorted outer-first cost the same and peak no higher (all 3^k assignments, on the
    real memory model of a 4-layer step)."""
    import itertools
    from types import SimpleNamespace

    from shardplan.costmodel import get_cluster
    from shardplan.solver.costs import build_problem, build_space
    from shardplan.solver.memory_rows import _resolution, alike_pairs
    from shardplan.solver.memory_terms import build_memory_model
    from shardplan.solver.planner import shrink

    mesh = sp.Mesh({"dp": 2}, cluster="h100-sxm")
    graph = training_step(TransformerConfig("tiny", 4, 128, 4, 512, 512, 64), batch=8)
    graph.mesh = mesh
    cluster = get_cluster(mesh.cluster)
    space = build_space(graph, mesh)
    problem = build_problem(space, cluster, None)
    memory = build_memory_model(space, cluster, None)
    shrink(problem, space, True, True)
    windows: dict = {}
    for t in memory.terms:
        if t.freed_by is not None:
            windows.setdefault(t.freed_by, []).append(t)
    pairs = alike_pairs(memory, windows, SimpleNamespace(resolve=_resolution(problem)))
    chain = [pairs[0][0]] + [inner for _, inner in pairs]
    assert [outer for outer, _ in pairs] == chain[:-1], pairs  # one chain, outer to inner
    assert len(chain) >= 3, chain
    live = problem.live_nodes()
    picked = [0] * len(problem.node_costs)
    for n in live:
        picked[n] = int(np.flatnonzero(np.isfinite(problem.node_costs[n]))[0])
    choice = problem.expand(picked)
    modes = (None, "selective", "full")
    strictly_lower = 0
    for levels in itertools.product(range(3), repeat=len(chain)):
        given = {layer: modes[k] for layer, k in zip(chain, levels, strict=True) if k}
        ordered = sorted(levels, reverse=True)
        swapped = {layer: modes[k] for layer, k in zip(chain, ordered, strict=True) if k}
        assert memory.recompute_cost(choice, swapped) == pytest.approx(
            memory.recompute_cost(choice, given), rel=1e-12
        )
        peak = memory.profile(choice, given).peak
        assert memory.profile(choice, swapped).peak <= peak
        strictly_lower += memory.profile(choice, swapped).peak < peak
    assert strictly_lower  # the order matters somewhere: the test can fail


def test_fold_layers_names_runs() -> None:
    from shardplan.solver.summary import fold_layers

    names = [f"model.layers.{i}" for i in (0, 1, 2, 3, 7, 8)]
    assert fold_layers(names) == "model.layers.{0-3,7-8} (6 layers)"
    assert fold_layers(["model.layers.5"]) == "model.layers.5 (1 layer)"
