"""Memory-bound planning (issue 15): under memory pressure the free plan fits the limit and is
never slower than the best fitting hand-written strategy, priced by the same cost model."""

from __future__ import annotations

import pytest
import shardplan as sp
from shardplan.models import TransformerConfig, training_step

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
