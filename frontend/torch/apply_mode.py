"""How ``apply`` runs torch calls on DTensors: its torch-function mode (``_ApplyMode``) and
the calls it routes to local shards (attention, batched matmuls, folded ``linear``, lookups,
views, in-place adds into pending sums), plus ``redistribute`` to a planned layout.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.overrides import TorchFunctionMode

from . import bags, fallback, follow, local, lookup, nn_local, reshard, views
from .plan_layouts import Placements


def redistribute(x: Any, placements: Placements) -> Any:
    """Move a DTensor to ``placements`` when DTensor can: S->P and R->P are not layout changes
    it makes (the logical tensor is the same), so such a dim keeps its layout."""
    if not isinstance(x, DTensor) or tuple(x.placements) == placements:
        return x
    fixed = tuple(_reachable(old, new) for old, new in zip(x.placements, placements, strict=True))
    if tuple(x.placements) == fixed:
        return x
    with follow.paused():  # the reshard's local ops are not calls of the traced step
        return reshard.reshard(x, fixed)[0]  # the plan's collectives


def _reachable(old: Placement, new: Placement) -> Placement:
    """The placement a mesh dim can move to for ``new``: a pending sum stays one where it is one
    already; a dim that is not pending keeps its layout (no R/S -> P); a pending sum of
    another kind - the ``_MaskPartial`` of a vocabulary-split lookup, which DTensor may only
    reduce (HF OPT Megatron on (2, 4): "Can not redistribute from MaskP(sum, ...) to P(sum)")
    - is reduced to whole."""
    if not isinstance(new, Partial):
        return new
    if not isinstance(old, Partial):
        return old
    return new if type(old) is type(new) and old == new else Replicate()


class _ApplyMode(TorchFunctionMode):
    """Torch functions run as the plan means them when DTensors take part.

    ``torch.cat`` skips 1-D empty operands, as eager ``cat`` does: eager ``cat`` ignores a
    legacy ``torch.tensor([])`` whatever the other operands' rank; DTensor's rule instead
    redistributes it, as a replicated operand, to the others' layout and fails when they are
    split on a dimension it lacks. Hugging Face's ``DynamicCache`` starts every layer from such
    a tensor and concatenates the new keys and values onto it.

    Views and reshapes of split dims are local reshapes (``views.py``): DTensor's view rule
    refuses most of them (``[b, s, (kv d)]`` split over two axes -> ``[b, s, kv, d]``).
    Attention and batched matmuls run on local shards (``local.py``): DTensor folds their
    batch and head dims into a ``_StridedShard``.
    Under ``follow_plan`` the follower runs every aten call at its planned layouts, so only
    the ``cat`` rule applies then."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in _CATS and args and any(isinstance(t, DTensor) for t in args[0]):
            args = (follow.without_legacy_empty(args[0]), *args[1:])
        elif follow.following():
            pass  # the follower runs each aten call at its planned layouts
        elif func in _VIEWS and args and isinstance(args[0], DTensor):
            out = _view(func, args, kwargs)
            if out is not None:
                return out
        elif func is F.embedding and len(args) > 1 and isinstance(args[1], DTensor):
            return embedding(*args, **kwargs)
        elif func is F.embedding_bag and len(args) > 1 and isinstance(args[1], DTensor):
            out = bags.embedding_bag(*args, **kwargs)
            return _call(func, args, kwargs) if out is NotImplemented else out
        elif (out := _local_call(func, args, kwargs)) is not None:
            return out
        elif func is F.linear and args and isinstance(args[0], DTensor) and args[0].ndim > 2:
            return linear(*args, **kwargs)
        elif func in _IN_PLACE_ADDS and len(args) > 1 and isinstance(args[0], DTensor):
            args = (args[0], pending_like(args[0], args[1]), *args[2:])
        return _call(func, args, kwargs)


