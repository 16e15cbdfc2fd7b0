"""Mesh-shape search: every (pp, dp, tp) tried, the best chosen, no pipeline when not needed."""

from __future__ import annotations

import pytest
import shardplan as sp
from shardplan.ir.models import GPT_125M, training_step
from shardplan.solver.mesh_search import format_candidates, mesh_candidates


def test_mesh_candidates_keep_tensor_parallelism_inside_a_node() -> None:
    shapes = mesh_candidates(16, devices_per_node=8)
    assert {"pp": 1, "dp": 16, "tp": 1} in shapes
    assert all(s["tp"] <= 8 and s["pp"] * s["dp"] * s["tp"] == 16 for s in shapes)
    assert len(shapes) == len({tuple(s.values()) for s in shapes})


@pytest.mark.slow
def test_small_model_with_ample_memory_is_not_pipelined_and_best_is_chosen() -> None:
    graph = training_step(GPT_125M, batch=64, layers=4, seq=1024)
    plan = sp.plan(graph, devices=8, cluster="h100-sxm", time_limit=20)
    table = plan.candidates
    planned = [c for c in table if c.step_time is not None]
    assert len(table) == len(mesh_candidates(8, 8))
    assert planned
    assert plan.step_time == min(c.step_time for c in planned)
    assert plan.pipeline is None  # pipelining only adds a bubble for a model this small
    rejected = [c for c in table if c.step_time is None]
    assert all(c.rejected for c in rejected)  # every rejection says why
    assert "pp" in format_candidates(table)


def test_mesh_search_applies_pins_on_each_candidate_mesh() -> None:
    graph = training_step(GPT_125M, batch=16, layers=2, seq=256)
    embed = next(v for v in graph.inputs if "wte" in v.origin.path or "embed" in v.origin.path)
    pin = sp.Sharding.of(*([None] * embed.type.rank))
    plan = sp.plan(graph, devices=2, cluster="h100-sxm", pins={embed.name: pin}, time_limit=10)
    assert plan.sharding_of(embed.name) == pin
    assert plan.candidates
