"""Rules of XLA's window ops (``ir/window.py``): pooling and the max-pool backward."""

from __future__ import annotations

from shardplan.ir import TensorType, rule_for

POOL_2X2 = {
    "window": (1, 2, 2, 1),
    "strides": (1, 2, 2, 1),
    "padding": ((0, 0),) * 4,
    "base_dilation": (1,) * 4,
    "window_dilation": (1,) * 4,
}


def _rule(kind, ins, out, attrs):
    return rule_for(kind, [TensorType(s, "f32") for s in ins], [TensorType(out, "f32")], attrs)


def test_pooling_passes_batch_and_channels_and_keeps_windows_whole():
    rule = _rule("reduce_window_max", [(8, 16, 16, 4)], (8, 8, 8, 4), POOL_2X2)
    (x,), (out,) = rule.operands, rule.results
    assert x[0] == out[0]
    assert x[3] == out[3]
    assert {x[1][0], x[2][0]} <= rule.need_replication  # a split window needs a halo
    assert x[1] != out[1]
    assert out[1][0] not in rule.need_replication  # sliced locally from a whole input
    assert rule.spec == "abcd->aefd"


def test_a_padded_stride_1_window_still_mixes_its_dims():
    """avg-pool's backward: a 2x2 window at stride 1 over the padded gradient."""
    attrs = {**POOL_2X2, "strides": (1,) * 4, "padding": ((0, 0), (1, 1), (1, 1), (0, 0))}
    rule = _rule("reduce_window_sum", [(8, 4, 4, 16)], (8, 5, 5, 16), attrs)
    assert rule.spec == "abcd->aefd"
    assert rule.need_replication == {"b", "c"}


def test_a_generic_reduce_window_gives_its_init_value_no_dims():
    rule = _rule("reduce_window", [(8, 6), ()], (8, 3), {"window": (1, 2), "strides": (1, 2)})
    assert rule.spec == "ab,->ac"


def test_max_pool_backward_passes_batch_and_channels():
    rule = _rule("select_and_scatter_add", [(8, 8, 8, 4), (8, 16, 16, 4)], (8, 16, 16, 4), POOL_2X2)
    (src, operand), (res,) = rule.operands, rule.results
    assert src[0] == operand[0] == res[0]
    assert src[3] == operand[3] == res[3]
    assert {src[1][0], src[2][0], operand[1][0], operand[2][0]} <= rule.need_replication
