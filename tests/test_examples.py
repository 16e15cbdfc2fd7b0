"""The worked research-pass example registers its pass and pins what it says it pins."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from shardplan.ir import Role
from shardplan.passes import list_passes, run_pipeline

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def test_research_pass_example_pins_large_weights_on_their_largest_dim() -> None:
    example = _load("research_pass")
    assert "shard-large-weights" in list_passes()
    graph = example._example_graph()
    import shardplan as sp

    graph.mesh = sp.Mesh({"dp": 2, "tp": 4}, cluster="h100-sxm")
    run_pipeline(graph, "shard-large-weights{axis=dp min_bytes=1024}", verify_each=True)
    params = [v for v in graph.inputs if v.role is Role.PARAMETER]
    assert params
    for value in params:
        largest = max(range(value.type.rank), key=lambda d: value.type.shape[d])
        assert value.pinned
        assert value.sharding.dims[largest] == ("dp",)
    plan = sp.plan(graph, mesh=graph.mesh)
    assert all(plan.sharding_of(v.name) == v.sharding for v in params)


def test_research_pass_example_adds_a_planner_pass_that_changes_the_plan() -> None:
    import shardplan as sp

    example = _load("research_pass")
    mesh = sp.Mesh({"dp": 2, "tp": 4}, cluster="h100-sxm")
    alone = sp.plan(example._example_graph(), mesh=mesh)
    slow = example.PriceCollectives(example.PriceCollectivesOptions(factor=8.0))
    research = sp.plan(example._example_graph(), mesh=mesh, passes=example.with_pass("price", slow))
    ran = [k.removeprefix("pass:") for k in research.timings if k.startswith("pass:")]
    assert "price-collectives" in ran
    assert "price" not in ran
    assert research.shardings != alone.shardings
