"""The budget drives the plan: DP -> ZeRO (states, gradients) -> FSDP -> recomputation -> error."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import shardplan as sp
from shardplan.ir import Role
from shardplan.solver.planner import plan_graph

_spec = importlib.util.spec_from_file_location(
    "memory_model_cases", Path(__file__).with_name("test_memory_model.py")
)
_cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cases)

MESH = sp.Mesh({"dp": 8}, cluster="h100-sxm")


def _state(graph, plan) -> tuple[int, int, int, bool]:
    """(# sharded parameters, # sharded moments, # sharded gradients at the update, recompute)."""

    def sharded(role: Role) -> int:
        return sum(
            plan.shardings[v.name].shard_count(MESH) > 1 for v in graph.inputs if v.role is role
        )

    updates = [i for i, op in enumerate(graph.ops) if op.kind == "adamw"]
    grads = sum(plan.operand_shardings[(i, 1)].shard_count(MESH) > 1 for i in updates)
    return sharded(Role.PARAMETER), sharded(Role.OPTIMIZER_STATE), grads, bool(plan.recompute)


def test_lowering_the_budget_shards_states_then_parameters_then_recomputes() -> None:
    graph = _cases.mlp_step(B=2048, D=1024)  # small model, large batch
    budget, states = 80e9, []
    while len(states) < 4:
        plan = plan_graph(graph, MESH, memory_limit=budget, time_limit=10)
        assert plan.peak_memory_bytes <= budget
        states.append(_state(graph, plan))
        budget = plan.peak_memory_bytes - 1
    with pytest.raises(sp.InfeasiblePlanError, match="smallest modelled peak") as info:
        plan_graph(graph, MESH, memory_limit=budget, time_limit=10)
    assert info.value.minimum_bytes > budget
    assert states == [
        (0, 0, 0, False),  # data parallel: everything replicated, gradients all-reduced
        (0, 4, 2, False),  # ZeRO-2: moments sharded, gradients reduce-scattered into the update
        (2, 4, 2, False),  # ZeRO-3 / FSDP: parameters sharded too
        (2, 4, 2, True),  # then activation recomputation
    ]


def test_generous_budget_large_batch_is_data_parallel() -> None:
    graph = _cases.mlp_step(B=2048, D=1024)
    plan = plan_graph(graph, MESH)
    assert _state(graph, plan) == (0, 0, 0, False)
    assert all(c.kind == "all-reduce" for c in plan.collectives())


def test_infeasible_budget_names_minimum_and_contributors() -> None:
    graph = _cases.mlp_step(B=2048, D=1024)
    with pytest.raises(
        sp.InfeasiblePlanError, match=r"smallest modelled peak is 0\.008 GiB"
    ) as info:
        plan_graph(graph, MESH, memory_limit=7 * 2**20)  # above the state alone
    assert info.value.minimum_bytes == 8 * 2**20 + 4  # 4: the scalar loss
    assert "activations" in str(info.value)
