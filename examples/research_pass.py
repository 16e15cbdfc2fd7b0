"""Two worked research passes: a graph tactic, and a pass added to the real planner.

1. A graph pass is a function ``Graph -> Graph`` registered by a kebab-case name with a frozen
   options dataclass. ``shard-large-weights`` pins every parameter above a size threshold to be
   split over one mesh axis along its largest divisible dimension (an FSDP tactic), leaves
   everything else to the planner, and is composed with the built-in ``propagate`` pass.
2. A planner pass is an object with a name, options and one ``apply(state)``
   (``shardplan.passes.PlannerPass``). ``price-collectives`` replaces the planner's ``price``
   pass: it prices as ``price`` does, then scales every reshard (the collectives between
   layouts) by ``factor``, asking "what would the planner choose on a network this much
   slower?". ``sp.plan(..., passes=...)`` runs the planner's default pipeline
   (``shardplan plan --print-passes``) with that one pass replaced.

Run it:

    .venv/bin/python examples/research_pass.py

It prints the IR after the graph pass, then the planner's modelled step time alone, with the
tactic, and with reshards priced 8x (a plan chosen for a slower network, timed at the real
prices), so each experiment's answer is one number.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import shardplan as sp
from shardplan.ir import Graph, Role, Sharding
from shardplan.passes import (
    PlannerPass,
    planner_pass,
    register_pass,
    register_planner_pass,
    run_pipeline,
)
from shardplan.solver.planner import DEFAULT_PIPELINE


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


@dataclass(frozen=True)
class PriceCollectivesOptions:
    factor: float = 2.0
    """Every reshard's price is multiplied by this."""


@register_planner_pass
class PriceCollectives(PlannerPass):
    """Price as ``price`` does, then scale every reshard's price by ``factor``."""

    name = "price-collectives"
    scope = "space"  # runs on each layout space the planner solves, as ``price`` does
    options_class = PriceCollectivesOptions

    def apply(self, state) -> None:  # type: ignore[no-untyped-def]
        planner_pass("price").apply(state)  # state.problem: the priced choices
        for edge in state.problem.edges:  # an edge: the reshard prices between two choices
            edge.cost = edge.cost * self.options.factor  # a new array: prices are cached


def with_pass(replaced: str, research: PlannerPass) -> list:
    """The planner's default pipeline with pass ``replaced`` swapped for ``research``."""
    return [research if name == replaced else name for name in DEFAULT_PIPELINE]


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
    slow = PriceCollectives(PriceCollectivesOptions(factor=8.0))
    research = sp.plan(_example_graph(), mesh=mesh, passes=with_pass("price", slow))
    print(f"planner alone:            {baseline.step_time * 1e3:.3f} ms")
    print(f"with shard-large-weights: {tactic.step_time * 1e3:.3f} ms")
    moved = sum(research.shardings[n] != s for n, s in baseline.shardings.items())
    print(f"with {slow}: {research.step_time * 1e3:.3f} ms at the real prices "
          f"({moved} of {len(baseline.shardings)} values laid out otherwise)")  # fmt: skip


if __name__ == "__main__":
    main()
