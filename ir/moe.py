"""Sharding rules of the mixture-of-experts ops (GShard-style capacity dispatch).

Tokens come in ``G`` groups of ``S`` tokens; each token picks ``K`` of ``E`` experts (router
top-k) and lands in one of ``C`` capacity slots of each expert it picked (slots fill in token
order; a token past an expert's capacity is dropped, GShard's semantics). The letters:

  ``g`` token group, ``s`` token in its group, ``k`` choice (top-k), ``h`` hidden,
  ``e`` expert, ``c`` capacity slot.

* ``moe_dispatch(x[g,s,h], idx[g,s,k] (, w[g,s,k])) -> xe[e,g,c,h]``: slot positions are a
  running count over all of a group's (token, choice) pairs, so ``s``, ``k`` and ``c`` need
  replication; the kernel addresses experts by their global index, so ``e`` does too (a device
  cannot fill only its own experts' slots). With ``w`` the slots are weighted (the backward of
  combine). Groups ``g`` and hidden ``h`` split freely.
* ``moe_combine(y[e,g,c,h], idx, w) -> out[g,s,h]``: the weighted sum of each token's slots;
  ``g`` and ``h`` split, the rest need replication for the same reasons.
* ``moe_combine_wgrad(gout[g,s,h], y[e,g,c,h], idx) -> gw[g,s,k]``: the gradient of the
  combine weights, a dot over ``h`` (a reduction: split ``h`` gives a partial sum).

These are the layouts the torch kernels run at (``frontend/torch/moe.py`` registers the same
ones with DTensor), so a plan never asks for one the emitted step cannot compute.

Expert parallelism is then ordinary factor algebra: the expert matmuls are batched over ``e``
(``[e, g*c, h] @ [e, h, f]``), so splitting ``e`` over an axis that also splits ``g`` on the
dispatch output turns the reshard ``xe[e, g{ep}, c, h] -> xe[e{ep}, g, c, h]`` into one
all-to-all (and back for the combine). Attributes: ``experts``, ``capacity``,
``capacity_factor`` (None: dropless, every token fits), ``top_k``; ``dedup`` (all three ops):
the run's dispatcher sends a token to each rank once, however many of its experts live there
(DeepEP's dispatch/combine), so that all-to-all moves fewer bytes than the slot buffer holds
(``wire_type``; the emitted GShard dispatch still moves the whole buffer).
"""

from __future__ import annotations

import math

from .graph import Graph, Value
from .mesh import Mesh
from .registry import register_rule
from .rule_helpers import Attrs, Types
from .rules import ShardingRule
from .sharding import Sharding
from .types import TensorType


def distinct_ranks(experts: int, top_k: int, ranks: int) -> float:
    """Expected ranks a token's ``top_k`` distinct experts land on, ``experts`` split evenly
    over ``ranks`` and routed uniformly: ``ranks * (1 - C(E - E/n, k) / C(E, k))`` (a rank is
    missed when all ``k`` picks fall among the other ranks' experts)."""
    if ranks <= 1 or experts % ranks:
        return float(min(top_k, max(ranks, 1)))
    miss = math.comb(experts - experts // ranks, top_k) / math.comb(experts, top_k)
    return ranks * (1.0 - miss)


_SLOTS = {"moe_combine": (0, 1), "moe_combine_wgrad": (1, 2)}
"""Per op reading a dispatch buffer: (the buffer's operand, the top-k indices' operand)."""

Buffer = tuple[int, int, int, int]
"""A dispatch buffer's ``(experts, top_k, dim, capacity)``: ``dim`` is the one holding the
capacity slots (2 of ``[e, g, c, h]``; 1 of the expert matmul's view ``[e, g * c, h]``)."""


def dedup_buffers(graph: Graph) -> dict[Value, Buffer]:
    """Each deduplicated dispatch buffer of ``graph``: the ``[e, g, c, h]`` result of a
    ``moe_dispatch``, or the slots a ``moe_combine`` (or its weight gradient) reads, where the
    op has ``dedup`` set, and the views of either the expert matmuls read or write (reshapes
    to ``[e, g * c, h]`` and transposes of those: an all-to-all may sit on any of them)."""
    found: dict[Value, Buffer] = {}
    for op in graph.ops:
        if not op.attrs.get("dedup"):
            continue
        if op.kind == "moe_dispatch":
            root, idx = op.results[0], op.operands[1]
        elif op.kind in _SLOTS:
            root, idx = (op.operands[n] for n in _SLOTS[op.kind])
        else:
            continue
        experts, _, capacity, _ = root.type.shape
        top_k = idx.type.shape[2]
        found[root] = (experts, top_k, 2, capacity)
        views = [u.op.results[0] for u in root.uses if u.op.kind == "reshape"]
        if root.producer is not None and root.producer.kind == "reshape":
            views.append(root.producer.operands[0])
        for view in views:
            shape = view.type.shape
            if view.type.rank != 3 or shape[0] != experts or shape[1] % capacity:
                continue
            found[view] = (experts, top_k, 1, capacity)
            for t in _transposes(view):  # [e, g * c, h] <-> [e, h, g * c]
                found[t] = (experts, top_k, t.type.shape.index(shape[1], 1), capacity)
    return found


def _transposes(view: Value) -> list[Value]:
    """The expert-dim-keeping transposes of ``view``, read from it or written into it."""
    out = [u.op.results[0] for u in view.uses if u.op.kind == "transpose"]
    if view.producer is not None and view.producer.kind == "transpose":
        out.append(view.producer.operands[0])
    return [t for t in out if t.type.shape[0] == view.type.shape[0]]


def wire_type(
    type_: TensorType, buffer: Buffer | None, src: Sharding, dst: Sharding, mesh: Mesh
) -> TensorType:
    """The type whose bytes a reshard of a dispatch buffer moves. Between an expert split and
    a token split (the dispatch or combine all-to-all over ``n`` ranks) a deduplicating
    dispatcher sends each token once per rank: ``distinct_ranks / top_k`` of the slots, so the
    slots' dim shrinks by that ratio (to a size its splits still divide). Any other reshard
    (or no ``buffer``) moves ``type_``."""
    if buffer is None:
        return type_
    experts, top_k, dim, _ = buffer
    ranks = (mesh.group_size(src.dims[0]), mesh.group_size(dst.dims[0]))
    if ranks[0] == ranks[1] or (dim == 2 and (src.dims[2] or dst.dims[2])):
        return type_
    ratio = distinct_ranks(experts, top_k, max(ranks)) / top_k
    step = math.lcm(mesh.group_size(src.dims[dim]), mesh.group_size(dst.dims[dim]))
    shape = list(type_.shape)
    shape[dim] = max(1, round(shape[dim] * ratio / step)) * step
    return TensorType(tuple(shape), type_.dtype)


def dispatch(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    operands = "gsh,gsk" + (",gsk" if len(ins) > 2 else "")
    shapes = [t.shape for t in ins]
    return ShardingRule.from_spec(f"{operands}->egch", shapes, [outs[0].shape], "skce")


def combine(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    return ShardingRule.from_spec(
        "egch,gsk,gsk->gsh", [t.shape for t in ins], [outs[0].shape], "ecks"
    )


def combine_wgrad(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    return ShardingRule.from_spec(
        "gsh,egch,gsk->gsk", [t.shape for t in ins], [outs[0].shape], "ecks"
    )


register_rule("moe_dispatch", dispatch, flops="none")
register_rule("moe_combine", combine)
register_rule("moe_combine_wgrad", combine_wgrad)
