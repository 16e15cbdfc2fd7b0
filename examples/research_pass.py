"""A worked research pass: "shard every large weight on its largest dimension" (an FSDP tactic).

A pass is a function ``Graph -> Graph`` registered by a kebab-case name with a frozen options
dataclass. This one pins every parameter above a size threshold to be split over one mesh axis
along its largest divisible dimension, leaves everything else to the planner, and is then
composed with the built-in ``propagate`` pass. Run it:

    .venv/bin/python examples/research_pass.py

It prints the IR after the pass, then the planner's modelled step time with and without the
tactic, so the experiment's answer (does forcing FSDP-style weights help here?) is one number.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import shardplan as sp
from shardplan.ir import Graph, Role, Sharding
from shardplan.passes import register_pass, run_pipeline


@dataclass(frozen=True)
class ShardLargeWeightsOptions:
    axis: str = "dp"
    """Mesh axis to split the weights over."""
    min_bytes: int = 1 << 20
    """Only weights at least this large are pinned."""


@register_pass("shard-large-weights", options=ShardLargeWeightsOptions)
def shard_large_weights(graph: Graph, options: ShardLargeWeightsOptions) -> Graph:
    """Pin parameters >= min_bytes to be split over ``axis`` on their largest divisible dim."""
    size = graph.mesh.axis_size(options.axis)
    for value in graph.inputs:
        if value.role is not Role.PARAMETER or value.type.nbytes < options.min_bytes:
            continue
        dims = [d for d in range(value.type.rank) if value.type.shape[d] % size == 0]
        if dims:
            best = max(dims, key=lambda d: value.type.shape[d])
            layout = [() for _ in range(value.type.rank)]
            layout[best] = (options.axis,)
            value.sharding, value.pinned = Sharding(tuple(layout)), True
    return graph


def _example_graph() -> Graph:
    path = Path(__file__).with_name("mlp_graph.py")
    spec = importlib.util.spec_from_file_location("mlp_graph", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make(batch=8192, model=4096, hidden=16384)


def main() -> None:
    mesh = sp.Mesh({"dp": 2, "tp": 4}, cluster="h100-sxm")
    baseline = sp.plan(_example_graph(), mesh=mesh)
    graph = _example_graph()
    graph.mesh = mesh
    run_pipeline(
        graph, "shard-large-weights{axis=dp},propagate", print_after={"shard-large-weights"}
    )
    tactic = sp.plan(graph, mesh=mesh)
    print(f"planner alone:            {baseline.step_time * 1e3:.3f} ms")
    print(f"with shard-large-weights: {tactic.step_time * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
