"""Issue 20 acceptance: an 8B training step on 2 islands x 64 H100 puts only gradient and
state traffic across the DCN, where the same devices without islands also move activations."""

from __future__ import annotations

import pytest
from shardplan.costmodel import cluster_from_dict, group_link, register_cluster
from shardplan.costmodel.phases import Phase, op_phases
from shardplan.ir import Graph, Mesh, Role, Value
from shardplan.ir.models import LLAMA3_8B, training_step
from shardplan.solver.plan import Reshard
from shardplan.solver.planner import plan_graph

# Two islands of 8 DGX H100 nodes over the catalogue's DCN (h100-superpod-dcn's link).
TWO_ISLANDS = register_cluster(
    cluster_from_dict(
        {"base": "h100-superpod-dcn", "name": "h100-2x64-dcn", "islands": [{"devices": 64}]}
    )
)
MESH = {"dp": 16, "tp": 8}
STATE = (Role.PARAMETER, Role.OPTIMIZER_STATE)


@pytest.fixture(scope="module")
def step() -> Graph:
    # Llama-3-8B shapes at its 8192-token sequence, 2 sequences per data-parallel rank; one
    # layer keeps the test fast (every layer has the same shapes).
    return training_step(LLAMA3_8B, batch=2 * MESH["dp"], layers=1)


def _from_state_only(value: Value) -> bool:
    """Computed from parameters / optimizer states alone (a bf16 copy of a master weight)."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if v.name in seen:
            continue
        seen.add(v.name)
        if v.producer is None:
            if v.role not in STATE:
                return False
        else:
            stack.extend(v.producer.operands)
    return True


def traffic(graph: Graph, reshard: Reshard) -> str:
    """``state``: parameters / optimizer states or their copies, and updated state on its way
    back to its stored layout; ``gradient``: into the update, or into an op whose every result
    is read only by the update (a weight-gradient op); ``loss``: the scalar loss output;
    ``activation``: anything else (forward / backward data a TP or SP collective moves)."""
    value = graph.value(reshard.value)
    kind, _, index = reshard.consumer.partition(":")
    if kind == "alias":
        return "state"
    if kind == "output":
        return "loss" if value.type.shape == () else "activation"
    if _from_state_only(value):
        return "state"
    phases = op_phases(graph)
    op = graph.ops[int(index.split(":")[0])]
    if phases[op] is Phase.UPDATE:
        return "gradient"
    readers = [user for result in op.results for user in result.users]
    if readers and all(phases[user] is Phase.UPDATE for user in readers):
        return "gradient"
    return "activation"


def cross_island(graph: Graph, cluster_name: str) -> dict[str, int]:
    """Per traffic class, the collectives of the plan on ``cluster_name`` whose group would
    cross the two islands (priced on the island cluster's layout in both cases)."""
    mesh = Mesh(MESH, cluster=cluster_name)
    plan = plan_graph(graph, mesh)
    island_mesh = Mesh(MESH, cluster=TWO_ISLANDS.name)
    counts: dict[str, int] = {}
    for reshard in plan.reshards:
        for c in reshard.collectives:
            if group_link(c.axes, island_mesh, TWO_ISLANDS).level == "inter-island":
                key = traffic(graph, reshard)
                counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.slow
def test_8b_on_two_islands_sends_only_gradients_and_state_over_the_dcn(step):
    counts = cross_island(step, TWO_ISLANDS.name)
    assert counts.get("gradient", 0) >= 7  # the layer's 7 weight gradients (and more)
    assert set(counts) <= {"gradient", "state", "loss"}, counts


@pytest.mark.slow
def test_8b_without_islands_does_move_activations_across(step):
    """The contrast: the same 128 H100s as one IB fabric make another choice, so it is the DCN
    price that keeps activations inside the islands above."""
    counts = cross_island(step, "h100-sxm")
    assert counts.get("activation", 0) >= 2, counts
