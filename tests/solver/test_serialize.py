"""Plan JSON: versioned, byte-identical for equal plans, validated on load, round-trips."""

from __future__ import annotations

import dataclasses
import json

import pytest
from shardplan import Mesh, Plan, Sharding, ShardplanError, TensorType, load_plan
from shardplan.costmodel.collectives import Collective
from shardplan.ir import Graph, Origin, Role
from shardplan.solver.plan import Reshard, SolverStats
from shardplan.solver.serialize import plan_from_json, plan_to_json


def make_plan() -> Plan:
    """A Megatron-style plan of ``relu(x @ w1) @ w2`` on a 2x4 mesh, built by hand."""
    g = Graph(name="mlp")
    x = g.add_input("x", TensorType((8, 64), "bf16"), Role.INPUT, Origin(path="x"))
    w1 = g.add_input("w1", TensorType((64, 256), "bf16"), Role.PARAMETER, Origin(path="fc1.weight"))
    w2 = g.add_input("w2", TensorType((256, 64), "bf16"), Role.PARAMETER, Origin(path="fc2.weight"))
    h = g.add_op("dot", [x, w1], [TensorType((8, 256), "bf16")], names=["h"]).result
    a = g.add_op("relu", [h], [TensorType((8, 256), "bf16")], names=["a"]).result
    out = g.add_op("dot", [a, w2], [TensorType((8, 64), "bf16")], names=["out"]).result
    g.set_outputs([out])
    col, row = Sharding.of(None, "tp"), Sharding.of("tp", None)
    partial_out = Sharding.of("dp", None, partial=["tp"])
    batch = Sharding.of("dp", None)
    all_reduce = Collective("all-reduce", ("tp",), 512, 1.25e-5)
    return Plan(
        graph=g,
        mesh=Mesh({"dp": 2, "tp": 4}, cluster="h100-sxm"),
        shardings={
            "x": batch,
            "w1": col,
            "w2": row,
            "h": Sharding.of("dp", "tp"),
            "a": Sharding.of("dp", "tp"),
            "out": partial_out,
        },
        operand_shardings={
            (0, 0): batch,
            (0, 1): col,
            (1, 0): Sharding.of("dp", "tp"),
            (2, 0): Sharding.of("dp", "tp"),
            (2, 1): row,
        },
        reshards=[Reshard("out", "output:0", partial_out, batch, (all_reduce,))],
        compute_time=3.0e-5,
        comm_time=1.25e-5,
        peak_memory_bytes=81920,
        memory={"parameters": 16384, "activations": 65536},
        solver=SolverStats("OPTIMAL", 4.25e-5, 4.25e-5, 0.37, 42, 3),
        output_shardings=[batch],
    )


def test_plan_json_is_versioned_and_sorted():
    """The header names the format and version; keys are sorted; wall time is left out."""
    text = plan_to_json(make_plan())
    data = json.loads(text)
    assert data["format"] == "shardplan-plan"
    assert data["version"] == 2
    assert list(data) == sorted(data)
    assert "wall_time" not in text
    assert text.endswith("\n")


def test_plan_json_is_byte_identical_for_equal_plans():
    """Two plans built the same way (different solve times) give the same bytes."""
    first = make_plan()
    second = dataclasses.replace(
        make_plan(), solver=SolverStats("OPTIMAL", 4.25e-5, 4.25e-5, 9.99, 42, 3)
    )
    assert plan_to_json(first) == plan_to_json(second)


def test_plan_json_round_trips():
    """Load gives back every sharding, reshard, cost and stat; saving again is identical."""
    plan = make_plan()
    loaded = plan_from_json(json.loads(plan_to_json(plan)))
    assert loaded.mesh == plan.mesh
    assert loaded.shardings == plan.shardings
    assert loaded.operand_shardings == plan.operand_shardings
    assert loaded.output_shardings == plan.output_shardings
    assert loaded.reshards == plan.reshards
    assert (loaded.compute_time, loaded.comm_time) == (plan.compute_time, plan.comm_time)
    assert loaded.memory == plan.memory
    assert loaded.peak_memory_bytes == plan.peak_memory_bytes
    assert loaded.solver.status == "OPTIMAL"
    assert loaded.solver.objective == plan.solver.objective
    assert [v.name for v in loaded.graph.values()] == [v.name for v in plan.graph.values()]
    assert plan_to_json(loaded) == plan_to_json(plan)


def test_plan_save_and_load_plan(tmp_path):
    """``Plan.save`` and ``shardplan.load_plan`` use the same format."""
    path = tmp_path / "plan.json"
    make_plan().save(path)
    assert load_plan(path).shardings == make_plan().shardings


def test_plan_json_keeps_non_finite_floats():
    """JSON has no inf: it is written as a string and read back."""
    stats = SolverStats("FEASIBLE", 1.0, float("-inf"), 0.0, 1, 1)
    plan = dataclasses.replace(make_plan(), solver=stats)
    assert plan_from_json(plan_to_json(plan)).solver.bound == float("-inf")


def _document() -> dict:
    return json.loads(plan_to_json(make_plan()))


def test_plan_from_json_rejects_other_formats():
    data = _document()
    data["format"] = "something-else"
    with pytest.raises(ShardplanError, match="not a shardplan plan"):
        plan_from_json(data)


def test_plan_from_json_rejects_newer_versions():
    data = _document()
    data["version"] = 99
    with pytest.raises(ShardplanError, match="newer than this shardplan reads"):
        plan_from_json(data)


@pytest.mark.parametrize("key", ["mesh", "graph", "shardings", "reshards", "costs", "solver"])
def test_plan_from_json_names_a_missing_key(key):
    data = _document()
    del data[key]
    with pytest.raises(ShardplanError, match=f"missing key '{key}'"):
        plan_from_json(data)


def test_plan_from_json_rejects_a_sharding_that_does_not_fit():
    """A damaged file whose sharding splits a dim unevenly is refused with the value's name."""
    data = _document()
    data["shardings"]["x"] = {"dims": [["dp", "tp"], ["tp"]]}
    with pytest.raises(ShardplanError, match=r"shardings\.x"):
        plan_from_json(data)


def test_plan_from_json_rejects_unknown_values_and_bad_types():
    data = _document()
    data["shardings"]["nope"] = {"dims": []}
    with pytest.raises(ShardplanError, match="no value %nope"):
        plan_from_json(data)
    data = _document()
    data["peak_memory_bytes"] = "lots"
    with pytest.raises(ShardplanError, match="expected an integer"):
        plan_from_json(data)


def test_plan_from_json_rejects_text_that_is_not_json():
    with pytest.raises(ShardplanError, match="not JSON"):
        plan_from_json("{not json")
