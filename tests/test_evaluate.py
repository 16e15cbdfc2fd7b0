"""sp.evaluate prices a strategy with the planner's cost model; the planner is never worse."""

from __future__ import annotations

import shardplan as sp
from shardplan.models import TransformerConfig, training_step
from shardplan.solver.planner import plan_graph

TINY = TransformerConfig("tiny", 2, 256, 4, 1024, 512, 64)
MESH = sp.Mesh({"dp": 2, "tp": 4}, cluster="h100-sxm")


def test_evaluate_reports_time_memory_and_oom() -> None:
    graph = training_step(TINY, batch=8)
    ev = sp.evaluate(graph, mesh=MESH, strategy=sp.strategies.dp())
    assert ev.fits
    assert ev.step_time > 0
    assert 0 < ev.mfu < 1
    assert ev.throughput == 8 * 64 / ev.step_time
    assert ev.peak_memory_bytes == sum(ev.memory.values())
    tight = sp.evaluate(graph, mesh=MESH, strategy=sp.strategies.dp(), memory_limit=1e6)
    assert not tight.fits
    assert tight.peak_memory_bytes > 1e6
    assert graph.inputs[0].pinned is False  # the graph's own annotations are restored


def test_planner_never_worse_than_the_baselines() -> None:
    graph = training_step(TINY, batch=8)
    plan = plan_graph(graph, MESH)
    for strategy in (sp.strategies.dp(), sp.strategies.fsdp(), sp.strategies.megatron("tp")):
        ev = sp.evaluate(graph, mesh=MESH, strategy=strategy)
        assert plan.step_time <= ev.step_time * (1 + 1e-9), strategy.name
