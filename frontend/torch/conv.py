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

from collections.abc import Callable

from torch import fx

from ...ir import TensorType, Value
from ...ir.errors import FrontendError
from .lower import Lowered, Lowering

Row = Callable[[Lowering, fx.Node], Lowered]


def _single(low: Lowering, kind: str, operands: list[Value], node: fx.Node, **attrs) -> Value:  # type: ignore[no-untyped-def]
    return low.emit(kind, operands, low.result_types(node)[:1], attrs)[0]


def _multi(low: Lowering, kind: str, operands: list[Value], node: fx.Node, **attrs) -> list:  # type: ignore[no-untyped-def]
    """Several results (a max pool's values and indices); None outputs stay None."""
    results = iter(low.emit(kind, operands, low.result_types(node), attrs))
    return [next(results) if hasattr(v, "shape") else None for v in node.meta["val"]]


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


def _spatial(name: str) -> int:
    """1, 2 or 3 from ``max_pool2d_with_indices``, ``upsample_trilinear3d_backward``..."""
    for n in (1, 2, 3):
        if f"{n}d" in name:
            return n
    raise FrontendError(f"no spatial rank in aten op name {name!r}")


def window(kind: str, name: str) -> Row:
    """A pooling / resampling op over the trailing spatial dims of its first tensor operand:
    every tensor operand in order (grad, input, indices), one result or (values, indices)."""
    spatial = _spatial(name)

    def row(low: Lowering, node: fx.Node) -> Lowered:
        operands = low.tensors(node.args)
        rank = operands[0].type.rank
        attrs: dict[str, object] = {"window_dims": tuple(range(rank - spatial, rank))}
        if disjoint_windows(kind, tuple(node.args), spatial):
            attrs["disjoint_windows"] = True
        if isinstance(node.meta.get("val"), (list, tuple)):
            return _multi(low, kind, operands, node, **attrs)
        return _single(low, kind, operands, node, **attrs)

    return row


POOL_ARGS = {"max_pool": 4, "avg_pool": 3}
"""Window arguments (kernel, stride, padding[, dilation]) of the pooling calls that have them,
after the input (and, in the backward, the output gradient before it)."""


def disjoint_windows(kind: str, args: tuple, spatial: int) -> bool:
    """Whether every window of a max / avg pool call lies inside its own stride step (kernel
    <= stride, no padding, no dilation): its window dims may then split at multiples of the
    stride with no halo (``ir.conv.windowed``). ``args``: the aten call's, defaults left out
    as fx leaves them (an empty stride is the kernel)."""
    base = kind.removesuffix("_backward")
    if base not in POOL_ARGS:
        return False
    first = 2 if kind.endswith("_backward") else 1
    given = list(args[first : first + POOL_ARGS[base]])
    kernel, stride, padding, dilation = [*given, *[None] * (4 - len(given))]
    k = _ints(kernel, spatial)
    s = _ints(stride, spatial) if stride else k
    pads = _ints(padding if padding is not None else 0, spatial)
    dilations = _ints(dilation if dilation is not None else 1, spatial)
    return (
        all(a <= b for a, b in zip(k, s, strict=True)) and not any(pads) and set(dilations) == {1}
    )


def adaptive_avg_pool(name: str) -> Row:
    """To size 1 everywhere (a classifier's global pool) it is a mean over the spatial dims,
    whose backward spreads the gradient back (a broadcast): both get the reduction's factors
    (a spatial split leaves partial sums, not replication). Else a window op."""
    backward = name.endswith("_backward")
    spatial = _spatial(name)
    general = window("adaptive_avg_pool" + "_backward" * backward, name)

    def row(low: Lowering, node: fx.Node) -> Lowered:
        x = low.value(node.args[0])
        out = low.result_types(node)[0]
        small = x.type if backward else out
        if any(d != 1 for d in small.shape[small.rank - spatial :]):
            return general(low, node)
        if backward:
            return _single(low, "copy", [x], node)
        axes = tuple(range(x.type.rank - spatial, x.type.rank))
        return _single(low, "mean", [x], node, axes=axes)

    return row


def pixel_shuffle(inverse: bool) -> Row:
    def row(low: Lowering, node: fx.Node) -> Value:
        attrs = {"upscale_factor": int(node.args[1]), "inverse": inverse}  # type: ignore[call-overload]
        return _single(low, "pixel_shuffle", [low.value(node.args[0])], node, **attrs)

    return row


POOLS = {
    "max_pool": ("max_pool{n}d_with_indices", "max_pool{n}d_with_indices_backward"),
    "avg_pool": ("avg_pool{n}d", "avg_pool{n}d_backward"),
    "adaptive_max_pool": ("adaptive_max_pool{n}d", "adaptive_max_pool{n}d_backward"),
    "upsample": tuple(
        f"upsample_{mode}{{n}}d{suffix}"
        for mode in ("nearest", "_nearest_exact", "linear", "bilinear", "bicubic", "trilinear")
        for suffix in ("", "_backward")
    ),
}
"""IR kind -> aten name patterns (the backward ones get the kind's ``_backward``)."""


def _table() -> dict[str, Row]:
    table: dict[str, Row] = {
        "convolution": convolution,
        "convolution_backward": convolution_backward,
    }
    for kind, patterns in POOLS.items():
        for pattern in patterns:
            for n in (1, 2, 3):
                name = pattern.format(n=n).replace("upsample__", "_upsample_")
                ir_kind = kind + ("_backward" if name.endswith("_backward") else "")
                table[name] = window(ir_kind, name)
    for n in (1, 2, 3):
        for name in (f"_adaptive_avg_pool{n}d", f"_adaptive_avg_pool{n}d_backward"):
            table[name] = adaptive_avg_pool(name)
            table[name.lstrip("_")] = table[name]
    table["pixel_shuffle"], table["pixel_unshuffle"] = pixel_shuffle(False), pixel_shuffle(True)
    return table


TABLE = _table()
