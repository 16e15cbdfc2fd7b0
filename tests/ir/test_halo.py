"""Halo splits of convolutions (``ir/halo.py``): which spatial dims may split, with which halo,
in the forward and the weight-gradient (window) form; what is refused."""

from __future__ import annotations

import pytest
from shardplan.costmodel.collectives import Collective
from shardplan.costmodel.conv import halo_collectives
from shardplan.ir import Mesh, Op, Sharding, TensorType, Value, rule_for
from shardplan.ir.halo import Halo, halo_rows, halo_split

T = TensorType


def _attrs(stride=1, dilation=1, pad=1, **extra):  # type: ignore[no-untyped-def]
    return {"strides": (stride,), "rhs_dilation": (dilation,), "padding": ((pad, pad),), **extra}


@pytest.mark.parametrize(
    ("rows", "attrs", "want"),
    [
        ((64, 3, 64), _attrs(), Halo("forward", 1, 1, 1)),  # same-padded 3x3
        ((64, 3, 64), _attrs(dilation=2, pad=2), Halo("forward", 1, 2, 2)),
        ((64, 3, 32), _attrs(stride=2), Halo("forward", 2, 1, 0)),  # strided: none ahead
        ((64, 1, 32), _attrs(stride=2, pad=0), Halo("forward", 2, 0, -1)),  # row unread
        # XLA's weight gradient of a same-padded 3x3: lhs x, rhs dy (64 rows), out the kernel
        ((64, 64, 3), _attrs(), Halo("window", 1, 1, 1)),
        # ... of a stride-2 3x3: rhs dilation 2 (the forward stride), dy 32 rows
        ((64, 32, 3), _attrs(dilation=2, pad=1), Halo("window", 2, 1, 0)),
    ],
)
def test_halo_split_forms(rows, attrs, want) -> None:  # type: ignore[no-untyped-def]
    assert halo_split(rows, attrs, 0, window=True) == want


@pytest.mark.parametrize(
    ("rows", "attrs"),
    [
        ((63, 3, 32), _attrs(stride=2)),  # odd rows: the input is not 2x the output
        ((64, 3, 64), _attrs(transposed=True)),
        ((64, 3, 127), _attrs(lhs_dilation=(2,))),  # a transposed conv's dilated input
        ((64, 3, 66), _attrs(pad=2)),  # padded past the window: a wider output
    ],
)
def test_halo_split_refuses(rows, attrs) -> None:  # type: ignore[no-untyped-def]
    assert halo_split(rows, attrs, 0, window=True) is None


def test_halo_rows_reach_back_the_padding_and_ahead_the_rest_of_the_window() -> None:
    assert halo_rows(3, 1, 1, 1) == (1, 1)
    assert halo_rows(5, 2, 1, 4) == (4, 4)
    assert halo_rows(3, 1, 2, 1) == (1, 0)


def test_weight_gradient_conv_sums_the_split_rows() -> None:
    """NCHW weight gradient (XLA: lhs = x with C as its batch, rhs = dy, out = the kernel):
    the rhs rows and the lhs rows share a factor that the result lacks - a reduction."""
    attrs = {"lhs_dims": (1, 0, 2, 3), "rhs_dims": (1, 0, 2, 3), "out_dims": (1, 0, 2, 3),
             "strides": (1, 1), "padding": ((1, 1), (1, 1))}  # fmt: skip
    rule = rule_for("convolution", [T((1, 8, 64, 64), "f32"), T((1, 16, 64, 64), "f32")],
                    [T((16, 8, 3, 3), "f32")], attrs)  # fmt: skip
    rows = rule.operands[0][2]
    assert rows == rule.operands[1][2]
    assert rows[0] in rule.reduction


def test_halo_collectives_of_an_nhwc_convolution_split_along_its_rows() -> None:
    """Flax layout: the rows are dim 1; one collective-permute each way of one local row."""
    mesh = Mesh({"x": 4})
    attrs = {"lhs_dims": (0, 3, 1, 2), "rhs_dims": (3, 2, 0, 1), "out_dims": (0, 3, 1, 2),
             "strides": (1, 1), "padding": ((1, 1), (1, 1))}  # fmt: skip
    x, w = Value("x", T((1, 64, 32, 16), "f32")), Value("w", T((3, 3, 16, 16), "f32"))
    out = Value("y", T((1, 64, 32, 16), "f32"))
    rule = rule_for("convolution", [x.type, w.type], [out.type], attrs)
    op = Op("convolution", [x, w], [out], rule, attrs=attrs)
    rows = Sharding.of(None, "x", None, None)
    row = 32 * 16 * 4
    assert halo_collectives(op, [rows, Sharding.of(None, None, None, None)], mesh) == [
        Collective("collective-permute", ("x",), row),
        Collective("collective-permute", ("x",), row),
    ]
    columns = Sharding.of(None, None, "x", None)  # the columns: W, also a halo split
    assert len(halo_collectives(op, [columns, Sharding.of(None, None, None, None)], mesh)) == 2
    channels = Sharding.of(None, None, None, "x")  # the features: no halo
    assert halo_collectives(op, [channels, Sharding.of(None, None, None, None)], mesh) == []
