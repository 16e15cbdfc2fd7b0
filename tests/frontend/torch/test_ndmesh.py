"""A tiny HF Llama plans on meshes of three and four axes (the axis search), optimally on the
neighbourhood it ends in, with valid layouts that use every axis."""

from __future__ import annotations

import pytest
import shardplan as sp

MESHES = {
    "2x2x2": {"dp": 2, "fsdp": 2, "tp": 2},
    "2x2x2x2": {"dp": 2, "fsdp": 2, "cp": 2, "tp": 2},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MESHES))
def test_tiny_llama_plans_on_nd_mesh(examples, name: str) -> None:
    model, inputs = examples["hf_llama"].make(layers=1)
    mesh = sp.Mesh(MESHES[name])
    plan = sp.plan(model, *inputs, mesh=mesh)
    assert plan.solver.status == "OPTIMAL"
    assert plan.solver.gap == 0.0
    graph = plan.graph
    used: set[str] = set()
    for value in graph.values():
        layout = plan.shardings[value.name]
        layout.check(value.type, mesh)  # every layout is even and names real axes
        used |= {a for dim in layout.dims for a in dim}
    assert used == set(mesh.axis_names)  # the plan is not data parallel on one axis only
    assert plan.peak_memory_bytes <= plan.memory_limit
