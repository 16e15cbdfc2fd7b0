"""Pipeline plans end to end: stages on a small model, and GPT-175B's published configuration."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import shardplan as sp
from shardplan import strategies
from shardplan.ir.models import GPT_125M, TransformerConfig, training_step
from shardplan.solver.batch import plan_batch_split
from shardplan.solver.pipeline import plan_pipeline
from shardplan.solver.report import format_bytes
from shardplan.solver.serialize import plan_from_json

GPT_175B = TransformerConfig("gpt-175b", 96, 12288, 96, 49152, 51200, 2048, arch="gpt")
A100_PP8_TP8 = sp.Mesh({"pp": 8, "tp": 8}, cluster="a100-80gb")
A100_MEMORY = 80e9


def test_pipeline_plan_covers_every_layer_once_in_order() -> None:
    graph = training_step(GPT_125M, batch=16, layers=8, seq=1024)
    plan = sp.plan(graph, mesh=sp.Mesh({"pp": 4, "tp": 2}, cluster="h100-sxm"))
    stages = plan.pipeline.stages
    assert len(stages) == 4
    assert [layer for s in stages for layer in s.layers] == list(range(8))
    assert stages[0].first_stage_extras
    assert plan.step_time == plan.pipeline.step_time
    assert all(s.memory_bytes <= 80e9 for s in stages)
    # the per-op times priced once per signature and layouts equal pricing every op
    from shardplan.costmodel import get_cluster
    from shardplan.costmodel.fusion import fusion
    from shardplan.passes.enumerate_strategies import Choice
    from shardplan.solver import pipeline
    from shardplan.solver.costs import op_cost

    plan = dataclasses.replace(plan, mesh=sp.Mesh({"tp": 2}, cluster="h100-sxm"))  # stage mesh
    cluster, fused = get_cluster("h100-sxm"), fusion(plan.graph)
    priced: list[int] = []
    real = pipeline.op_cost
    try:
        pipeline.op_cost = lambda *a: priced.append(1) or real(*a)
        times = pipeline._op_times(plan, cluster)
        pipeline.op_cost = lambda *a: 0.0
        incoming = pipeline._op_times(plan, cluster)  # the reshards feeding each op alone
    finally:
        pipeline.op_cost = real
    assert len(priced) < len(plan.graph.ops) / 2  # the layers repeat their ops and layouts
    for i, op in enumerate(plan.graph.ops):
        ins = tuple(plan.operand_shardings[(i, j)] for j in range(len(op.operands)))
        outs = tuple(plan.sharding_of(v.name) for v in op.results)
        own = op_cost(op, Choice(ins, outs, (), pipeline._split(op, ins, outs, plan)),
                      plan.mesh, cluster, fused.of(op))  # fmt: skip
        assert times[i] == pytest.approx(own + incoming[i], rel=1e-12, abs=1e-18)


def test_micro_batches_are_never_split_over_more_devices_than_they_hold() -> None:
    # A stage runs micro-batches of batch/m samples: the sub-mesh plan may not split the
    # batch wider than that (slicing the whole batch is free, a micro-batch is not).
    graph = training_step(GPT_125M, batch=8, layers=4, seq=512)
    plan = sp.plan(graph, mesh=sp.Mesh({"pp": 2, "dp": 4}, cluster="h100-sxm"))
    m = plan.pipeline.microbatches
    assert (8 // m) % plan_batch_split(plan) == 0
    fixed = sp.plan(graph, mesh=sp.Mesh({"pp": 2, "dp": 4}, cluster="h100-sxm"), microbatches=8)
    assert fixed.pipeline.microbatches == 8
    assert plan_batch_split(fixed) == 1


@functools.cache
def gpt175b_free_plan() -> sp.Plan:
    """GPT-175B, global batch 64, seq 2048, planned freely on pp=8 x tp=8 (stages, m, layouts)."""
    return sp.plan(training_step(GPT_175B, batch=64), mesh=A100_PP8_TP8)


@functools.cache
def gpt175b_megatron() -> sp.Evaluation:
    """Megatron's published configuration (Korthikanti'22 Table 5: TP 8, PP 8, 64 micro-batches,
    sequence parallel, selective recompute) through ``sp.evaluate``: the same cost model and
    stage model as the free plan."""
    strategy = strategies.megatron(
        tp=8, pp=8, microbatches=64, sequence_parallel=True, recompute="selective"
    )
    return sp.evaluate(training_step(GPT_175B, batch=64), mesh=A100_PP8_TP8, strategy=strategy)


def gpt175b_megatron_plan() -> sp.Plan:
    return gpt175b_megatron().plan


@pytest.mark.slow
def test_gpt175b_megatron_configuration_evaluates_to_the_readme_figure() -> None:
    # README: 12.51 s modelled for Korthikanti'22 Table 5's configuration (13.75 s measured,
    # -7.7%: the model leaves out what docs/costmodel.md lists). Equal stages of 12 layers.
    ev = gpt175b_megatron()
    assert [len(s.layers) for s in ev.plan.pipeline.stages] == [12] * 8
    assert ev.plan.pipeline.microbatches == 64
    assert ev.fits
    assert ev.peak_memory_bytes <= 80 * 2**30 * 0.95
    assert ev.step_time == pytest.approx(12.51, abs=0.005)
    # the same configuration through plan_pipeline by hand gives the same number
    graph = training_step(GPT_175B, batch=64)
    strategy = strategies.megatron(pp=8, sequence_parallel=True, recompute="selective")
    by_hand = plan_pipeline(
        graph, A100_PP8_TP8, microbatches=64, stage_bounds=tuple(range(0, 96, 12)),
        pins=strategy.pins(graph, sp.Mesh({"tp": 8}, cluster="a100-80gb")),
        recompute=strategy.recompute_decisions(graph),
    )  # fmt: skip
    assert by_hand.step_time == ev.step_time


@pytest.mark.slow
def test_gpt175b_free_plan_fits_and_is_no_slower_than_megatrons_configuration() -> None:
    # Issue 7: the free plan's modelled step is <= the published configuration's (TP 8, PP 8,
    # sequence parallel, selective recompute) evaluated by the same code path and cost model.
    free, megatron = gpt175b_free_plan(), gpt175b_megatron_plan()
    assert free.pipeline is not None
    # README: "12 layers per stage with 64 micro-batches at 12.26 s modelled (55.8 GiB peak
    # stage) ... against 12.51 s for Megatron's published configuration"
    assert free.step_time == pytest.approx(12.26, abs=0.005)
    assert megatron.step_time == pytest.approx(12.51, abs=0.005)
    assert free.pipeline.microbatches == 64
    assert [len(s.layers) for s in free.pipeline.stages] == [12] * 8
    assert max(s.memory_bytes for s in free.pipeline.stages) / 2**30 == pytest.approx(
        55.8, abs=0.05
    )
    assert len(free.pipeline.stages) == 8
    assert [layer for s in free.pipeline.stages for layer in s.layers] == list(range(96))
    assert max(s.memory_bytes for s in free.pipeline.stages) <= A100_MEMORY
    assert free.step_time <= megatron.step_time
    # a micro-batch is never split wider than it is
    assert (64 // free.pipeline.microbatches) % plan_batch_split(free) == 0


@pytest.mark.slow
def test_gpt175b_chosen_stages_are_at_least_as_good_as_uniform_pp8_stages() -> None:
    # Only a pp-bearing mesh allowed: the chosen split is no slower than Megatron's 12 layers
    # per stage planned the same way (same sub-mesh solves, every micro-batch count).
    free = gpt175b_free_plan()
    uniform = plan_pipeline(
        training_step(GPT_175B, batch=64), A100_PP8_TP8, stage_bounds=tuple(range(0, 96, 12))
    )
    assert [len(s.layers) for s in uniform.pipeline.stages] == [12] * 8
    assert free.step_time <= uniform.step_time


@pytest.mark.slow
def test_gpt175b_auto_schedule_is_no_slower_than_megatrons_published_interleaving() -> None:
    # Issue 15: Korthikanti'22 ran GPT-175B interleaved with V = 3 (12 layers per stage in
    # three chunks of 4); schedule="auto" lets the planner pick 1F1B or any V.
    graph = training_step(GPT_175B, batch=64)
    megatron_v3 = strategies.megatron(
        tp=8, pp=8, microbatches=64, sequence_parallel=True, recompute="selective", chunks=3
    )
    published = sp.evaluate(graph, mesh=A100_PP8_TP8, strategy=megatron_v3)
    pipe = published.plan.pipeline
    assert (pipe.schedule, pipe.chunks) == ("interleaved", 3)
    assert pipe.stages[0].chunk_layers == ((0, 1, 2, 3), (32, 33, 34, 35), (64, 65, 66, 67))
    free = sp.plan(graph, mesh=A100_PP8_TP8, schedule="auto")
    # README: "11.45 s (interleaved, V = 6) against 11.78 s for the published V = 3"
    assert published.step_time == pytest.approx(11.78, abs=0.005)
    assert free.step_time == pytest.approx(11.45, abs=0.005)
    assert (free.pipeline.schedule, free.pipeline.chunks) == ("interleaved", 6)
    assert free.step_time <= published.step_time
    assert max(s.memory_bytes for s in free.pipeline.stages) <= A100_MEMORY
    # the default schedule (1F1B) is slower than the published interleaving: "auto" is needed
    assert gpt175b_free_plan().step_time > published.step_time


def test_pipelined_summary_states_the_fullest_stage_against_the_per_device_limit() -> None:
    # The sub-mesh solve sees the whole model under stages x the budget; a user reading
    # "memory/device" must see a stage's peak and the per-device limit, not those totals.
    config = TransformerConfig("tiny", 4, 256, 4, 1024, 512, 128)
    mesh = sp.Mesh({"pp": 2, "dp": 2, "tp": 2}, cluster="h100-sxm")
    plan = sp.plan(training_step(config, batch=8), mesh=mesh, microbatches=4)
    stages = plan.pipeline.stages
    fullest = max(stages, key=lambda s: s.memory_bytes)
    (line,) = [row for row in str(plan).splitlines() if row.startswith("memory/device")]
    assert f"{format_bytes(fullest.memory_bytes)} peak on stage {fullest.index}" in line
    assert f"limit {format_bytes(plan.memory_limit / len(stages))}" in line
    assert format_bytes(plan.memory_limit / len(stages)) == "74.5 GiB"  # H100's usable HBM
    assert all(format_bytes(s.memory_bytes) in line for s in stages)


def test_interleaved_plan_runs_every_layer_once_in_megatrons_chunk_order() -> None:
    # schedule="interleaved": the planner picks the chunk count; chunk c of stage s is virtual
    # stage c * p + s, and virtual stages take consecutive layers
    graph = training_step(GPT_125M, batch=16, layers=8, seq=1024)
    plan = sp.plan(graph, mesh=sp.Mesh({"pp": 2, "tp": 2}, cluster="h100-sxm"),
                   schedule="interleaved")  # fmt: skip
    pipe = plan.pipeline
    assert pipe.schedule == "interleaved"
    assert pipe.chunks >= 2
    assert pipe.microbatches % 2 == 0
    virtual = [s.chunk_layers[c] for c in range(pipe.chunks) for s in pipe.stages]
    assert [layer for chunk in virtual for layer in chunk] == list(range(8))
    assert all(sorted(sum(s.chunk_layers, ())) == list(s.layers) for s in pipe.stages)
    assert pipe.bubble_fraction == pytest.approx(1 / (pipe.chunks * pipe.microbatches + 1))
    assert f"interleaved x{pipe.chunks}" in str(plan)
    assert plan_from_json(plan.to_json()).pipeline == pipe
    # "auto" is never slower than either schedule alone
    auto = sp.plan(graph, mesh=sp.Mesh({"pp": 2, "tp": 2}, cluster="h100-sxm"), schedule="auto")
    plain = sp.plan(graph, mesh=sp.Mesh({"pp": 2, "tp": 2}, cluster="h100-sxm"))
    assert auto.step_time <= min(plan.step_time, plain.step_time) + 1e-12


def test_mesh_search_plans_pipelined_shapes_with_the_schedule_asked_for() -> None:
    # sp.plan(devices=N, schedule=...) passes the schedule to every shape with pp > 1
    graph = training_step(GPT_125M, batch=8, layers=8, seq=512)
    found = {}
    for schedule in ("1f1b", "auto"):
        plan = sp.plan(graph, devices=4, cluster="h100-sxm", schedule=schedule)
        found[schedule] = {tuple(c.mesh.items()): c.step_time for c in plan.candidates
                           if c.mesh.get("pp", 1) > 1 and c.step_time is not None}  # fmt: skip
    assert found["auto"].keys() == found["1f1b"].keys()
    assert all(found["auto"][k] <= found["1f1b"][k] + 1e-15 for k in found["auto"])
    assert any(found["auto"][k] < found["1f1b"][k] * 0.99 for k in found["auto"])
