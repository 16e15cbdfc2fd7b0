"""Complete plan files (issue 14 point 4): every plan kind saves and loads with its pipeline, its
whole mesh and the exposed communication, so a loaded plan reports the same step time."""

from __future__ import annotations

import functools
import json

import pytest
import shardplan as sp
from shardplan.ir.models import TransformerConfig, training_step
from shardplan.solver.serialize import plan_from_json, plan_to_json

TINY = TransformerConfig("tiny", 4, 256, 4, 1024, 1024, 128, "gpt")


def _graph():
    return training_step(TINY, batch=8, layers=4, seq=128)


@functools.cache
def plain_plan() -> sp.Plan:
    return sp.plan(_graph(), mesh=sp.Mesh({"dp": 2, "tp": 4}, cluster="h100-sxm"), time_limit=10)


@functools.cache
def pipeline_plan() -> sp.Plan:
    mesh = sp.Mesh({"pp": 2, "dp": 2, "tp": 2}, cluster="h100-sxm")
    return sp.plan(_graph(), mesh=mesh, time_limit=10)


@functools.cache
def searched_plan() -> sp.Plan:
    return sp.plan(_graph(), devices=4, cluster="h100-sxm", time_limit=10)


KINDS = {"plain": plain_plan, "pipeline": pipeline_plan, "mesh search": searched_plan}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_loaded_plan_has_the_same_step_time_and_bytes(kind: str, tmp_path) -> None:
    plan = KINDS[kind]()
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = sp.load_plan(path)
    assert loaded.step_time == plan.step_time  # exactly: nothing is re-derived on load
    assert loaded.exposed_comm_time == plan.exposed_comm_time
    assert loaded.mesh == plan.mesh
    assert loaded.recompute == plan.recompute
    assert loaded.memory_limit == plan.memory_limit
    assert plan_to_json(loaded) == path.read_text()


def test_plain_plan_step_time_counts_only_exposed_communication() -> None:
    plan = plain_plan()
    loaded = plan_from_json(plan_to_json(plan))
    assert plan.exposed_comm_time is not None
    assert loaded.step_time == plan.compute_time + plan.exposed_comm_time


def test_pipeline_plan_keeps_its_stages_and_whole_mesh() -> None:
    plan = pipeline_plan()
    assert plan.pipeline is not None
    assert plan.mesh == sp.Mesh({"pp": 2, "dp": 2, "tp": 2}, cluster="h100-sxm")
    assert plan.stage_mesh == sp.Mesh({"dp": 2, "tp": 2}, cluster="h100-sxm")
    loaded = plan_from_json(plan_to_json(plan))
    assert loaded.pipeline == plan.pipeline
    assert loaded.stage_mesh == plan.stage_mesh
    assert [s.layers for s in loaded.stages] == [s.layers for s in plan.stages]


@pytest.mark.torch
def test_loaded_pipeline_plan_gives_split_points() -> None:
    from torch.distributed.pipelining import SplitPoint

    plan = pipeline_plan()
    loaded = plan_from_json(plan_to_json(plan))
    second = plan.pipeline.stages[1].first_module
    assert loaded.pipeline_split_spec() == {second: SplitPoint.BEGINNING}
    assert loaded.pipeline_split_spec() == plan.pipeline_split_spec()


def test_mesh_search_plan_keeps_the_candidate_table() -> None:
    plan = searched_plan()
    loaded = plan_from_json(plan_to_json(plan))
    assert loaded.mesh == plan.mesh
    assert [(c.mesh, c.step_time, c.rejected) for c in loaded.candidates] == [
        (c.mesh, c.step_time, c.rejected) for c in plan.candidates
    ]
    # the table's best row is the returned plan
    best = min(c.step_time for c in plan.candidates if c.step_time is not None)
    assert loaded.step_time == best


def test_pipelined_candidates_of_a_mesh_search_keep_pp_in_their_mesh() -> None:
    plan = searched_plan()
    assert plan.mesh.size == 4
    if plan.pipeline is not None:
        assert plan.mesh.axis_size(plan.pipeline.axis) == len(plan.pipeline.stages)
    assert any(c.step_time is not None and c.mesh["pp"] > 1 for c in plan.candidates)


def test_version_1_files_still_load() -> None:
    """A file written before version 2 (no pipeline, no exposed communication) loads as it
    was saved: its step time is compute + all communication."""
    data = json.loads(plan_to_json(plain_plan()))
    data["version"] = 1
    for key in ("pipeline", "recompute", "memory_limit", "candidates"):
        del data[key]
    del data["costs"]["exposed_comm_time"]
    loaded = plan_from_json(data)
    assert loaded.pipeline is None
    assert loaded.exposed_comm_time is None
    assert loaded.step_time == loaded.compute_time + loaded.comm_time


def test_pipeline_on_an_axis_the_mesh_lacks_is_refused() -> None:
    data = json.loads(plan_to_json(pipeline_plan()))
    data["pipeline"]["axis"] = "stage"
    with pytest.raises(sp.ShardplanError, match="has no axis 'stage'"):
        plan_from_json(data)
