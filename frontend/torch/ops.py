"""The aten -> IR lowering table: one row per aten overload packet.

Rows read as ``"aten name": lowering``. Elementwise ops map by name to IR kinds; the rest are
small functions that pick tensor operands, translate attributes (dims, perms, axes) and may emit
a short IR sequence (``addmm`` is matmul then add; ``select`` is slice then reshape).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import fx

from ...ir import ShardingRule, TensorType, Value
from ...ir.registry import register_rule
from ...ir.rule_helpers import replicated_rule
from .lower import Lowered, Lowering

Row = Callable[[Lowering, fx.Node], Lowered]

# Index writes (backward of advanced indexing): data-dependent, so nothing may be split.
register_rule("scatter", lambda ins, outs, attrs: replicated_rule(ins, outs), flops="none")


def _complex_view_rule(ins, outs, attrs):  # type: ignore[no-untyped-def]
    """``view_as_complex`` ``[*d, 2] -> [*d]`` and ``view_as_real`` ``[*d] -> [*d, 2]``
    (torchtitan's rotary embedding): the leading dims map one to one, the (real, imaginary)
    pair is one factor that is never split."""
    x, out = ins[0], outs[0]
    lead = "abcdefghijklmnopqrstuvwxy"[: min(x.rank, out.rank)]
    pair = "z" if x.rank != out.rank else ""
    spec = f"{lead}{pair if x.rank > out.rank else ''}->{lead}{pair if out.rank > x.rank else ''}"
    return ShardingRule.from_spec(spec, [x.shape], [out.shape], need_replication=pair)


register_rule("complex_view", _complex_view_rule, flops="none", linear=True)


def _single(low: Lowering, kind: str, operands: list[Value], node: fx.Node, **attrs) -> Value:  # type: ignore[no-untyped-def]
    return low.emit(kind, operands, low.result_types(node)[:1], attrs)[0]


def _multi(low: Lowering, kind: str, operands: list[Value], node: fx.Node, **attrs) -> list:  # type: ignore[no-untyped-def]
    """An op with several results; None outputs of the aten op stay None."""
    vals = node.meta["val"]
    types = low.result_types(node)
    results = iter(low.emit(kind, operands, types, attrs))
    return [next(results) if hasattr(v, "shape") else None for v in vals]


def elementwise(kind: str) -> Row:
    return lambda low, node: _single(low, kind, low.tensors(node.args), node)


def constant(kind: str = "constant") -> Row:
    """Factories (zeros, full, arange...): no operands, the result is made on every device."""
    return lambda low, node: low.emit(kind, [], low.result_types(node))[0]


def reshape(low: Lowering, node: fx.Node) -> Value:
    return _single(low, "reshape", [low.value(node.args[0])], node)


def _rank(low: Lowering, node: fx.Node) -> int:
    return low.value(node.args[0]).type.rank


def transpose(low: Lowering, node: fx.Node) -> Value:
    rank = _rank(low, node)
    perm = list(range(rank))
    if node.target.__name__.startswith("t.") or len(node.args) < 3:  # aten.t
        perm = perm[::-1]
    else:
        a, b = node.args[1] % rank, node.args[2] % rank
        perm[a], perm[b] = perm[b], perm[a]
    return _single(low, "transpose", [low.value(node.args[0])], node, perm=tuple(perm))


def permute(low: Lowering, node: fx.Node) -> Value:
    rank = _rank(low, node)
    perm = tuple(d % rank for d in node.args[1])
    return _single(low, "transpose", [low.value(node.args[0])], node, perm=perm)


def expand(low: Lowering, node: fx.Node) -> Value:
    x = low.value(node.args[0])
    out = low.result_types(node)[0]
    dims = tuple(range(out.rank - x.type.rank, out.rank))
    return _single(low, "broadcast_in_dim", [x], node, dims=dims)


def repeat(low: Lowering, node: fx.Node) -> Value:
    """``x.repeat(sizes)`` tiles dim ``i`` ``sizes[i]`` times, copies major: a broadcast to
    ``[sizes[0], x0, sizes[1], x1, ...]`` (new leading dims for extra sizes), then a reshape
    merging each pair. A dim repeated once, or of size 1, needs no pair."""
    x = low.value(node.args[0])
    sizes = [int(k) for k in node.args[1]]  # type: ignore[union-attr]
    lead = len(sizes) - x.type.rank
    shape: list[int] = []
    dims: list[int] = []
    for i, k in enumerate(sizes):
        if i < lead:  # a new leading dim of k copies
            shape.append(k)
            continue
        size = x.type.shape[i - lead]
        if k != 1 and size != 1:  # k copies of the whole dim: their own dim, before it
            shape.append(k)
            k = 1
        dims.append(len(shape))
        shape.append(size * k)  # a size-1 dim broadcast to k
    out = low.result_types(node)[0]
    wide = TensorType(tuple(shape), x.type.dtype)
    tiled = low.emit("broadcast_in_dim", [x], [wide], {"dims": tuple(dims)})[0]
    if wide.shape == out.shape:
        return tiled
    return low.emit("reshape", [tiled], [out])[0]


def matmul(low: Lowering, node: fx.Node) -> Value:
    operands = low.tensors(node.args[:2])
    if low.fold_broadcast_weights and len(operands) == 2:
        operands[1] = _unbroadcast(low, node.args[1]) or operands[1]
    return _single(low, "matmul", operands, node)


def _unbroadcast(low: Lowering, arg: object) -> Value | None:
    """The 2-D tensor behind ``view(expand(w2d, [b, k, n]), [b, k, n])``, else None."""
    if not isinstance(arg, fx.Node) or getattr(arg.target, "__name__", "").split(".")[0] not in (
        "view", "_unsafe_view", "reshape",
    ):  # fmt: skip
        return None
    base = arg.args[0]
    if not isinstance(base, fx.Node) or getattr(base.target, "__name__", "").split(".")[0] != (
        "expand"
    ):
        return None
    src = low.env.get(base.args[0])  # type: ignore[arg-type]
    out = low.env.get(arg)
    if not isinstance(src, Value) or not isinstance(out, Value) or src.type.rank != 2:
        return None
    return src if out.type.rank == 3 and out.type.shape[1:] == src.type.shape else None


def matmul_add(low: Lowering, node: fx.Node) -> Value:
    """addmm / baddbmm(bias, a, b): ``a @ b`` then ``+ bias`` (beta/alpha change no layout)."""
    bias, a, b = (low.value(x) for x in node.args[:3])
    out = low.result_types(node)[0]
    product = low.emit("matmul", [a, b], [out])[0]
    return low.emit("add", [product, bias], [out])[0]


def linear(low: Lowering, node: fx.Node) -> Value:
    x, w = low.value(node.args[0]), low.value(node.args[1])
    wt = low.emit(
        "transpose", [w], [TensorType(w.type.shape[::-1], w.type.dtype)], {"perm": (1, 0)}
    )
    out = low.result_types(node)[0]
    y = low.emit("matmul", [x, wt[0]], [out])[0]
    if len(node.args) > 2 and node.args[2] is not None:
        y = low.emit("add", [y, low.value(node.args[2])], [out])[0]
    return y


def _dims(low: Lowering, node: fx.Node, index: int) -> tuple[int, ...]:
    rank = _rank(low, node)
    dims = node.args[index] if len(node.args) > index else node.kwargs.get("dim")
    if dims is None or dims == []:
        return tuple(range(rank))
    dims = [dims] if isinstance(dims, int) else dims
    return tuple(sorted(d % max(rank, 1) for d in dims))


def reduction(kind: str) -> Row:
    def row(low: Lowering, node: fx.Node) -> Lowered:
        x = low.value(node.args[0])
        axes = _dims(low, node, 1)
        if len(low.result_types(node)) > 1:  # max.dim: (values, indices)
            return _multi(low, kind, [x], node, axes=axes)
        return _single(low, kind, [x], node, axes=axes)

    return row


def rowwise(kind: str, dim_index: int, n_tensors: int) -> Row:
    """softmax-like ops: the first ``n_tensors`` tensor args mix along ``args[dim_index]``."""

    def row(low: Lowering, node: fx.Node) -> Value:
        operands = low.tensors(node.args[:n_tensors])
        axis = node.args[dim_index] % max(operands[0].type.rank, 1)
        return _single(low, kind, operands, node, axis=axis)

    return row


def layer_norm(low: Lowering, node: fx.Node) -> list:
    x = low.value(node.args[0])
    axes = tuple(range(x.type.rank - len(node.args[1]), x.type.rank))
    operands = [x, *low.tensors(node.args[2:4])]
    return _multi(low, "layer_norm", operands, node, axis=axes)


def layer_norm_backward(low: Lowering, node: fx.Node) -> list:
    grad, x = low.value(node.args[0]), low.value(node.args[1])
    axes = tuple(range(x.type.rank - len(node.args[2]), x.type.rank))
    operands = [grad, x, *low.tensors(node.args[3:7])]
    return _multi(low, "layer_norm_backward", operands, node, axis=axes)


def rms_norm(kind: str, first_weight: int) -> Row:
    """aten._fused_rms_norm(x, shape, w, eps) and its backward(g, x, shape, rstd, w, mask)."""

    def row(low: Lowering, node: fx.Node) -> list:
        x = low.value(node.args[0])
        shape_arg = node.args[1] if kind == "rms_norm" else node.args[2]
        axes = tuple(range(x.type.rank - len(shape_arg), x.type.rank))
        operands = low.tensors([node.args[0], *node.args[first_weight:]])
        if kind != "rms_norm":
            operands = low.tensors([node.args[0], node.args[1], *node.args[3:5]])
        return _multi(low, kind, operands, node, axis=axes)

    return row


def fused_rms_norm(low: Lowering, node: fx.Node) -> list:
    """shardplan::rms_norm_fused(x, w, eps) -> (y, rstd) (``frontend/torch/norms.py``)."""
    rank = low.value(node.args[0]).type.rank
    return _multi(low, "rms_norm", low.tensors(node.args[:2]), node, axis=(rank - 1,))


def fused_rms_norm_backward(low: Lowering, node: fx.Node) -> list:
    """shardplan::rms_norm_fused_backward(g, x, rstd, w) -> (dx, dw)."""
    rank = low.value(node.args[1]).type.rank
    return _multi(low, "rms_norm_backward", low.tensors(node.args[:4]), node, axis=(rank - 1,))


def nll_loss(low: Lowering, node: fx.Node) -> list:
    x, target = low.value(node.args[0]), low.value(node.args[1])
    return _multi(
        low, "nll_loss", [x, target], node, axis=x.type.rank - 1 if x.type.rank < 2 else 1
    )


def nll_loss_backward(low: Lowering, node: fx.Node) -> Value:
    grad, x, target = (low.value(a) for a in node.args[:3])
    total = low.value(node.args[6])
    axis = 0 if x.type.rank < 2 else 1
    return _single(low, "nll_loss_backward", [grad, x, target, total], node, axis=axis)


def embedding(low: Lowering, node: fx.Node) -> Value:
    return _single(low, "embedding", [low.value(node.args[0]), low.value(node.args[1])], node)


def embedding_backward(low: Lowering, node: fx.Node) -> Value:
    return _single(
        low, "embedding_backward", [low.value(node.args[0]), low.value(node.args[1])], node
    )


def bce_with_logits(low: Lowering, node: fx.Node) -> Value:
    """``binary_cross_entropy_with_logits(x, y, weight, pos_weight, reduction)``: one op of
    elementwise terms, reduced to the loss (``ir/nn_rules.pointwise_loss``)."""
    operands = low.tensors(node.args[:4])
    reduction = node.args[4] if len(node.args) > 4 else node.kwargs.get("reduction", 1)
    return _single(low, "binary_cross_entropy_with_logits", operands, node,
                   reduction=int(reduction))  # fmt: skip


def cat(low: Lowering, node: fx.Node) -> Value:
    out = low.result_types(node)[0]
    parts = [v for v in low.tensors(node.args[0]) if v.type.rank == out.rank]
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % out.rank
    return _single(low, "concat", parts, node, dim=dim)


def stack(low: Lowering, node: fx.Node) -> Value:
    """stack = each operand with a size-1 dim inserted at ``dim``, concatenated there."""
    out = low.result_types(node)[0]
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % out.rank
    parts = []
    for v in low.tensors(node.args[0]):
        shape = (*v.type.shape[:dim], 1, *v.type.shape[dim:])
        parts.append(low.emit("reshape", [v], [TensorType(shape, v.type.dtype)])[0])
    return _single(low, "concat", parts, node, dim=dim)


def slice_(low: Lowering, node: fx.Node) -> Value:
    dim = (node.args[1] if len(node.args) > 1 else 0) % _rank(low, node)
    return _single(low, "slice", [low.value(node.args[0])], node, dim=dim)


def select(low: Lowering, node: fx.Node) -> Value:
    """x.select(dim, i) = slice keeping a size-1 dim, then reshape it away."""
    x = low.value(node.args[0])
    dim = node.args[1] % x.type.rank
    shape = list(x.type.shape)
    shape[dim] = 1
    sliced = low.emit("slice", [x], [TensorType(tuple(shape), x.type.dtype)], {"dim": dim})[0]
    return low.emit("reshape", [sliced], low.result_types(node))[0]


def split(low: Lowering, node: fx.Node) -> list:
    """split / split_with_sizes / unbind: one slice per piece (unbind reshapes too)."""
    x = low.value(node.args[0])
    dim_arg = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    if node.target.__name__.startswith("unbind"):
        dim_arg = node.args[1] if len(node.args) > 1 else 0
    dim = dim_arg % x.type.rank
    pieces = []
    for t in low.result_types(node):
        shape = list(x.type.shape)
        shape[dim] = t.shape[dim] if t.rank == x.type.rank else 1
        piece = low.emit("slice", [x], [TensorType(tuple(shape), x.type.dtype)], {"dim": dim})[0]
        pieces.append(piece if t.rank == x.type.rank else low.emit("reshape", [piece], [t])[0])
    return pieces


def slice_backward(low: Lowering, node: fx.Node) -> Value:
    return _single(low, "pad", [low.value(node.args[0])], node, dim=node.args[2])


def select_backward(low: Lowering, node: fx.Node) -> Value:
    grad = low.value(node.args[0])
    out = low.result_types(node)[0]
    dim = node.args[2] % out.rank
    shape = list(out.shape)
    shape[dim] = 1
    unsqueezed = low.emit("reshape", [grad], [TensorType(tuple(shape), out.dtype)])[0]
    return low.emit("pad", [unsqueezed], [out], {"dim": dim})[0]


def pad(low: Lowering, node: fx.Node) -> Value:
    return _single(low, "pad", [low.value(node.args[0])], node)


def gather(low: Lowering, node: fx.Node) -> Value:
    return _single(low, "gather", low.tensors(node.args), node)


def scatter(low: Lowering, node: fx.Node) -> Value:
    return _single(low, "scatter", low.tensors(node.args), node)


def index_copy(low: Lowering, node: fx.Node) -> Value:
    """aten.index_copy(buffer, dim, index, rows): a static KV cache's in-place write."""
    x, dim, index, rows = node.args[:4]
    operands = [low.value(x), low.value(index), low.value(rows)]
    return _single(low, "index_copy", operands, node, dim=int(dim))  # type: ignore[arg-type]


def moe(kind: str, n_tensors: int) -> Row:
    """shardplan::moe_* (frontend/torch/moe.py): tensor operands, then experts/capacity ints."""

    def row(low: Lowering, node: fx.Node) -> Value:
        operands = low.tensors([a for a in node.args[:n_tensors] if a is not None])
        from . import moe as dispatch

        attrs: dict = {"dedup": True} if dispatch.DISPATCHER == "deepep" else {}
        if kind == "moe_dispatch":
            attrs |= {"experts": int(node.args[3]), "capacity": int(node.args[4])}
        return _single(low, kind, operands, node, **attrs)

    return row


def topk(low: Lowering, node: fx.Node) -> list:
    """aten.topk(x, k, dim=-1): values and indices, the ``topk`` rule along ``dim``."""
    x = low.value(node.args[0])
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
    return _multi(low, "topk", [x], node, axis=dim % x.type.rank)


def cast(low: Lowering, node: fx.Node) -> Value:
    x = low.value(node.args[0])
    out = low.result_types(node)[0]
    return _single(low, "convert" if out.dtype != x.type.dtype else "copy", [x], node)


def copy_into(low: Lowering, node: fx.Node) -> Value:
    """aten.copy(dst, src): the result holds src's data, broadcast to dst's shape."""
    return _single(low, "copy", [low.value(node.args[1])], node)


VIEWS = (
    "view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "flatten", "unflatten", "view_as",
    "expand_as",
)  # fmt: skip
FACTORIES = (
    "full", "zeros", "ones", "empty", "scalar_tensor", "full_like", "zeros_like", "ones_like",
    "empty_like", "new_zeros", "new_ones", "new_full", "new_empty", "empty_strided",
    "new_empty_strided", "rand",
    "randn", "rand_like", "randn_like", "randint", "tril_indices", "triu_indices",
)  # fmt: skip


def _table() -> dict[str, Row]:
    from . import attention, conv, ops_bag, ops_nn

    table: dict[str, Row] = {}
    names = {
        # aten name: IR kind (elementwise, with numpy broadcasting)
        "add": "add", "sub": "sub", "rsub": "sub", "mul": "mul", "div": "div", "neg": "neg",
        "exp": "exp", "log": "log", "tanh": "tanh", "sigmoid": "sigmoid", "rsqrt": "rsqrt",
        "sqrt": "sqrt", "pow": "pow", "relu": "relu", "gelu": "gelu", "silu": "silu",
        "erf": "erf", "abs": "abs", "sign": "sign", "sgn": "sign", "floor": "floor", "ceil": "ceil",
        "round": "round", "reciprocal": "reciprocal", "expm1": "expm1", "log1p": "log1p",
        "sin": "sin", "cos": "cos", "clamp": "clamp", "clamp_min": "clamp",
        "clamp_max": "clamp", "maximum": "max", "minimum": "min", "where": "where",
        "masked_fill": "where", "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt",
        "ge": "ge", "logical_and": "and", "bitwise_and": "and", "logical_or": "or",
        "bitwise_or": "or", "logical_not": "not", "bitwise_not": "not", "bitwise_xor": "xor",
        "isfinite": "isfinite", "remainder": "rem", "fmod": "rem", "fill": "fill",
        "square": "square", "triu": "where", "tril": "where",
        "gelu_backward": "gelu_backward", "silu_backward": "silu_backward",
        "tanh_backward": "tanh_backward", "sigmoid_backward": "sigmoid_backward",
        "threshold_backward": "threshold_backward", "native_dropout": "dropout",
        "native_dropout_backward": "dropout", "bernoulli": "dropout",
        "clone": "copy", "detach": "copy", "alias": "copy", "lift_fresh_copy": "copy",
        "contiguous": "copy", "_to_copy": "copy", "to": "copy",
    }  # fmt: skip
    for aten_name, kind in names.items():
        table[aten_name] = elementwise(kind)
    table["native_dropout"] = lambda low, node: _multi(low, "dropout", low.tensors(node.args), node)
    table["_to_copy"] = table["to"] = cast
    table["copy"] = copy_into
    table["view_as_complex"] = table["view_as_real"] = elementwise("complex_view")
    table["_conj"] = table["conj_physical"] = elementwise("copy")  # conj: elementwise, linear
    for aten_name in VIEWS:
        table[aten_name] = reshape
    table.update(t=transpose, transpose=transpose, permute=permute, expand=expand, repeat=repeat)
    table.update(mm=matmul, bmm=matmul, matmul=matmul, mv=matmul, dot=matmul)
    table.update(addmm=matmul_add, baddbmm=matmul_add, linear=linear)
    table.update(sum=reduction("reduce_sum"), mean=reduction("mean"), amax=reduction("reduce_max"))
    table.update(amin=reduction("reduce_min"), max=reduction("reduce_max"))
    table.update(min=reduction("reduce_min"), any=reduction("reduce_max"))
    table.update(all=reduction("reduce_min"), argmax=reduction("argmax"))
    table.update(argmin=reduction("argmin"), prod=reduction("reduce_max"))
    table["_softmax"] = table["_safe_softmax"] = rowwise("softmax", 1, 1)
    table["_log_softmax"] = rowwise("log_softmax", 1, 1)
    table["_softmax_backward_data"] = rowwise("softmax_backward", 2, 2)
    table["_log_softmax_backward_data"] = rowwise("log_softmax_backward", 2, 2)
    table["cumsum"] = rowwise("cumsum", 1, 1)
    table.update(native_layer_norm=layer_norm, native_layer_norm_backward=layer_norm_backward)
    table["_fused_rms_norm"] = rms_norm("rms_norm", 2)
    table["_fused_rms_norm_backward"] = rms_norm("rms_norm_backward", 3)
    table.update(rms_norm_fused=fused_rms_norm, rms_norm_fused_backward=fused_rms_norm_backward)
    table.update(nll_loss_forward=nll_loss, nll_loss_backward=nll_loss_backward)
    table.update(nll_loss2d_forward=nll_loss, nll_loss2d_backward=nll_loss_backward)  # (N, C, H, W)
    table.update(embedding=embedding, embedding_dense_backward=embedding_backward)
    table.update(cat=cat, stack=stack, slice=slice_, select=select, slice_backward=slice_backward)
    table.update(select_backward=select_backward, constant_pad_nd=pad)
    table.update(split=split, split_with_sizes=split, unbind=split)
    table.update(index=gather, index_select=gather, gather=gather, index_copy=index_copy)
    table.update(index_put=scatter, index_add=scatter, scatter=scatter, scatter_add=scatter)
    table.update(moe_dispatch=moe("moe_dispatch", 3), moe_combine=moe("moe_combine", 3))
    table.update(moe_combine_wgrad=moe("moe_combine_wgrad", 3), topk=topk)
    for aten_name in FACTORIES:
        table[aten_name] = constant()
    table["arange"] = constant("iota")
    for aten_name in attention.FORWARD:
        table[aten_name] = attention.forward
    for aten_name in attention.BACKWARD:
        table[aten_name] = attention.backward
    table.update(conv.TABLE)
    table.update(ops_bag.TABLE)
    table["binary_cross_entropy_with_logits"] = bce_with_logits
    table.update(ops_nn.table())
    return table


TABLE: dict[str, Row] = _table()
