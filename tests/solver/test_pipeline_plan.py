"""Pipeline plans end to end: stages on a small model, and GPT-175B's published configuration."""

from __future__ import annotations

import pytest
import shardplan as sp
from shardplan import strategies
from shardplan.models import GPT_125M, TransformerConfig, training_step
from shardplan.solver.pipeline import plan_pipeline


def test_pipeline_plan_covers_every_layer_once_in_order() -> None:
    graph = training_step(GPT_125M, batch=16, layers=8, seq=1024)
    plan = sp.plan(graph, mesh=sp.Mesh({"pp": 4, "tp": 2}, cluster="h100-sxm"))
    stages = plan.pipeline.stages
    assert len(stages) == 4
    assert [layer for s in stages for layer in s.layers] == list(range(8))
    assert stages[0].first_stage_extras
    assert plan.step_time == plan.pipeline.step_time
    assert all(s.memory_bytes <= 80e9 for s in stages)


@pytest.mark.slow
def test_gpt175b_megatron_configuration_evaluates_near_the_published_step() -> None:
    # Korthikanti'22 Table 5: 175B, TP 8, PP 8, 64 A100-80GB, global batch 64, seq 2048,
    # sequence parallel + selective recompute: 13.75 s per iteration.
    config = TransformerConfig("gpt-175b", 96, 12288, 96, 49152, 51200, 2048, arch="gpt")
    graph = training_step(config, batch=64)
    megatron = strategies.megatron(pp=8, sequence_parallel=True, recompute="selective")
    sub_mesh = sp.Mesh({"tp": 8}, cluster="a100-80gb")
    plan = plan_pipeline(
        graph, sp.Mesh({"pp": 8, "tp": 8}, cluster="a100-80gb"), microbatches=64,
        stage_bounds=tuple(range(0, 96, 12)), pins=megatron.pins(graph, sub_mesh),
        recompute=megatron.recompute_decisions(graph),
    )  # fmt: skip
    assert [len(s.layers) for s in plan.pipeline.stages] == [12] * 8
    assert max(s.memory_bytes for s in plan.pipeline.stages) <= 80 * 2**30 * 0.95
    assert plan.step_time == pytest.approx(13.75, rel=0.25)
