"""Lowerings of normalisation, activation, strided-view, split and recurrent aten ops.

Merged into ``ops.TABLE``; the rules are ``ir/nn_rules.py``'s.

Batch norm in training mode computes its statistics over the batch and spatial dims, so it
is lowered as what ``SyncBatchNorm`` computes on a split batch: the per-channel sum
(``reduce_sum``), the mean, the centred sum of squares (``batch_norm_sqsum``), the inverse
deviation, then the channelwise normalisation (``batch_norm_apply``). The two sums come out
partial over the mesh axes that split the batch (or a spatial dim) and the plan prices their
all-reduce; ``apply`` and ``follow_plan`` run it so (``norm.py``) and the result equals the
plain model's training-mode batch norm. (DDP's default, statistics of each device's own
batch shard, is not numerically the same model and is not offered.) Its backward is the
per-channel reductions ``sum(g)`` and ``sum(g * xhat)`` (the bias and weight gradients,
partial over a split batch) and the elementwise input gradient that reads them whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from torch import fx

from ...ir import TensorType, Value
from .lower import Lowered, Lowering

Row = Callable[[Lowering, fx.Node], Lowered]

ACTIVATIONS = (
    "hardswish", "hardswish_backward", "hardsigmoid", "hardsigmoid_backward", "softplus",
    "softplus_backward", "mish", "mish_backward", "elu", "elu_backward", "leaky_relu",
    "leaky_relu_backward", "hardtanh", "hardtanh_backward", "log_sigmoid_backward",
)  # fmt: skip
SPLITS = ("unsafe_split", "unsafe_split_with_sizes", "split_copy", "split_with_sizes_copy")
BATCH_NORMS = (
    "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit_functional",
)  # fmt: skip
BATCH_NORM_BACKWARDS = ("native_batch_norm_backward",)
RNN_LAYERS = ("mkldnn_rnn_layer",)


def _elementwise(kind: str) -> Row:
    def row(low: Lowering, node: fx.Node) -> Value:
        types = low.result_types(node)[:1]
        return low.emit(kind, low.tensors(node.args), types)[0]

    return row


def _log_sigmoid(low: Lowering, node: fx.Node) -> list:
    """log_sigmoid_forward(x) -> (out, buffer): both elementwise (the buffer may be empty)."""
    x = low.value(node.args[0])
    out, buffer = low.result_types(node)
    made = low.emit("log_sigmoid", [x], [out])[0]
    return [made, low.emit("log_sigmoid", [x], [buffer])[0] if buffer.shape else None]


def _arg(node: fx.Node, index: int, name: str, default: object = None) -> object:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _reduced(rank: int) -> tuple[int, ...]:
    return tuple(d for d in range(rank) if d != 1)


def _channel(x: Value) -> TensorType:
    return TensorType(
        (x.type.shape[1],), "f32" if x.type.dtype in ("bf16", "f16") else x.type.dtype
    )


def _optional(low: Lowering, arg: object) -> Value | None:
    return low.env.get(arg) if isinstance(arg, fx.Node) else None  # type: ignore[return-value]


def batch_norm(low: Lowering, node: fx.Node) -> list:
    """The forward (every variant): training mode as global statistics, eval mode with the
    running statistics (a channelwise op)."""
    name = node.target.__name__.split(".")[0]  # type: ignore[union-attr]
    args = list(node.args)
    x = low.value(args[0])
    weight, bias = _optional(low, args[1]), _optional(low, args[2])
    if name == "_native_batch_norm_legit" and len(args) < 8:  # .no_stats: no running stats
        args[3:3] = [None, None]
    training = name != "_native_batch_norm_legit_no_training" and bool(args[5])
    eps = float(args[-1])  # type: ignore[arg-type]
    types = low.result_types(node)
    stat = _channel(x)
    if training:
        mean, invstd = _batch_statistics(low, x, stat, eps)
    else:
        mean = low.value(args[3])
        invstd = _invstd(low, low.value(args[4]), stat, eps)
    affine = [v for v in (weight, bias) if v is not None]
    out = low.emit("batch_norm_apply", [x, mean, invstd, *affine], types[:1])[0]
    results: list[Value | None] = [out]
    for t, saved in zip(types[1:3], (mean, invstd), strict=True):  # empty in eval mode
        results.append(saved if training and t.shape == stat.shape else _empty(low, t))
    if len(types) > 3:  # _functional: the updated running statistics, channelwise
        results += [low.emit("batch_norm_stat", [mean], [t])[0] for t in types[3:]]
    return results


def _invstd(low: Lowering, var: Value, stat: TensorType, eps: float) -> Value:
    """1 / sqrt(running_var + eps) (eval mode)."""
    return low.emit("batch_norm_stat", [var], [stat], {"eps": True, "epsilon": eps})[0]


def _batch_statistics(low: Lowering, x: Value, stat: TensorType, eps: float) -> tuple[Value, Value]:
    """mean and inverse deviation over the batch and spatial dims (two passes, like the
    kernel): each sum is partial over the axes splitting those dims."""
    axes = _reduced(x.type.rank)
    count = math.prod(x.type.shape[d] for d in axes)
    total = low.emit("reduce_sum", [x], [stat], {"axes": axes})[0]
    mean = low.emit("batch_norm_stat", [total], [stat], {"count": count})[0]
    squares = low.emit("batch_norm_sqsum", [x, mean], [stat])[0]
    attrs = {"count": count, "eps": True, "epsilon": eps}
    invstd = low.emit("batch_norm_stat", [squares], [stat], attrs)[0]
    return mean, invstd


def _empty(low: Lowering, t: TensorType) -> Value:
    return low.emit("constant", [], [t])[0]


def batch_norm_backward(low: Lowering, node: fx.Node) -> list:
    """(g, x, w, running_mean, running_var, save_mean, save_invstd, train, eps, mask)."""
    g, x = low.value(node.args[0]), low.value(node.args[1])
    weight = _optional(low, node.args[2])
    training = bool(node.args[7])
    stat = _channel(x)
    if training:
        mean, invstd = low.value(node.args[5]), low.value(node.args[6])
    else:
        mean = low.value(node.args[3])
        invstd = _invstd(low, low.value(node.args[4]), stat, float(node.args[8]))  # type: ignore[arg-type]
    types = low.result_types(node)
    vals = node.meta["val"]
    sums = low.emit("batch_norm_backward_reduce", [g, x, mean, invstd], [stat, stat])
    gx: Value | None = None
    if hasattr(vals[0], "shape"):
        operands = [g, x, mean, invstd, *([weight] if weight is not None else [])]
        if training:
            operands += sums
        gx = low.emit("batch_norm_backward_elemt", operands, types[:1])[0]
    gw = sums[1] if hasattr(vals[1], "shape") else None
    gb = sums[0] if len(vals) > 2 and hasattr(vals[2], "shape") else None
    return [gx, gw, gb]


def group_norm(low: Lowering, node: fx.Node) -> list:
    """native_group_norm(x, w, b, N, C, HxW, group, eps) -> (out, mean, rstd)."""
    operands = low.tensors(node.args[:3])
    return _multi(low, "group_norm", operands, node, groups=int(node.args[6]))  # type: ignore[call-overload]


def group_norm_backward(low: Lowering, node: fx.Node) -> list:
    """native_group_norm_backward(g, x, mean, rstd, w, N, C, HxW, group, mask)."""
    operands = low.tensors(node.args[:5])
    return _multi(low, "group_norm_backward", operands, node, groups=int(node.args[8]))  # type: ignore[call-overload]


def _multi(low: Lowering, kind: str, operands: list[Value], node: fx.Node, **attrs) -> list:  # type: ignore[no-untyped-def]
    vals = node.meta["val"]
    results = iter(low.emit(kind, operands, low.result_types(node), attrs))
    return [next(results) if hasattr(v, "shape") else None for v in vals]


def weight_norm(low: Lowering, node: fx.Node) -> list:
    """_weight_norm_interface(v, g, dim) -> (w, norm) and its backward (grad_w, v, g, norm,
    dim) -> (grad_v, grad_g): ``torch.nn.utils.parametrizations.weight_norm``."""
    forward = node.target.__name__.startswith("_weight_norm_interface.")  # type: ignore[union-attr]
    count = 2 if forward else 4
    operands = low.tensors(node.args[:count])
    dim = int(_arg(node, count, "dim", 0))  # type: ignore[call-overload]
    rank = operands[0 if forward else 1].type.rank
    return _multi(low, "weight_norm", operands, node, channel=dim % rank)


def split(low: Lowering, node: fx.Node) -> list:
    """unsafe_split and the ``_copy`` variants: the IR's split (one slice per piece)."""
    from .ops import split as plain_split

    return plain_split(low, node)


