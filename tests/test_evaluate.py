"""sp.evaluate prices a strategy with the planner's cost model; the planner is never worse."""

from __future__ import annotations

import pytest
import shardplan as sp
import shardplan.costmodel.simulate as simulate_module
from shardplan.api.evaluate import model_flops
from shardplan.costmodel import get_cluster, group_link
from shardplan.ir.models import TransformerConfig, training_step
from shardplan.solver.planner import plan_graph
from shardplan.solver.serialize import plan_from_json

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


# -- pipelines (issue 14 point 5) ---------------------------------------------------------------
PIPE = TransformerConfig("tiny-pipe", 4, 256, 4, 1024, 512, 64)
PIPE_MESH = sp.Mesh({"pp": 2, "dp": 2, "tp": 2}, cluster="h100-sxm")


def test_evaluate_prices_a_pipelined_strategy_with_plan_pipelines_stage_model() -> None:
    """megatron(tp, pp, microbatches) is priced by plan_pipeline with equal stages and the
    strategy's micro-batch count: the same number as calling plan_pipeline by hand."""
    from shardplan.solver.pipeline import plan_pipeline

    graph = training_step(PIPE, batch=8)
    strategy = sp.strategies.megatron(tp=2, pp=2, microbatches=4, recompute="selective")
    ev = sp.evaluate(graph, mesh=PIPE_MESH, strategy=strategy)
    pipe = ev.plan.pipeline
    assert pipe is not None
    assert [s.layers for s in pipe.stages] == [(0, 1), (2, 3)]
    assert pipe.microbatches == 4
    assert ev.step_time == ev.plan.step_time == pipe.step_time
    assert ev.plan.mesh == PIPE_MESH
    stage_mesh = sp.Mesh({"dp": 2, "tp": 2}, cluster="h100-sxm")
    by_hand = plan_pipeline(
        training_step(PIPE, batch=8), PIPE_MESH, microbatches=4, stage_bounds=(0, 2),
        pins=strategy.pins(graph, stage_mesh), recompute=strategy.recompute_decisions(graph),
        merge_followers=True,
    )  # fmt: skip
    assert ev.step_time == by_hand.step_time
    # more micro-batches shrink the bubble of the same stages
    one = sp.evaluate(graph, mesh=PIPE_MESH, strategy=sp.strategies.megatron(tp=2, pp=2))
    assert one.plan.pipeline.microbatches == 1
    assert ev.step_time < one.step_time
    # MFU counts every device of the mesh, pp included
    peak = 8 * get_cluster("h100-sxm").peak("bf16")
    assert ev.mfu == pytest.approx(model_flops(graph) / (ev.step_time * peak))


def test_free_pipeline_plan_is_never_worse_than_the_evaluated_megatron_pipeline() -> None:
    graph = training_step(PIPE, batch=8)
    plan = sp.plan(graph, mesh=PIPE_MESH, time_limit=20)
    for m in (1, 2, 4, 8):
        strategy = sp.strategies.megatron(tp=2, pp=2, microbatches=m)
        ev = sp.evaluate(graph, mesh=PIPE_MESH, strategy=strategy)
        assert plan.step_time <= ev.step_time * (1 + 1e-9), m


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: sp.strategies.megatron(tp="tp", dp=4), "dp takes mesh axis names"),
        (lambda: sp.strategies.megatron(tp=4, pp=2), "tp=4 but the mesh's 'tp' axis has size 2"),
        (lambda: sp.strategies.megatron(tp="model", pp=2), "'model' is not an axis of the mesh"),
        (lambda: sp.strategies.megatron(tp=2, pp=4), "pp=4 but the mesh"),
        (lambda: sp.strategies.megatron(tp=2, pp=2, dp=("data",)), "'data' is not an axis"),
        (lambda: sp.strategies.fsdp(), "pp=1 but the mesh"),
        (lambda: sp.strategies.megatron(tp=2, pp=2, microbatches=0), "positive integer"),
        (lambda: sp.strategies.megatron(tp=2.0, pp=2), "axis name or a degree"),
    ],
)
def test_bad_strategy_arguments_raise_a_clear_error(make, message: str) -> None:
    graph = training_step(PIPE, batch=8)
    with pytest.raises(sp.ShardplanError, match=message):
        sp.evaluate(graph, mesh=PIPE_MESH, strategy=make())


def test_interleaved_pipeline_shrinks_the_bubble_by_the_chunk_count() -> None:
    """megatron(..., chunks=v): interleaved 1F1B's bubble is (p - 1) / (v m + p - 1); the step
    drops by (1 - 1/v) of the fill/drain time of equal stages, and its fill and drain cross
    p v - 1 hand-offs each instead of p - 1."""
    graph = training_step(PIPE, batch=8)
    plain = sp.evaluate(
        graph, mesh=PIPE_MESH, strategy=sp.strategies.megatron(2, pp=2, microbatches=4)
    )
    inter = sp.evaluate(
        graph, mesh=PIPE_MESH, strategy=sp.strategies.megatron(2, pp=2, microbatches=4, chunks=2)
    )
    assert inter.plan.pipeline.schedule == "interleaved"
    assert inter.plan.pipeline.chunks == 2
    assert plain.plan.pipeline.bubble_fraction == pytest.approx(1 / 5)
    assert inter.plan.pipeline.bubble_fraction == pytest.approx(1 / 9)
    times = [s.time for s in plain.plan.pipeline.stages]
    saved = (sum(times) - max(times)) / 4 * (1 - 1 / 2)  # (sum t - max t) / m, halved
    extra_hops = 2 * 2 * (2 - 1)  # 2 (p v - 1) - 2 (p - 1) with p = v = 2
    hop = (inter.step_time - (plain.step_time - saved)) / extra_hops
    link = group_link(("pp",), PIPE_MESH, get_cluster("h100-sxm"))
    micro_batch_bytes = 8 // 4 * PIPE.seq * PIPE.hidden * 4  # hidden states of one micro-batch
    assert link.latency <= hop <= link.latency + micro_batch_bytes / link.p2p_bandwidth
    loaded = plan_from_json(inter.plan.to_json())
    assert loaded.pipeline.chunks == 2
    assert loaded.step_time == inter.step_time
    with pytest.raises(sp.ShardplanError, match="divisible by pp"):
        sp.evaluate(graph, mesh=PIPE_MESH,
                    strategy=sp.strategies.megatron(2, pp=2, microbatches=3, chunks=2))  # fmt: skip


def test_tp_comm_overlap_inside_pipeline_stages() -> None:
    """With a pipeline, tp_comm_overlap shortens the stages (their TP all-gathers and
    reduce-scatters run chunked under their GEMMs) by at most those collectives' time."""
    graph = training_step(PIPE, batch=8)

    def run(overlap: bool):  # type: ignore[no-untyped-def]
        strategy = sp.strategies.megatron(
            2, pp=2, microbatches=4, sequence_parallel=True, tp_comm_overlap=overlap
        )
        return sp.evaluate(graph, mesh=PIPE_MESH, strategy=strategy)

    plain, overlapped = run(False), run(True)
    assert overlapped.plan.shardings == plain.plan.shardings
    tp_time = sum(
        r.time for r in plain.plan.reshards
        if r.consumer.startswith("op:") and any(c.axes == ("tp",) for c in r.collectives)
    )  # fmt: skip
    assert tp_time > 0
    assert overlapped.step_time < plain.step_time
    saved = sum(s.time for s in plain.plan.pipeline.stages) - sum(
        s.time for s in overlapped.plan.pipeline.stages
    )
    assert 0 < saved <= tp_time
