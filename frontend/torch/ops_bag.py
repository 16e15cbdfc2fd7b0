"""Lowerings of ``nn.EmbeddingBag``'s aten ops to the IR (rules in ``ir/embedding_bag.py``).

``aten._embedding_bag(weight, indices, offsets, scale_grad_by_freq, mode, sparse,
per_sample_weights, include_last_offset, padding_idx)`` (``_embedding_bag_forward_only``
without autograd) becomes one ``embedding_bag``; its bookkeeping results (``offset2bag``,
``bag_size``, ``max_indices`` outside max mode) are no IR values. The backward
``aten._embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, max_indices,
num_weights, scale_grad_by_freq, mode, sparse, per_sample_weights, padding_idx)`` becomes
``embedding_bag_backward``, and ``_embedding_bag_per_sample_weights_backward(grad, weight,
indices, offsets, offset2bag, mode, padding_idx)`` becomes ``embedding_bag_psw_backward``.

A 2-D input of fixed-length bags reaches the op flattened, with the offsets of an
``arange(0, B * L, L)``: the op then records ``fixed_bag = L``, so the bags can split with
their ids. ``pooling`` is the example's average ids per bag (``N / B``);
``capture(..., pooling={"emb.0": 20})`` (and ``sp.plan``) overrides it per table module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import fx

from ...ir import FrontendError, Graph, Value
from ...ir.embedding_bag import MODES
from .lower import Lowered, Lowering

Row = Callable[[Lowering, fx.Node], Lowered]
BAG_KINDS = ("embedding_bag", "embedding_bag_backward", "embedding_bag_psw_backward")


def _arg(node: fx.Node, index: int, name: str, default: Any) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _fixed_bag(offsets: fx.Node, ids: Value) -> int | None:
    """``L`` when the offsets are torch's ``arange(0, B * L, L)`` of a 2-D input, else None."""
    target = str(getattr(offsets, "target", ""))
    if not target.startswith("aten.arange.start_step") or len(offsets.args) < 3:
        return None
    start, end, step = offsets.args[:3]
    n = ids.type.shape[0] if ids.type.rank == 1 else -1
    if start == 0 and end == n and isinstance(step, int) and step > 0 and n % step == 0:
        return step
    return None


def _attrs(low: Lowering, node: fx.Node, ids: Value, offsets: Value, fields: dict) -> dict:
    """The op's attributes (``ir/embedding_bag.py``) from the call's arguments."""
    mode = int(fields["mode"])
    last = bool(fields.get("include_last_offset", False))
    bags = offsets.type.shape[0] - int(last) if offsets.type.rank else 0
    padding = fields.get("padding_idx", -1)
    fixed = _fixed_bag(node.args[2], ids) if isinstance(node.args[2], fx.Node) else None
    if fields.get("scale_grad_by_freq"):
        fixed = None  # each id's count in the whole batch: the ids are read whole
    if ids.type.rank != 1:
        raise FrontendError(
            f"embedding_bag at {low.origin()}: indices of shape {ids.type.shape} reached the aten "
            "op; torch passes them flattened (1-D). hint: call nn.EmbeddingBag / "
            "F.embedding_bag, which flatten a 2-D input"
        )
    attrs = {
        "mode": MODES[mode], "rows": int(fields["rows"]), "dim": int(fields["dim"]),
        "bags": int(bags), "pooling": ids.type.shape[0] / max(bags, 1),
        "fixed_bag": fixed, "include_last_offset": last,
        "padding_idx": None if padding is None or int(padding) < 0 else int(padding),
        "per_sample_weights": fields.get("psw") is not None,
        "scale_grad_by_freq": bool(fields.get("scale_grad_by_freq", False)),
    }  # fmt: skip
    return {k: v for k, v in attrs.items() if v is not None}  # the IR text has no None