def unfold(low: Lowering, node: fx.Node) -> Value:
    """unfold(x, dim, size, step): sliding windows along ``dim``."""
    x = low.value(node.args[0])
    dim = int(node.args[1]) % max(x.type.rank, 1)  # type: ignore[call-overload]
    return low.emit("window", [x], low.result_types(node)[:1], {"dim": dim})[0]


def unfold_backward(low: Lowering, node: fx.Node) -> Value:
    """unfold_backward(g, input_sizes, dim, size, step): the windows summed back."""
    g = low.value(node.args[0])
    dim = int(node.args[2]) % len(node.args[1])  # type: ignore[call-overload, arg-type]
    return low.emit("window", [g], low.result_types(node)[:1], {"dim": dim})[0]


def as_strided(low: Lowering, node: fx.Node) -> Value:
    """as_strided(x, size, stride, offset=0): a reshape when it views ``x``'s elements in
    order, else a strided view (``ir.nn_rules.strided_view``: dims whose slices are read on
    their own pass through, the rest stays whole)."""
    x = low.value(node.args[0])
    size = tuple(int(n) for n in node.args[1])  # type: ignore[union-attr]
    stride = tuple(int(s) for s in node.args[2])  # type: ignore[union-attr]
    offset = int(_arg(node, 3, "storage_offset", 0) or 0)  # type: ignore[call-overload]
    out = low.result_types(node)[:1]
    if reads_in_order(size, stride, offset, x.type.numel):
        return low.emit("reshape", [x], out)[0]
    attrs = {"size": size, "stride": stride, "offset": offset}
    return low.emit("strided_view", [x], out, attrs)[0]


