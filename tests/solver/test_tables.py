"""The embedding-table planner: exact vs brute force, the class bound, memory, determinism."""

from __future__ import annotations

from dataclasses import replace
from itertools import product

import pytest
import shardplan.solver.table_planner as table_planner
from shardplan.costmodel.catalogue import CPU_TEST
from shardplan.costmodel.cluster import register_cluster
from shardplan.costmodel.dense_part import DENSE_MODES, DenseSpec, price_dense
from shardplan.costmodel.embedding import TableSpec, make_world
from shardplan.ir.errors import InfeasiblePlanError
from shardplan.solver.table_exact import placements
from shardplan.solver.table_planner import plan_tables
from shardplan.solver.tables import HEADROOM, table_classes, type_latency

# 2 nodes of 2 ranks: every sharding type (table-row-wise and grid need two nodes) on 4 ranks.
SMALL = register_cluster(replace(CPU_TEST, name="cpu-test-2x2", devices_per_node=2))
TABLES = [
    TableSpec("a", rows=400_000, dim=64, pooling_factor=4.0),
    TableSpec("b", rows=100_000, dim=32, pooling_factor=20.0),
    TableSpec("c", rows=900_000, dim=16, pooling_factor=1.0),
    TableSpec("d", rows=400_000, dim=64, pooling_factor=4.0),
]
DENSE = DenseSpec(param_bytes=8e6)
FUSED = ["fused"]


def brute_force(tables, world, dense, hbm_limit, kernels) -> float:
    """The best modelled iteration over every (option, placement) per table and dense mode."""
    limit = hbm_limit * (1 - HEADROOM)
    per_table = []
    for cls in table_classes(tables, world, kernels=kernels):
        choices = [(c, p) for c in cls.costs for p in placements(c, world)]
        per_table += [choices] * len(cls.tables)
    best = float("inf")
    dense_costs = [price_dense(dense, mode, world) for mode in DENSE_MODES]
    for combo in product(*per_table):
        time, hbm, kinds = [0.0] * world.size, [0.0] * world.size, set()
        for cost, groups in combo:
            kinds.add(cost.option.sharding_type)
            for r in {r for g in groups for r in g}:
                time[r] += cost.time
                hbm[r] += cost.hbm
        for d in dense_costs:
            if max(hbm) + d.hbm <= limit:
                best = min(best, max(time) + type_latency(kinds, world) + d.time)
    return best


@pytest.mark.parametrize("hbm_limit", [16e9, 75e6, 60e6])
def test_plan_tables_exact_equals_brute_force(hbm_limit: float) -> None:
    world = make_world(4, SMALL.name, batch_per_rank=256)
    tables = TABLES[:3]
    plan = plan_tables(tables, world, DENSE, hbm_limit=hbm_limit, kernels=FUSED)
    expected = brute_force(tables, world, DENSE, hbm_limit, FUSED)
    assert plan.status == "OPTIMAL"
    assert plan.iteration_time == pytest.approx(expected, rel=1e-6, abs=1e-8)
    assert plan.peak_hbm <= hbm_limit * (1 - HEADROOM)


def test_plan_tables_memory_changes_the_plan() -> None:
    world = make_world(4, SMALL.name, batch_per_rank=256)
    roomy = plan_tables(TABLES[:3], world, DENSE, hbm_limit=16e9, kernels=FUSED)
    tight = plan_tables(TABLES[:3], world, DENSE, hbm_limit=60e6, kernels=FUSED)
    assert roomy.peak_hbm > 60e6  # the unconstrained optimum would not fit the tight limit
    assert tight.iteration_time >= roomy.iteration_time
    assert {str(c.option) for c in tight.choices} != {str(c.option) for c in roomy.choices}


def test_plan_tables_class_model_bounds_the_optimum(monkeypatch: pytest.MonkeyPatch) -> None:
    """The large-instance path (classes + LPT): its bound <= the optimum <= its plan."""
    world = make_world(4, SMALL.name, batch_per_rank=256)
    monkeypatch.setattr(table_planner, "EXACT_LIMIT", 0)
    for limit in (16e9, 120e6):
        tables = [TABLES[0], TABLES[1], TABLES[3]]  # a and d alike: a class of two
        plan = plan_tables(tables, world, DENSE, hbm_limit=limit, kernels=FUSED)
        optimum = brute_force(tables, world, DENSE, limit, FUSED)
        assert plan.lower_bound <= optimum + 1e-8
        assert optimum <= plan.iteration_time + 1e-8
        assert plan.peak_hbm <= limit * (1 - HEADROOM)


def test_plan_tables_infeasible_names_the_minimum() -> None:
    world = make_world(4, SMALL.name, batch_per_rank=256)
    with pytest.raises(InfeasiblePlanError, match=r"needs at least [\d.]+ GiB of HBM per rank"):
        plan_tables(TABLES, world, DENSE, hbm_limit=5e6, kernels=FUSED)


def test_plan_tables_deterministic() -> None:
    world = make_world(64, "h100-sxm", batch_per_rank=512)
    tables = [TableSpec(f"t{i}", 2_080_000, 94, dtype="f16") for i in range(512)]
    tables += [TableSpec(f"u{i}", 50_000 * (i + 1), 128) for i in range(16)]
    first, second = (plan_tables(tables, world, DenseSpec(1.2e9)) for _ in range(2))
    assert [(c.table.name, c.option, c.ranks) for c in first.choices] == [
        (c.table.name, c.option, c.ranks) for c in second.choices
    ]
    assert first.iteration_time == second.iteration_time


def test_plan_tables_dlrm_a_balanced_table_wise() -> None:
    """MAD-Max DLRM-A on 64 H100: 4,096 alike tables spread evenly, well within HBM."""
    world = make_world(64, "h100-sxm", batch_per_rank=512)
    tables = [TableSpec(f"t{i}", 2_080_000, 94, dtype="f16") for i in range(4096)]
    plan = plan_tables(tables, world, DenseSpec(1.2e9))
    per_rank = [0] * 64
    for choice in plan.choices:
        assert choice.option.sharding_type == "table_wise"
        per_rank[choice.ranks[0][0]] += 1
    assert per_rank == [64] * 64
    assert plan.iteration_time == pytest.approx(plan.lower_bound, rel=1e-5)
    assert plan.peak_hbm <= plan.hbm_limit


def test_plan_tables_dense_mode_traded_against_tables() -> None:
    """Tables that fill HBM: FSDP's freed memory keeps more tables fused (one decision)."""
    world = make_world(8, "h100-sxm", batch_per_rank=512)
    tables = [TableSpec(f"t{i}", 2_000_000, 128, 50.0, "f16") for i in range(1080)]
    dense = DenseSpec(param_bytes=4e9)
    joint = plan_tables(tables, world, dense)
    ddp = plan_tables(tables, world, dense, dense_modes=("ddp",))
    assert joint.dense_mode == "fsdp"
    assert joint.iteration_time < ddp.iteration_time
    uvm = sum(c.option.kernel != "fused" for c in ddp.choices)
    assert uvm > sum(c.option.kernel != "fused" for c in joint.choices)
