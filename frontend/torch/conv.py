"""Lowerings of aten convolutions, pooling and resampling to the IR (rules in ``ir/conv.py``).

``aten.convolution(x, w, bias, stride, padding, dilation, transposed, output_padding, groups)``
becomes one ``convolution`` (XLA attributes, torch's NCHW dims) and, with a bias, a broadcast
``add`` of the bias viewed as ``[C, 1, ...]``. A transposed convolution is XLA's form of it:
``lhs_dilation = stride``, padding ``dilation * (k - 1) - padding`` (plus ``output_padding``
on the high side), the weight's dims 1 and 0 as its out and in features. The fused backward
``aten.convolution_backward`` becomes one ``convolution_backward`` whose results follow
``output_mask`` (absent gradients stay None).
"""

from __future__ import annotations

from torch import fx

from ...ir import TensorType, Value
from .lower import Lowered, Lowering


def _ints(value: object, n: int) -> tuple[int, ...]:
    values = [value] if isinstance(value, int) else list(value)  # type: ignore[call-overload]
    return tuple(int(v) for v in (values * n if len(values) == 1 else values))


def _geometry(node: fx.Node, spatial: int, first: int = 3) -> dict:
    """stride, padding, dilation, transposed, output_padding, groups from ``args[first:]``
    (3 in the forward, 4 in the backward, after ``bias_sizes``)."""
    a = node.args[first : first + 6]
    stride, padding, dilation = (_ints(a[i], spatial) for i in (0, 1, 2))
    return {
        "stride": stride, "padding": padding, "dilation": dilation, "transposed": bool(a[3]),
        "output_padding": _ints(a[4], spatial), "groups": int(a[5]),  # type: ignore[call-overload]
    }  # fmt: skip


def conv_attrs(weight: TensorType, geometry: dict) -> dict:
    """XLA ConvGeneralDilated attributes of a torch convolution (channels first)."""
    rank = weight.rank
    spatial = rank - 2
    dims = tuple(range(rank))
    kernel = weight.shape[2:]
    stride, padding, dilation = geometry["stride"], geometry["padding"], geometry["dilation"]
    attrs = {
        "lhs_dims": dims, "out_dims": dims, "rhs_dims": dims, "strides": stride,
        "padding": tuple((p, p) for p in padding), "lhs_dilation": (1,) * spatial,
        "rhs_dilation": dilation, "feature_group_count": geometry["groups"],
        "batch_group_count": 1,
    }  # fmt: skip
    if geometry["transposed"]:
        edge = [d * (k - 1) - p for d, k, p in zip(dilation, kernel, padding, strict=True)]
        attrs["padding"] = tuple(
            (e, e + op) for e, op in zip(edge, geometry["output_padding"], strict=True)
        )
        attrs.update(strides=(1,) * spatial, lhs_dilation=stride, rhs_dims=(1, 0, *dims[2:]))
    return attrs


def convolution(low: Lowering, node: fx.Node) -> Value:
    x, w = low.value(node.args[0]), low.value(node.args[1])
    out = low.result_types(node)[0]
    attrs = conv_attrs(w.type, _geometry(node, w.type.rank - 2))
    y = low.emit("convolution", [x, w], [out], attrs)[0]
    if node.args[2] is None:
        return y
    bias = low.value(node.args[2])
    column = TensorType((bias.type.shape[0],) + (1,) * (out.rank - 2), bias.type.dtype)
    b = low.emit("reshape", [bias], [column])[0]
    return low.emit("add", [y, b], [out])[0]


def convolution_backward(low: Lowering, node: fx.Node) -> Lowered:
    """(grad_input, grad_weight, grad_bias) per ``output_mask``; the IR op's results are the
    gradients asked for, in that order."""
    grad, x, w = (low.value(a) for a in node.args[:3])
    geometry = _geometry(node, w.type.rank - 2, first=4)
    mask = tuple(bool(m) for m in node.args[10])  # type: ignore[union-attr]
    vals = node.meta["val"]
    present = tuple(m and v is not None for m, v in zip(mask, vals, strict=True))
    attrs = {
        "output_mask": present, "transposed": geometry["transposed"],
        "feature_group_count": geometry["groups"], "strides": geometry["stride"],
        "padding": tuple((p, p) for p in geometry["padding"]),
        "rhs_dilation": geometry["dilation"],
    }  # fmt: skip
    types = low.result_types(node)
    if not types:
        return [None, None, None]
    results = iter(low.emit("convolution_backward", [grad, x, w], types, attrs))
    return [next(results) if p else None for p in present]


TABLE = {"convolution": convolution, "convolution_backward": convolution_backward}
