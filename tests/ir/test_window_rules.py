"""Rules of XLA's window ops (``ir/window.py``): pooling and the max-pool backward."""

from __future__ import annotations

from shardplan.ir import TensorType, rule_for
from shardplan.ir.halo import Halo
from shardplan.ir.window import window_halos

POOL_2X2 = {
    "window": (1, 2, 2, 1),
    "strides": (1, 2, 2, 1),
    "padding": ((0, 0),) * 4,
    "base_dilation": (1,) * 4,
    "window_dilation": (1,) * 4,
}


def _rule(kind, ins, out, attrs):
    return rule_for(kind, [TensorType(s, "f32") for s in ins], [TensorType(out, "f32")], attrs)


def test_pooling_passes_batch_and_channels_and_splits_rows_with_the_operand():
    """A 2x2 pool at stride 2: each out row reads its own 2 input rows, so the out rows split
    with the input rows (``(rows, stride)``, the stride part whole), no halo needed."""
    rule = _rule("reduce_window_max", [(8, 16, 16, 4)], (8, 8, 8, 4), POOL_2X2)
    (x,), (out,) = rule.operands, rule.results
    assert x[0] == out[0]
    assert x[3] == out[3]
    assert x[1][0] == out[1][0]  # rows and columns split alike
    assert x[2][0] == out[2][0]
    assert {x[1][1], x[2][1]} == rule.need_replication  # the stride parts stay whole
    assert rule.spec == "a(bc)(de)f->abdf"
    types = [TensorType((8, 16, 16, 4), "f32")], [TensorType((8, 8, 8, 4), "f32")]
    assert window_halos("reduce_window_max", *types, POOL_2X2) == []


def test_an_overlapping_pool_splits_its_rows_with_a_halo():
    """ResNet's 3x3 max pool at stride 2, padded 1: a slab needs the previous slab's last
    row (``halo_rows(3, 1, 2, 1) == (1, 0)``); at stride 1 one row each way."""
    attrs = {**POOL_2X2, "window": (1, 1, 3, 3), "strides": (1, 1, 2, 2)}
    attrs["padding"] = ((0, 0), (0, 0), (1, 1), (1, 1))
    ins, outs = [TensorType((1, 4, 32, 32), "f32")], [TensorType((1, 4, 16, 16), "f32")]
    rule = rule_for("reduce_window_max", ins, outs, attrs)
    assert rule.spec == "ab(cd)(ef)->abce"
    assert rule.need_replication == {"d", "f"}
    assert window_halos("reduce_window_max", ins, outs, attrs) == [
        (2, Halo("forward", 2, 1, 0)),
        (3, Halo("forward", 2, 1, 0)),
    ]
    same = {**attrs, "strides": (1,) * 4}
    outs = [TensorType((1, 4, 32, 32), "f32")]
    assert rule_for("reduce_window_sum", ins, outs, same).spec == "abcd->abcd"
    assert [h for _, h in window_halos("reduce_window_sum", ins, outs, same)] == [
        Halo("forward", 1, 1, 1)
    ] * 2


def test_a_padded_stride_1_window_still_mixes_its_dims():
    """avg-pool's backward: a 2x2 window at stride 1 over the padded gradient."""
    attrs = {**POOL_2X2, "strides": (1,) * 4, "padding": ((0, 0), (1, 1), (1, 1), (0, 0))}
    rule = _rule("reduce_window_sum", [(8, 4, 4, 16)], (8, 5, 5, 16), attrs)
    assert rule.spec == "abcd->aefd"
    assert rule.need_replication == {"b", "c"}


def test_a_generic_reduce_window_gives_its_init_value_no_dims():
    rule = _rule("reduce_window", [(8, 6), ()], (8, 3), {"window": (1, 2), "strides": (1, 2)})
    assert rule.spec == "a(bc),->ab"


def test_max_pool_backward_splits_rows_only_without_a_halo():
    """2x2 at stride 2: each window in one slab, so the source rows split with the operand's
    and the result's; overlapping windows (3x3 at stride 2) keep the rows whole."""
    rule = _rule("select_and_scatter_add", [(8, 8, 8, 4), (8, 16, 16, 4)], (8, 16, 16, 4), POOL_2X2)
    (src, operand), (res,) = rule.operands, rule.results
    assert src[0] == operand[0] == res[0]
    assert src[3] == operand[3] == res[3]
    assert operand[1] == res[1] == (src[1][0], operand[1][1])
    assert {operand[1][1], operand[2][1]} == rule.need_replication
    attrs = {**POOL_2X2, "window": (1, 3, 3, 1), "padding": ((0, 0), (1, 1), (1, 1), (0, 0))}
    rule = _rule("select_and_scatter_add", [(8, 8, 8, 4), (8, 16, 16, 4)], (8, 16, 16, 4), attrs)
    (src, operand), (res,) = rule.operands, rule.results
    assert {src[1][0], src[2][0], operand[1][0], operand[2][0]} <= rule.need_replication
    assert res[1][0] not in rule.need_replication
