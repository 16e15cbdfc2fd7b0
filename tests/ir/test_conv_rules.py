"""Convolution rules (``ir/conv.py``): factor maps for torch and Flax layouts, FLOPs, text form."""

from __future__ import annotations

import pytest
from shardplan.ir import (
    Graph,
    IRVerifyError,
    TensorType,
    op_flops,
    parse_graph,
    print_graph,
    rule_for,
)

T = TensorType
TORCH = {"lhs_dims": (0, 1, 2, 3), "rhs_dims": (0, 1, 2, 3), "out_dims": (0, 1, 2, 3)}
FLAX = {"lhs_dims": (0, 3, 1, 2), "rhs_dims": (3, 2, 0, 1), "out_dims": (0, 3, 1, 2)}


def _rule(ins, outs, attrs, kind="convolution"):  # type: ignore[no-untyped-def]
    types_in = [T(s, "f32") for s in ins]
    types_out = [T(s, "f32") for s in outs]
    return rule_for(kind, types_in, types_out, attrs), types_in, types_out


def test_torch_conv_batch_and_out_feature_pass_in_feature_reduces() -> None:
    rule, ins, outs = _rule([(8, 16, 32, 32), (32, 16, 3, 3)], [(8, 32, 30, 30)], TORCH)
    assert rule.spec == "bceh,dcfi->bdgj"
    assert rule.reduction == {"c"}
    assert rule.need_replication == {"e", "f", "h", "i"}  # input rows/cols and kernel taps
    assert op_flops("convolution", rule, ins, outs, TORCH) == 2 * 8 * 32 * 30 * 30 * 16 * 9


def test_flax_nhwc_hwio_conv_maps_the_same_factors() -> None:
    rule, *_ = _rule([(8, 32, 32, 16), (3, 3, 16, 32)], [(8, 30, 30, 32)], FLAX)
    (lhs, rhs), (out,) = rule.operands, rule.results
    n, c, o = lhs[0], lhs[3], out[3]
    assert out[0] == n
    assert rhs[2] == c  # HWIO: I is the in feature
    assert rhs[3] == o
    assert rule.reduction == set(c)


def test_depthwise_conv_splits_by_group_without_partial_sums() -> None:
    attrs = {**TORCH, "feature_group_count": 16}
    rule, ins, outs = _rule([(4, 16, 8, 8), (16, 1, 3, 3)], [(4, 16, 8, 8)], attrs)
    (lhs, rhs), (out,) = rule.operands, rule.results
    assert lhs[1] == rhs[0] == out[1]  # the group factor, one channel per group
    assert rhs[1] == ()
    assert not rule.reduction
    assert op_flops("convolution", rule, ins, outs, attrs) == 2 * 4 * 16 * 64 * 9


def test_grouped_conv_group_factor_is_major() -> None:
    attrs = {**TORCH, "feature_group_count": 2}
    rule, *_ = _rule([(4, 16, 8, 8), (32, 8, 3, 3)], [(4, 32, 6, 6)], attrs)
    (lhs, rhs), (out,) = rule.operands, rule.results
    g, c = lhs[1]
    assert rhs[0][0] == out[1][0] == g
    assert rhs[1] == (c,)
    assert rule.size_of[g] == 2
    assert rule.reduction == {c}


def test_batch_group_count_puts_the_group_in_the_lhs_batch() -> None:
    """XLA's weight gradient of a depthwise conv: lhs batch (G major) meets out features."""
    attrs = {**TORCH, "batch_group_count": 8}
    rule, *_ = _rule([(8, 4, 6, 6), (8, 4, 3, 3)], [(1, 8, 4, 4)], attrs)
    (lhs, rhs), (out,) = rule.operands, rule.results
    assert lhs[0] == out[1] == rhs[0]
    assert rule.reduction == set(lhs[1])


def test_transposed_conv_flops_skip_the_inserted_zeros() -> None:
    attrs = {**TORCH, "rhs_dims": (1, 0, 2, 3), "lhs_dilation": (2, 2), "padding": ((1, 2),) * 2}
    rule, ins, outs = _rule([(2, 8, 8, 8), (8, 4, 3, 3)], [(2, 4, 16, 16)], attrs)
    (lhs, rhs), (out,) = rule.operands, rule.results
    assert rhs[0] == lhs[1]
    assert rhs[1] == out[1]
    assert op_flops("convolution", rule, ins, outs, attrs) == 2 * (2 * 8 * 64) * 4 * 9


def test_conv_backward_sums_batch_into_weight_grads_and_out_feature_into_input_grad() -> None:
    attrs = {"output_mask": (True, True, True), "feature_group_count": 1}
    shapes_in = [(8, 32, 6, 6), (8, 16, 8, 8), (32, 16, 3, 3)]
    rule, ins, outs = _rule(shapes_in, [(8, 16, 8, 8), (32, 16, 3, 3), (32,)], attrs,
                            "convolution_backward")  # fmt: skip
    grad, _x, w = rule.operands
    n, o = grad[0][0], grad[1][0]
    assert dict(rule.summed) == {n: (1, 2), o: (0,)}
    assert rule.results[1] == w
    forward = 2 * 8 * 32 * 36 * 16 * 9
    assert op_flops("convolution_backward", rule, ins, outs, attrs) == 2 * forward + 8 * 32 * 36


def test_first_conv_backward_without_input_grad_reduces_the_batch() -> None:
    attrs = {"output_mask": (False, True, False), "feature_group_count": 1}
    rule, ins, outs = _rule([(8, 16, 6, 6), (8, 3, 8, 8), (16, 3, 3, 3)], [(16, 3, 3, 3)],
                            attrs, "convolution_backward")  # fmt: skip
    assert rule.reduction == {rule.operands[0][0][0]}
    assert not rule.summed
    assert op_flops("convolution_backward", rule, ins, outs, attrs) == 2 * 8 * 16 * 36 * 3 * 9


def test_conv_refuses_mismatched_groups_and_dims() -> None:
    with pytest.raises(IRVerifyError, match="groups"):
        _rule([(4, 15, 8, 8), (32, 5, 3, 3)], [(4, 32, 6, 6)], {**TORCH, "feature_group_count": 2})
    with pytest.raises(IRVerifyError, match="lhs_dims"):
        _rule([(4, 16, 8, 8), (32, 16, 3, 3)], [(4, 32, 6, 6)], {**TORCH, "lhs_dims": (0, 1, 1, 2)})


def test_conv_attrs_print_and_parse_back() -> None:
    g = Graph("c")
    x = g.add_input("x", T((2, 4, 8, 8), "f32"))
    w = g.add_input("w", T((8, 4, 3, 3), "f32"))
    attrs = {**TORCH, "strides": (1, 1), "padding": ((1, 1), (0, 2)), "feature_group_count": 1}
    (y,) = g.add_op("convolution", [x, w], [T((2, 8, 8, 8), "f32")], attrs=attrs).results
    g.outputs.append(y)
    text = print_graph(g)
    assert "[[1, 1], [0, 2]]" in text
    again = parse_graph(text)
    assert again.ops[0].attrs["padding"] == ((1, 1), (0, 2))
    assert print_graph(again) == text