def reads_in_order(size: Sequence[int], stride: Sequence[int], offset: int, numel: int) -> bool:
    """Whether ``as_strided(x, size, stride, offset)`` of a contiguous ``x`` of ``numel``
    elements reads them all in order: a reshape (the strides of size-1 dims do not matter)."""
    contiguous = [math.prod(size[d + 1 :]) for d in range(len(size))]
    same = all(n == 1 or s == c for n, s, c in zip(size, stride, contiguous, strict=True))
    return offset == 0 and math.prod(size) == numel and same


def rnn_layer(low: Lowering, node: fx.Node) -> list:
    """mkldnn_rnn_layer(input[s, b, f], w_ih, w_hh, b_ih, b_hh, hx[b, h], cx[b, h], ...) ->
    (out[s, b, h], hy, cy, workspace): the batch is the only splittable dim."""
    operands = low.tensors(node.args[:7])
    types = low.result_types(node)
    batch = (1, -1, -1, -1, -1, 0, 0)[: len(operands)]
    batch += (1, 0, 0, -1)[: len(types)]  # out, hy, cy, workspace
    x, w_ih, w_hh = operands[0].type, operands[1].type, operands[2].type
    steps, rows, gates = x.shape[0], x.shape[1], w_ih.shape[0]
    flops = 2.0 * steps * rows * gates * (w_ih.shape[1] + w_hh.shape[1]) + 10 * steps * rows * gates
    return _multi(low, "rnn_layer", operands, node, batch=batch, flops=flops)


def rnn_layer_backward(low: Lowering, node: fx.Node) -> list:
    """mkldnn_rnn_layer_backward(input, w_ih, w_hh, b_ih, b_hh, hx, cx, out, hy, cy, g_out,
    g_hy, g_cy, ..., workspace) -> (g_input, g_w_ih, g_w_hh, g_b_ih, g_b_hh, g_hx, g_cx): the
    weight gradients sum over the batch."""
    positions = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12)
    dims = (1, -1, -1, -1, -1, 0, 0, 1, 0, 0, 1, 0, 0)
    operands, batch = [], []
    for k, d in zip(positions, dims, strict=True):
        v = _optional(low, node.args[k])
        if isinstance(v, Value):
            operands.append(v)
            batch.append(d)
    workspace = _optional(low, node.args[-1])
    if isinstance(workspace, Value):
        operands.append(workspace)
        batch.append(-1)
    vals = node.meta["val"]
    result_dims = (1, -1, -1, -1, -1, 0, 0)
    present = [d for v, d in zip(vals, result_dims, strict=True) if hasattr(v, "shape")]
    summed = tuple(k for k, d in enumerate(present) if d < 0)
    x, w_ih, w_hh = operands[0].type, operands[1].type, operands[2].type
    flops = 4.0 * x.shape[0] * x.shape[1] * w_ih.shape[0] * (w_ih.shape[1] + w_hh.shape[1])
    attrs = {"batch": (*batch, *present), "summed": summed, "flops": flops}
    return _multi(low, "rnn_layer", operands, node, **attrs)


def table() -> dict[str, Row]:
    rows: dict[str, Row] = {name: _elementwise(name) for name in ACTIVATIONS}
    rows["log_sigmoid_forward"] = _log_sigmoid
    rows.update(dict.fromkeys(SPLITS, split))
    rows.update(dict.fromkeys(BATCH_NORMS, batch_norm))
    rows.update(dict.fromkeys(BATCH_NORM_BACKWARDS, batch_norm_backward))
    rows.update(native_group_norm=group_norm, native_group_norm_backward=group_norm_backward)
    rows.update(unfold=unfold, unfold_backward=unfold_backward, as_strided=as_strided)
    rows.update(dict.fromkeys(RNN_LAYERS, rnn_layer))
    rows["mkldnn_rnn_layer_backward"] = rnn_layer_backward
    rows.update(_weight_norm_interface=weight_norm, _weight_norm_interface_backward=weight_norm)
    return rows
