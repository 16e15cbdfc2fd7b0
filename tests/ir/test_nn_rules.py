"""Rules of the normalisation, recurrent, window and strided-view ops (``ir/nn_rules.py``)."""

from __future__ import annotations

from shardplan.ir import TensorType
from shardplan.ir.registry import rule_for

X = TensorType((8, 4, 3, 3))
C = TensorType((4,))


def test_batch_norm_statistics_are_partial_over_batch_and_space() -> None:
    """The centred sum of squares [C] of x[N, C, H, W]: N, H, W are reductions (a split batch
    leaves it partial: the all-reduce the plan prices); C passes through."""
    rule = rule_for("batch_norm_sqsum", [X, C], [C], {})
    n, c, h, w = (d[0] for d in rule.operands[0])
    assert rule.operands[1] == ((c,),)
    assert rule.results == (((c,),),)
    assert rule.reduction == {n, h, w}
    assert not rule.need_replication


def test_batch_norm_apply_passes_every_dim() -> None:
    rule = rule_for("batch_norm_apply", [X, C, C, C, C], [X], {})
    assert rule.results[0] == rule.operands[0]
    assert all(t == ((rule.operands[0][1][0],),) for t in rule.operands[1:])
    assert not rule.reduction
    assert not rule.need_replication


def test_batch_norm_backward_reduce_sums_over_the_batch() -> None:
    rule = rule_for("batch_norm_backward_reduce", [X, X, C, C], [C, C], {})
    assert rule.reduction == {d[0] for k, d in enumerate(rule.operands[0]) if k != 1}


def test_group_norm_splits_the_batch_and_sums_weight_gradients() -> None:
    stats = TensorType((8, 2))
    forward = rule_for("group_norm", [X, C, C], [X, stats, stats], {"groups": 2})
    n = forward.operands[0][0][0]
    assert forward.results[1][0] == (n,)
    assert forward.need_replication == set(forward.factor_names) - {n}
    backward = rule_for("group_norm_backward", [X, X, stats, stats, C], [X, C, C], {"groups": 2})
    assert backward.summed == ((n, (1, 2)),)
    assert backward.partial_factors(1) == {n}
    assert backward.partial_factors(0) == set()


def test_rnn_layer_splits_only_the_batch() -> None:
    """mkldnn_rnn_layer: input [s, b, f], hx/cx [b, h]; weight gradients sum over b."""
    seq, hidden = TensorType((5, 8, 16)), TensorType((8, 32))
    w_ih, w_hh, bias = TensorType((128, 16)), TensorType((128, 32)), TensorType((128,))
    out, empty = TensorType((5, 8, 32)), TensorType((0,))
    attrs = {"batch": (1, -1, -1, -1, -1, 0, 0, 1, 0, 0, -1), "flops": 1.0}
    rule = rule_for("rnn_layer", [seq, w_ih, w_hh, bias, bias, hidden, hidden],
                    [out, hidden, hidden, empty], attrs)  # fmt: skip
    b = rule.operands[0][1][0]
    assert rule.need_replication == set(rule.factor_names) - {b}
    assert rule.results[0][1] == (b,)
    assert rule.results[1][0] == (b,)
    grads = rule_for(
        "rnn_layer", [seq, w_ih, out], [seq, w_ih], {"batch": (1, -1, 1, 1, -1), "summed": (1,)}
    )
    assert grads.partial_factors(1) == {grads.operands[0][1][0]}


def test_window_keeps_the_windowed_dim_whole() -> None:
    x, windows = TensorType((8, 4, 6)), TensorType((8, 4, 4, 3))
    rule = rule_for("window", [x], [windows], {"dim": 2})
    b, c, _ = (d[0] for d in rule.operands[0])
    assert rule.results[0][:2] == ((b,), (c,))
    assert rule.need_replication == set(rule.factor_names) - {b, c}


def test_strided_view_passes_dims_read_slab_by_slab() -> None:
    """as_strided of x[8, 4, 6] as overlapping windows [8, 4, 4, 3] along the last dim: the
    outer two dims pass through; a window that crosses rows keeps the row dim whole."""
    x = TensorType((8, 4, 6))
    attrs = {"size": (8, 4, 4, 3), "stride": (24, 6, 1, 1), "offset": 0}
    rule = rule_for("strided_view", [x], [TensorType((8, 4, 4, 3))], attrs)
    b, c, _ = (d[0] for d in rule.operands[0])
    assert rule.results[0][:2] == ((b,), (c,))
    assert b not in rule.need_replication
    assert c not in rule.need_replication
    crossing = {"size": (8, 3, 8), "stride": (24, 6, 1), "offset": 0}  # a row reads the next
    rule = rule_for("strided_view", [x], [TensorType((8, 3, 8))], crossing)
    b, c, _ = (d[0] for d in rule.operands[0])
    assert c in rule.need_replication
    assert rule.results[0][0] == (b,)
    beyond = {"size": (8, 4, 8), "stride": (24, 6, 1), "offset": 0}  # the last row: next sample
    rule = rule_for("strided_view", [x], [TensorType((8, 4, 8))], beyond)
    assert rule.need_replication == set(rule.factor_names)


def test_weight_norm_passes_only_the_kept_dim() -> None:
    """_weight_norm_interface(v[o, i, k], g) -> (w, norm), and its backward: each slice along
    the kept dim is normalised alone (dim 2 in Wav2Vec2's positional conv, 0 by default)."""
    v, kept_k, kept_o = TensorType((32, 8, 4)), TensorType((1, 1, 4)), TensorType((32, 1, 1))
    rule = rule_for("weight_norm", [v, kept_k], [v, kept_k], {"channel": 2})
    k = rule.operands[0][2][0]
    assert rule.operands[1] == ((), (), (k,))
    assert rule.results[0][2] == (k,)
    assert rule.need_replication == set(rule.factor_names) - {k}
    backward = rule_for("weight_norm", [v, v, kept_o, kept_o], [v, kept_o], {"channel": 0})
    o = backward.operands[0][0][0]
    assert backward.results[1] == ((o,), (), ())
    assert backward.need_replication == set(backward.factor_names) - {o}
