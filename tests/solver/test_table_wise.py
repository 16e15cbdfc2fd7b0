"""Owners of table-wise tables (``solver/table_wise.py``) and the ``TableOwner`` record."""

from __future__ import annotations

import pytest
from shardplan.ir import Mesh
from shardplan.ir.errors import ShardingError
from shardplan.ir.table_wise import TableOwner, position
from shardplan.solver.table_wise import assign_owners


def test_assign_owners_alike_tables_one_per_position() -> None:
    """Four alike tables on eight positions: four distinct owners, the first four, in order."""
    assert assign_owners([(1024, 10.0)] * 4, 8) == [0, 1, 2, 3]


def test_assign_owners_balances_bytes_longest_first() -> None:
    """LPT: 10 -> 0, 7 -> 1, 5 -> 1 (7 < 10), 4 -> 0 (10 < 12): loads 14 and 12."""
    sizes = [5, 10, 4, 7]
    owners = assign_owners([(b, 0.0) for b in sizes], 2)
    assert owners == [1, 0, 0, 1]
    loads = [sum(b for b, o in zip(sizes, owners, strict=True) if o == p) for p in range(2)]
    assert loads == [14, 12]


def test_assign_owners_lookups_break_byte_ties() -> None:
    """Equal bytes: the table with more lookups goes first (onto position 0)."""
    assert assign_owners([(8, 1.0), (8, 5.0)], 2) == [1, 0]


def test_table_owner_position_is_major_first() -> None:
    mesh = Mesh({"dp": 2, "tp": 4})
    owner = TableOwner("w", "emb.0", ("dp", "tp"), 6)
    owner.check(mesh)
    assert position({"dp": 1, "tp": 2}, ("dp", "tp"), mesh) == 6
    assert owner.owns({"dp": 1, "tp": 2}, mesh)
    assert not owner.owns({"dp": 0, "tp": 2}, mesh)


def test_table_owner_errors_name_the_table_and_the_range() -> None:
    mesh = Mesh({"dp": 2, "tp": 4})
    with pytest.raises(ShardingError, match=r"'emb\.0'.*owner 4 out of range.*0\.\.3"):
        TableOwner("w", "emb.0", ("tp",), 4).check(mesh)
    with pytest.raises(ShardingError, match=r"'emb\.1' is placed along 'pp', not an axis"):
        TableOwner("w", "emb.1", ("pp",), 0).check(mesh)
    with pytest.raises(ShardingError, match="distinct mesh axes"):
        TableOwner("w", "emb.2", ("dp", "dp"), 0)
