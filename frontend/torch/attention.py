"""Lowering of the fused scaled-dot-product-attention kernels (CPU and GPU variants).

All variants become the IR's ``attention`` / ``attention_backward`` (q[b,h,s,d] layout). Their
aten signatures differ only in where ``out``, ``logsumexp`` and the mask/bias sit, so a small
table of argument positions per kernel drives one lowering each way. Bookkeeping outputs (RNG
seeds and offsets, cumulative sequence lengths, debug masks) become constants.
"""

from __future__ import annotations

from torch import fx

from ...ir import TensorType, Value
from .lower import Lowered, Lowering

# kernel -> (position of attn_mask/attn_bias or None, keyword name of the mask or None)
FORWARD: dict[str, tuple[int | None, str | None]] = {
    "_scaled_dot_product_flash_attention_for_cpu": (None, "attn_mask"),
    "_scaled_dot_product_flash_attention": (None, None),
    "_scaled_dot_product_efficient_attention": (3, None),
    "_scaled_dot_product_cudnn_attention": (3, None),
    "_scaled_dot_product_fused_attention_overrideable": (3, None),
}
# kernel -> (position of out, position of logsumexp)
BACKWARD: dict[str, tuple[int, int]] = {
    "_scaled_dot_product_flash_attention_for_cpu_backward": (4, 5),
    "_scaled_dot_product_flash_attention_backward": (4, 5),
    "_scaled_dot_product_efficient_attention_backward": (5, 6),
    "_scaled_dot_product_cudnn_attention_backward": (4, 5),
    "_scaled_dot_product_fused_attention_overrideable_backward": (6, 7),
}


def _name(node: fx.Node) -> str:
    return node.target._overloadpacket.__name__  # type: ignore[union-attr]


def _full_mask(low: Lowering, mask: Value, shape: tuple[int, ...]) -> Value:
    """Broadcast a [s,t] / [b,1,s,t] mask to [b,h,s,t] so every factor maps one-to-one."""
    if mask.type.shape == shape:
        return mask
    dims = tuple(range(4 - mask.type.rank, 4))
    full = TensorType(shape, mask.type.dtype)
    return low.emit("broadcast_in_dim", [mask], [full], {"dims": dims})[0]


def _extras(low: Lowering, node: fx.Node, used: int) -> list[Value | None]:
    """Constants for the bookkeeping tensor outputs after the first ``used`` ones."""
    extras: list[Value | None] = []
    for v in list(node.meta["val"])[used:]:
        if hasattr(v, "shape"):
            extras.append(low.emit("constant", [], low.result_types_of(v))[0])
        else:
            extras.append(None)
    return extras


def _causal(node: fx.Node) -> dict[str, bool]:
    """``{"causal": True}`` when the kernel applies the causal mask itself (``is_causal``)."""
    names = [a.name for a in node.target._schema.arguments]  # type: ignore[union-attr]
    position = names.index("is_causal") if "is_causal" in names else None
    value = node.kwargs.get("is_causal", False)
    if position is not None and len(node.args) > position:
        value = node.args[position]
    return {"causal": True} if value is True else {}


def _safe(q: Value, k: Value) -> bool:
    """Query heads that are not a multiple of key/value heads fit no factor rule."""
    return q.type.shape[1] % k.type.shape[1] != 0


def forward(low: Lowering, node: fx.Node) -> Lowered:
    mask_pos, mask_kw = FORWARD[_name(node)]
    q, k, v = (low.value(a) for a in node.args[:3])
    b, h, s, _ = q.type.shape
    operands = [q, k, v]
    mask_arg = node.kwargs.get(mask_kw) if mask_kw else None
    if mask_pos is not None and len(node.args) > mask_pos:
        mask_arg = node.args[mask_pos]
    if isinstance(mask_arg, fx.Node):
        operands.append(_full_mask(low, low.value(mask_arg), (b, h, s, k.type.shape[2])))
    vals = list(node.meta["val"])
    types = [low.result_types_of(vals[0])[0]]
    if len(vals) > 1 and hasattr(vals[1], "shape") and tuple(vals[1].shape) == (b, h, s):
        types.append(low.result_types_of(vals[1])[0])
    results: list[Value | None] = list(
        low.emit("attention", operands, types, _causal(node), safe=_safe(q, k))
    )
    if len(types) == 1 and len(vals) > 1:
        results.append(low.emit("constant", [], low.result_types_of(vals[1]))[0])
    return results + _extras(low, node, len(results))


def backward(low: Lowering, node: fx.Node) -> Lowered:
    out_pos, lse_pos = BACKWARD[_name(node)]
    grad, q, k, v = (low.value(a) for a in node.args[:4])
    out = low.value(node.args[out_pos])
    operands = [grad, q, k, v, out]
    lse = low.env.get(node.args[lse_pos])
    b, h, s, _ = q.type.shape
    if isinstance(lse, Value) and lse.type.shape == (b, h, s):
        operands.append(lse)
    vals = list(node.meta["val"])
    types = [low.result_types_of(t)[0] for t in vals[:3]]
    results = list(low.emit("attention_backward", operands, types, _causal(node), safe=_safe(q, k)))
    return results + _extras(low, node, 3)
