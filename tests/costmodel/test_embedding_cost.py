"""Embedding-table prices against hand-computed numbers on the cpu-test cluster (round numbers)."""

from __future__ import annotations

import pytest
from shardplan.costmodel.embedding import Option, TableSpec, make_world, price

# cpu-test: HBM 100 GB/s at efficiency 1, 4 ranks per node on a 100 GB/s bus.
TABLE = TableSpec("t", rows=1000, dim=16, pooling_factor=2.0, dtype="f32")
WORLD = make_world(4, "cpu-test", batch_per_rank=8)  # global batch 32, 64 ids of this table
BW = 100e9
ROW = 16 * 4
UPDATE = 4 * ROW + 2 * 4  # read the row, then grad + row + state read/written (Adagrad: 4 B)


def test_table_wise_price_by_hand() -> None:
    cost = price(TABLE, Option("table_wise"), WORLD)
    parts = dict(cost.breakdown)
    assert parts["lookup"] == pytest.approx(64 * UPDATE / BW)
    assert parts["input_dist"] == pytest.approx(3 / 4 * 64 * 8 / BW)  # ids' all-to-all
    assert parts["output_dist"] == pytest.approx(2 * 3 / 4 * 32 * ROW / BW)  # fwd + bwd a2a
    assert cost.hbm == 1000 * (ROW + 4) + 64 * 8 + 2 * 32 * ROW
    assert (cost.placement, cost.groups, cost.host) == ("rank", 1, 0.0)


def test_row_wise_splits_ids_and_reduce_scatters() -> None:
    cost = price(TABLE, Option("row_wise"), WORLD)
    parts = dict(cost.breakdown)
    assert parts["lookup"] == pytest.approx(16 * UPDATE / BW)  # a quarter of the ids each
    # reduce-scatter of the partial pooled outputs, all-gather of their gradients back
    assert parts["output_dist"] == pytest.approx(2 * 3 / 4 * 32 * ROW / BW)
    assert cost.hbm == 250 * (ROW + 4) + 16 * 8 + 2 * 32 * ROW
    assert cost.placement == "all"


def test_uvm_caching_moves_misses_to_the_host_link() -> None:
    fused = price(TABLE, Option("table_wise"), WORLD)
    cached = price(TABLE, Option("table_wise", "fused_uvm_caching", 0.2), WORLD)
    uvm = price(TABLE, Option("table_wise", "fused_uvm", 0.0), WORLD)
    lookups = [dict(c.breakdown)["lookup"] for c in (fused, cached, uvm)]
    assert lookups[0] < lookups[1] < lookups[2]
    # uniform access: a 20% cache hits 20% of the lookups; the rest cross PCIe (64 GB/s)
    assert lookups[1] == pytest.approx(64 * UPDATE * (0.2 / BW + 0.8 / 64e9))
    assert uvm.host == 1000 * (ROW + 4)
    assert cached.host == uvm.host
    assert uvm.hbm < cached.hbm < fused.hbm


def test_column_wise_halves_the_shard() -> None:
    whole = price(TABLE, Option("table_wise"), WORLD)
    half = price(TABLE, Option("column_wise", column_shards=2), WORLD)
    assert half.groups == 2
    assert dict(half.breakdown)["output_dist"] == pytest.approx(
        dict(whole.breakdown)["output_dist"] / 2
    )


def test_full_adagrad_keeps_one_accumulator_per_element() -> None:
    """HugeCTR's (and fbgemm's exact) Adagrad: the update reads and writes a D-wide fp32 state
    row, and the table holds it, where row-wise Adagrad has one fp32 per row."""
    world = make_world(4, "cpu-test", batch_per_rank=8, optimizer="adagrad")
    cost = price(TABLE, Option("table_wise"), world)
    state = 16 * 4
    assert dict(cost.breakdown)["lookup"] == pytest.approx(64 * (4 * ROW + 2 * state) / BW)
    assert cost.hbm == 1000 * (ROW + state) + 64 * 8 + 2 * 32 * ROW
