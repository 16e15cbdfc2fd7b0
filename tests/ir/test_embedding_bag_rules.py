"""Rules and costs of the embedding bag ops (``ir/embedding_bag.py``)."""

from __future__ import annotations

from shardplan.ir import TensorType
from shardplan.ir.op_cost import op_bytes
from shardplan.ir.registry import rule_for

TABLE = TensorType((1000, 16), "f32")
IDS, OFFSETS = TensorType((60,), "i64"), TensorType((20,), "i64")
OUT = TensorType((20, 16), "f32")
ATTRS = {"mode": "sum", "rows": 1000, "dim": 16, "bags": 20, "pooling": 3.0}


def test_jagged_lookup_splits_rows_columns_and_bags() -> None:
    rule = rule_for("embedding_bag", [TABLE, IDS, OFFSETS], [OUT], ATTRS)
    assert str(rule) == (
        "ab,d,e->cb {a=1000, b=16, d=60, e=20, c=20} reduction={a} need_replication={d, e}"
    )  # rows reduce (row-wise: a pending sum), columns pass, bags are the result's own


def test_max_pooling_keeps_rows_whole() -> None:
    attrs = {**ATTRS, "mode": "max"}
    rule = rule_for("embedding_bag", [TABLE, IDS, OFFSETS], [OUT, OUT], attrs)
    assert rule.need_replication == {"a", "d", "e"}
    assert not rule.reduction


def test_fixed_bags_split_with_their_ids() -> None:
    attrs = {**ATTRS, "fixed_bag": 3}
    rule = rule_for("embedding_bag", [TABLE, IDS, OFFSETS], [OUT], attrs)
    assert rule.spec == "ab,(cd),c->cb"
    assert rule.need_replication == {"d"}


def test_backward_sums_bags_and_makes_owned_rows() -> None:
    rule = rule_for("embedding_bag_backward", [OUT, IDS, OFFSETS], [TABLE], ATTRS)
    assert rule.spec == "cb,d,e->ab"
    assert rule.reduction == {"c"}
    psw = rule_for("embedding_bag_psw_backward", [OUT, TABLE, IDS, OFFSETS], [IDS], ATTRS)
    assert psw.reduction == {"a", "b", "c"}  # the weights' gradient: a dot, pending


def test_lookup_bytes_are_rows_read_not_the_table() -> None:
    ins, outs = [TABLE, IDS, OFFSETS], [OUT]
    whole = op_bytes("embedding_bag", ins, outs, [1, 1, 1], [1], attrs=ATTRS, split=1)
    index = IDS.nbytes + OFFSETS.nbytes + OUT.nbytes
    assert whole == 20 * 3 * 16 * 4 + index < TABLE.nbytes
    double = op_bytes("embedding_bag", ins, outs, [1, 1, 1], [1],
                      attrs={**ATTRS, "pooling": 6.0}, split=1)  # fmt: skip
    assert double - index == 2 * (whole - index)
    split = op_bytes("embedding_bag", ins, outs, [4, 1, 1], [1], attrs=ATTRS, split=4)
    assert split - index == (whole - index) / 4  # each device reads the ids in its rows