def _call(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func``, or - when DTensor has no strategy for one of its aten ops - ``func`` on whole
    tensors (``fallback.run_whole``; outside the follower's replay: it computes no planned
    layout)."""
    try:
        return func(*args, **kwargs)
    except NotImplementedError as error:
        if not fallback.is_unsupported(error):
            raise
    with follow.paused():
        return fallback.run_whole(func, args, kwargs, follow.paused)


_CATS = frozenset({torch.cat, torch.concat, torch.concatenate})


_VIEWS = frozenset({
    torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.flatten, torch.flatten,
    torch.Tensor.unflatten, torch.unflatten, torch.Tensor.view_as, torch.Tensor.reshape_as,
})  # fmt: skip


_IN_PLACE_ADDS = frozenset({torch.Tensor.add_, torch.Tensor.sub_})


_MATMULS = frozenset({
    torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm,
})  # fmt: skip


def _local_call(func: Any, args: tuple, kwargs: dict) -> Any:
    """Attention, batched matmuls, norms, activations and recurrent layers on local shards;
    None: not such a call (DTensor runs it)."""
    out = None
    if func is F.scaled_dot_product_attention:
        out = local_attention(func, args, kwargs)
    elif func in _MATMULS and not kwargs:
        out = local_matmul(func, args)
    elif (local_nn := nn_local.intercept(func, args, kwargs)) is not NotImplemented:
        out = local_nn
    return out


def embedding(ids: Any, table: DTensor, *args: Any, **kwargs: Any) -> Any:
    """A lookup into a DTensor table: the project's (``lookup.py``) where the rows are split
    and the call is a plain lookup; otherwise DTensor's, one vocabulary split at most."""
    out = lookup.embedding(ids, table, *args, **kwargs)
    if out is not None:
        return out
    table = one_vocab_split(table)
    return F.embedding(ids_for_lookup(ids, table), table, *args, **kwargs)


def local_attention(func: Any, args: tuple, kwargs: dict) -> DTensor | None:
    """Attention on local shards (``local.attention``), operands moved by the plan's reshard."""
    return local.attention(func, args, kwargs, redistribute)


def local_matmul(func: Any, args: tuple) -> DTensor | None:
    """A batched matmul on local shards (``local.matmul``)."""
    return local.matmul(func, args, redistribute)


def one_leading_split(x: DTensor) -> DTensor:
    """``x`` split, among its leading dims (all but the last), on the first one at most.

    ``linear`` and its backward fold the leading dims into one around their matmuls; a split
    of a later leading dim (sequence over ``tp``, alone or under a batch split) becomes a
    ``_StridedShard`` there, which a view cannot unfold and a redistribution over a flattened
    mesh refuses. Such splits are gathered first (the IR's reshape rule never folds them
    either; only ``apply``'s DTensor-chosen inner layouts meet them)."""
    if not any(isinstance(p, Shard) and 0 < p.dim < x.ndim - 1 for p in x.placements):
        return x
    placements = tuple(
        Replicate() if isinstance(p, Shard) and 0 < p.dim < x.ndim - 1 else p for p in x.placements
    )
    with follow.paused():
        return x.redistribute(placements=placements)


class _FoldedLinear(torch.autograd.Function):
    """``linear`` whose input and output gradient are split on the first leading dim at most
    (``one_leading_split``), in forward and in backward."""

    @staticmethod
    def forward(ctx: Any, x: DTensor, weight: Any, bias: Any) -> Any:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grad = locally_contiguous(one_leading_split(grad)) if isinstance(grad, DTensor) else grad
        grad_x = grad @ weight
        flat = grad.reshape(-1, grad.shape[-1])
        grad_w = flat.t() @ x.reshape(-1, x.shape[-1])
        grad_b = flat.sum(0) if ctx.bias else None
        return grad_x, grad_w, grad_b


def locally_contiguous(x: DTensor) -> DTensor:
    """``x`` with a contiguous local shard. A gradient can arrive as a transposed shard whose
    DTensor still reports global contiguous strides, so ``contiguous()`` leaves it as it is
    and DTensor's matmul then views the shard ("view size is not compatible with input
    tensor's size and stride"; HF OPT free on (2, 4))."""
    shard = x.to_local()
    if shard.is_contiguous():
        return x
    return DTensor.from_local(shard.contiguous(), x.device_mesh, x.placements, run_check=False,
                              shape=x.shape, stride=x.stride())  # fmt: skip


def linear(x: DTensor, weight: Any, bias: Any = None) -> Any:
    return _FoldedLinear.apply(locally_contiguous(one_leading_split(x)), weight, bias)


def pending_like(target: DTensor, other: Any) -> Any:
    """``other`` made a pending sum on the mesh dims where ``target`` is one, for an in-place
    add into ``target``: DTensor keeps an in-place op's placements and cannot make a shard
    pending itself (HF Falcon's ``mlp_output += attention_output``). The split is gathered,
    and each of the ``n`` ranks of the pending dims holds ``1/n`` of it (their sum is it; so
    its gradient is pending over those dims too: each rank's ``1/n`` share adds up)."""
    if not isinstance(other, DTensor):
        return other
    pending = [
        isinstance(t, Partial) and not isinstance(o, Partial)
        for t, o in zip(target.placements, other.placements, strict=True)
    ]
    if not any(pending):
        return other
    whole = tuple(
        Replicate() if want else p for want, p in zip(pending, other.placements, strict=True)
    )
    with follow.paused():
        gathered = other.redistribute(placements=whole)
    n = math.prod(other.device_mesh.size(i) for i, want in enumerate(pending) if want)
    placements = tuple(Partial() if want else p for want, p in zip(pending, whole, strict=True))
    return DTensor.from_local(
        gathered.to_local(grad_placements=placements) / n, other.device_mesh, placements,
        run_check=False,
        shape=other.shape, stride=other.stride(),
    )  # fmt: skip


def one_vocab_split(weight: DTensor) -> DTensor:
    """An embedding table split over at most one mesh dim along its rows (vocabulary).

    DTensor looks rows up in a vocabulary-split table with one ``MaskPartial`` per mesh dim,
    all sharing the op's one mask buffer: a table whose rows are split over two mesh dims
    (FSDP over ``dp`` and ``tp``) fails with "MaskBuffer has been materialized with conflicting
    data". The minor splits are gathered first (in mesh order the major one stays)."""
    rows = [i for i, p in enumerate(weight.placements) if isinstance(p, Shard) and p.dim == 0]
    if len(rows) < 2:
        return weight
    placements = tuple(Replicate() if i in rows[1:] else p for i, p in enumerate(weight.placements))
    with follow.paused():
        return weight.redistribute(placements=placements)


def ids_for_lookup(ids: Any, table: DTensor) -> Any:
    """The ids whole on every mesh dim that splits a vocabulary-split table's columns.

    DTensor's lookup in a table split along rows on one mesh dim and along its hidden dim on
    others gathers the ids over the hidden-split dims, but its redistribution masks the ids
    for the vocabulary split before it gathers them: the mask keeps the ids' local shape and
    the reduction fails ("The shape of the mask [2, 8] at index 0 does not match the shape of
    the indexed tensor [8, 8, 16]"; Gemma TP x FSDP on (2, 2, 2)). Gathering the ids first
    (what that lookup needs anyway; they are far smaller than the table) leaves DTensor only
    the local masking. The dims that split rows are left to DTensor: it may gather the table
    there and keep the ids split (FSDP), where whole ids would leave a ``MaskPartial`` output
    that no later redistribution may turn into a plain ``Partial``."""
    rows = any(isinstance(p, Shard) and p.dim == 0 for p in table.placements)
    if not rows or not isinstance(ids, DTensor):
        return ids
    placements = tuple(
        Replicate() if isinstance(t, Shard) and t.dim == 1 else p
        for p, t in zip(ids.placements, table.placements, strict=True)
    )
    if placements == tuple(ids.placements):
        return ids
    with follow.paused():
        return ids.redistribute(placements=placements)


def _view(func: Any, args: tuple, kwargs: dict) -> Any:
    """A view of a split DTensor as a local reshape, or None to let DTensor do it."""
    x = args[0]
    if func in (torch.Tensor.view_as, torch.Tensor.reshape_as):
        shape = tuple(args[1].shape)
    else:
        try:  # the result shape, whatever the spelling (-1, flatten's dims, a dtype)
            meta = func(torch.empty(x.shape, device="meta"), *args[1:], **kwargs)
        except (RuntimeError, TypeError):
            return None
        if not isinstance(meta, torch.Tensor) or meta.dtype != torch.float32:
            return None
        shape = tuple(meta.shape)
    return views.local_view(x, shape)