def forward(low: Lowering, node: fx.Node) -> list:
    """``_embedding_bag``: the pooled rows (and, in max mode, their ids)."""
    weight, ids, offsets = (low.value(a) for a in node.args[:3])
    psw = _arg(node, 6, "per_sample_weights", None)
    fields = {
        "mode": _arg(node, 4, "mode", 0), "rows": weight.type.shape[0],
        "dim": weight.type.shape[1], "psw": psw,
        "include_last_offset": _arg(node, 7, "include_last_offset", False),
        "padding_idx": _arg(node, 8, "padding_idx", -1),
        "scale_grad_by_freq": _arg(node, 3, "scale_grad_by_freq", False),
    }  # fmt: skip
    attrs = _attrs(low, node, ids, offsets, fields)
    operands = [weight, ids, offsets] + ([low.value(psw)] if psw is not None else [])
    types = low.result_types(node)
    keep = [0, 3] if attrs["mode"] == "max" else [0]
    results = iter(low.emit("embedding_bag", operands, [types[k] for k in keep], attrs))
    return [next(results) if k in keep else None for k in range(len(node.meta["val"]))]


def backward(low: Lowering, node: fx.Node) -> Value:
    """``_embedding_bag_backward`` (and its ``_dense_`` form): the table's gradient."""
    grad, ids, offsets = (low.value(a) for a in node.args[:3])
    mode = _arg(node, 8, "mode", 0)
    psw = _arg(node, 10, "per_sample_weights", None)
    out = low.result_types(node)[0]
    fields = {
        "mode": mode, "rows": out.shape[0], "dim": out.shape[1], "psw": psw,
        "padding_idx": _arg(node, 11, "padding_idx", -1),
        "scale_grad_by_freq": _arg(node, 7, "scale_grad_by_freq", False),
    }  # fmt: skip
    attrs = _attrs(low, node, ids, offsets, fields)
    attrs["include_last_offset"] = offsets.type.shape[0] == grad.type.shape[0] + 1
    attrs["bags"] = grad.type.shape[0]
    attrs["pooling"] = ids.type.shape[0] / max(grad.type.shape[0], 1)
    operands = [grad, ids, offsets]
    if attrs["mode"] == "max":
        operands.append(low.value(node.args[5]))
    if psw is not None:
        operands.append(low.value(psw))
    return low.emit("embedding_bag_backward", operands, [out], attrs)[0]


def psw_backward(low: Lowering, node: fx.Node) -> Value:
    """``_embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets,
    offset2bag, mode, padding_idx)``: the weights' gradient."""
    grad, weight, ids, offsets = (low.value(a) for a in node.args[:4])
    fields = {
        "mode": _arg(node, 5, "mode", 0), "rows": weight.type.shape[0],
        "dim": weight.type.shape[1], "psw": True,
        "padding_idx": _arg(node, 6, "padding_idx", -1),
    }  # fmt: skip
    attrs = _attrs(low, node, ids, offsets, fields)
    attrs["include_last_offset"] = offsets.type.shape[0] == grad.type.shape[0] + 1
    attrs["bags"] = grad.type.shape[0]
    out = low.result_types(node)[0]
    return low.emit("embedding_bag_psw_backward", [grad, weight, ids, offsets], [out], attrs)[0]


TABLE: dict[str, Row] = {
    "_embedding_bag": forward,
    "_embedding_bag_forward_only": forward,
    "_embedding_bag_backward": backward,
    "_embedding_bag_dense_backward": backward,
    "_embedding_bag_per_sample_weights_backward": psw_backward,
}


def set_pooling(graph: Graph, pooling: Mapping[str, float] | None) -> None:
    """Give the bag lookups of each table module its pooling factor (average ids per bag)."""
    if not pooling:
        return
    tables = {op.origin.module for op in graph.ops if op.kind in BAG_KINDS}
    for module, factor in pooling.items():
        if module not in tables:
            raise FrontendError(
                f"pooling={{{module!r}: ...}}: no embedding bag lookup in module {module!r}; "
                f"the graph's bag tables are {sorted(tables) or 'none'}"
            )
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
            raise FrontendError(
                f"pooling[{module!r}] = {factor!r}: give the average ids per bag, a positive number"
            )
    for op in graph.ops:
        if op.kind in BAG_KINDS and op.origin.module in pooling:
            op.attrs["pooling"] = float(pooling[op.origin.module])
