"""sp.evaluate prices a strategy with the planner's cost model; the planner is never worse."""

from __future__ import annotations

import pytest
import shardplan as sp
import shardplan.costmodel.simulate as simulate_module
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


def test_tp_comm_overlap_hides_pipelined_collectives_only(monkeypatch) -> None:
    """``tp_comm_overlap`` keeps the layouts and compute; it only pipelines the tp all-gathers
    into GEMMs and reduce-scatters out of them, so the step drops by at most their time and
    never below the compute."""
    graph = training_step(TINY, batch=8)
    mesh = sp.Mesh({"tp": 4}, cluster="h100-sxm")
    plain = sp.evaluate(
        graph, mesh=mesh, strategy=sp.strategies.megatron(4, sequence_parallel=True)
    )
    strategy = sp.strategies.megatron(4, sequence_parallel=True, tp_comm_overlap=True)
    overlapped = sp.evaluate(graph, mesh=mesh, strategy=strategy)
    assert overlapped.plan.shardings == plain.plan.shardings
    assert overlapped.plan.compute_time == plain.plan.compute_time

    seen: list[list[simulate_module.Transfer]] = []
    real = simulate_module.simulate_graph

    def spy(graph, times, transfers, options=None):  # type: ignore[no-untyped-def]
        seen.append(list(transfers))
        return real(graph, times, transfers, options)

    monkeypatch.setattr(simulate_module, "simulate_graph", spy)
    options = simulate_module.SimulationOptions(tp_overlap_axes=("tp",))
    again = simulate_module.simulate(overlapped.plan, options)
    assert overlapped.step_time == pytest.approx(again.step_time)
    pipelined = sum(t.time for t in seen[0] if t.pipelined)
    assert pipelined > 0
    assert overlapped.step_time < plain.step_time
    assert overlapped.step_time >= plain.step_time - pipelined - 1e-12
    assert overlapped.step_time >= overlapped.plan.compute_time
    with pytest.raises(ValueError, match="sequence_parallel"):
        sp.strategies.megatron(4, tp_comm_overlap=True)
