"""Calls the follower runs itself instead of through DTensor's dispatch: ``addmm`` as a matmul
then an add, fused CPU attention on local shards, in-place calls and in-place views run out of
place at their planned layouts, fills and uninitialised tensors made at theirs, split views as
local reshapes, and data inputs in the balanced token order of a causal query split."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils.weak import WeakIdKeyDictionary

from . import (
    context_parallel,
    follow,
    ops_nn,
    view_writes,
    views,
)  # modules: follow imports this one too
from .capture import AtenStep, leaves

if TYPE_CHECKING:
    from .follow import PlanFollower

MATMUL_ADD = {"aten.addmm.default": torch.ops.aten.mm, "aten.baddbmm.default": torch.ops.aten.bmm}
COPY = "aten.copy_.default"


def balanced(follower: PlanFollower, t: torch.Tensor, name: str | None) -> torch.Tensor:
    """A data input in the balanced token order (reordered once per run-time tensor); also
    when the trace reads it through identity calls (GPT-2 views its ``input_ids``)."""
    name = follower.same.get(name or "", name or "")
    index = follower.sequence_inputs.get(name)
    if index is None or t.dim() < 2:
        return t
    done = follower.reordered.setdefault(name, WeakIdKeyDictionary())
    if t not in done:
        done[t] = context_parallel.reorder(t, index)
    return done[t]


def positions(follower: PlanFollower, out: torch.Tensor) -> torch.Tensor:
    """The sequence positions in the balanced token order (``arange`` of that length)."""
    order = follower.order or []
    if out.dim() != 1 or out.shape[0] != len(order) or out.is_floating_point():
        return out
    return out.index_select(0, torch.tensor(order, device=out.device))


def run_out_of_place(
    follower: PlanFollower, step: AtenStep, func: Any, call: tuple, tensors: list, moved: list
) -> torch.Tensor:
    """An in-place call run out of place at the planned layouts; the target takes the
    result (``relayout``)."""
    target = follower._through_identities(tensors[0], step.operands[0] or "", step)
    moved[0] = follower._to(target, follower._want(step, 0), step)
    args, kwargs = follow._replace(call, iter(moved))
    if step.target == COPY:  # no DTensor rule for the functional copy
        out = follower._results(step, torch.ops.aten.clone.default(moved[1]))
    else:
        out = follower._results(step, _out_of_place(func)(*args, **kwargs))
    view_writes.assign(tensors[0], out)
    return tensors[0]


def in_place_view(
    follower: PlanFollower, step: AtenStep, func: Any, args: tuple, kwargs: dict
) -> DTensor:
    """An in-place view (``nn.GRU``'s ``output.transpose_(0, 1)`` with ``batch_first``)
    of a DTensor, which DTensor has no strategy for: the target is moved to its planned
    operand layout, the view is computed out of place by DTensor at the planned result
    layout, and the target takes it (``_assign_view``: its shape changes with it). A restride
    that keeps every element in place (``restrides_only``) computes nothing."""
    target = args[0]
    want = follower._want(step, 0)
    if not follow.same_layout(tuple(target.placements), want):
        view_writes.assign(target, follower._to(target, want, step))
    if restrides_only(func, target, args[1:], kwargs):
        out = follower._results(step, target)
    else:
        out = follower._results(step, _out_of_place_view(func)(target, *args[1:], **kwargs))
    _assign_view(target, out, func, args[1:], kwargs)
    return target


def restrides_only(func: Any, target: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` is an ``as_strided_`` that keeps ``target``'s sizes, storage offset and
    the strides of every dim longer than 1: each element stays where it is, only the strides
    of size-1 dims change (CPU ``adaptive_avg_pool2d`` to ``1x1`` marks a channels-last
    result so, HF Swin's pooler), and DTensor has no ``as_strided`` at all."""
    if func is not torch.ops.aten.as_strided_.default or kwargs:
        return False
    sizes, strides = list(args[0]), list(args[1])
    offset = args[2] if len(args) > 2 else None
    if sizes != list(target.shape) or offset not in (None, target.storage_offset()):
        return False
    return all(n == 1 or s == t for n, s, t in zip(sizes, strides, target.stride(), strict=True))


def relayout(follower: PlanFollower, step: AtenStep, target: torch.Tensor) -> bool:
    """An in-place call whose planned result layout is not its target's: DTensor keeps
    an in-place target's placements, so the call runs out of place at the planned layouts
    and the target takes the result (``view_writes.assign``). HF Falcon's ``mlp_output +=
    attention_output`` adds a pending sum the plan reduce-scatters first."""
    name = step.results[0] if step.results else None
    if step.target == COPY and not (
        len(step.operands) == 2 and _same_type(follower, step.operands[0], step.operands[1])
    ):
        return False  # a broadcasting or casting copy stays in place
    return (
        isinstance(target, DTensor)
        and name is not None
        and step.operands[0] is not None
        and not follow.same_layout(tuple(target.placements), follower._placements(None, name))
    )


def _same_type(follower: PlanFollower, a: str | None, b: str | None) -> bool:
    """Two IR values of one shape and dtype (a ``copy_`` that is a plain copy)."""
    if a is None or b is None:
        return False
    return follower.plan.graph.value(a).type == follower.plan.graph.value(b).type


def empty_at(follower: PlanFollower, out: DTensor, value: str) -> DTensor:
    """An uninitialised tensor at the planned layout of ``value`` (the in-place call that
    fills it): made replicated, then each rank keeps its slice (no collective; the IR's
    factory is free, so the plan prices none)."""
    want = tuple(
        Replicate() if isinstance(p, Partial) else p for p in follower._placements(None, value)
    )
    if isinstance(out, DTensor) and tuple(out.placements) == want:
        return out
    shape, stride = tuple(out.shape), tuple(out.stride())
    local = torch.empty_strided(shape, stride, dtype=out.dtype, device=out.device)
    whole = DTensor.from_local(local, follower.mesh, [Replicate()] * follower.mesh.ndim,
                               run_check=False, shape=out.shape, stride=stride)  # fmt: skip
    return whole.redistribute(placements=want)


def fill_at(
    follower: PlanFollower, func: Any, args: tuple, kwargs: dict, step: AtenStep
) -> DTensor:
    """A ``ones_like``-style fill the IR made a constant: made whole on every rank at its
    operand's shape, then each rank keeps its planned slice (the IR's constant is free, so
    the plan prices no collective; DTensor would make it at the operand's layout). The
    custom MoE combine's backward fills ``ones_like(idx)``."""
    like = args[0]
    plain = torch.empty(tuple(like.shape), dtype=like.dtype, device=like.device)
    out = func(plain, *args[1:], **kwargs)
    return follower._to(out, follower._placements(None, step.results[0]), step)


def matmul_add(follower: PlanFollower, step: AtenStep, args: tuple, kwargs: dict) -> DTensor:
    """``beta * bias + alpha * (a @ b)`` as the IR's matmul then add, reshard in between."""
    bias, a, b = args[:3]
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    product = MATMUL_ADD[step.target](a, b)
    matmul, add = step.ops[0], step.ops[-1]
    product_name = follower.plan.graph.ops[matmul].results[0].name
    product = _results_of(follower, product, product_name, step)
    product = follower._to(product, follower._placements(
        follower.plan.operand_shardings.get((add, 0)), product_name), step)  # fmt: skip
    if alpha != 1:
        product = product * alpha
    return product + (bias * beta if beta != 1 else bias)


def _results_of(follower: PlanFollower, t: DTensor, name: str, step: AtenStep) -> DTensor:
    want = follower._placements(None, name)
    if not follow.same_layout(tuple(t.placements), want):
        follower.deviations.append(f"{step.target} -> %{name}: made {tuple(t.placements)}")
        return follower._to(t, want, step)
    return t


def attention(
    follower: PlanFollower, func: Any, args: tuple, kwargs: dict, qkv: list[DTensor]
) -> Any:
    """Fused CPU attention on local shards: batch/head splits (the IR rule's), and query
    sequence splits with K/V whole (``context_parallel``)."""
    q, k = qkv[0], qkv[1]
    for t in qkv:
        if any(isinstance(p, Partial) or (isinstance(p, Shard) and p.dim >= 2
               and not (t is q and p.dim == context_parallel.QUERY_SEQUENCE_DIM))
               for p in t.placements):  # fmt: skip
            raise NotImplementedError(
                f"attention operand split along sequence/head dim {tuple(t.placements)}"
            )
    if isinstance(kwargs.get("attn_mask"), DTensor):
        kwargs = {**kwargs, "attn_mask": mask_block(kwargs["attn_mask"], q)}
    local_args, local_kwargs = follow._replace(
        (args, kwargs), iter(t.to_local() for t in leaves((args, kwargs), torch.Tensor))
    )
    split = context_parallel.query_split_dims(q)
    if split:
        local_args, local_kwargs = context_parallel.causal_arguments(
            func, local_args, local_kwargs, q, k.shape[2], follower.order
        )
    out = func(*local_args, **local_kwargs)
    outs = leaves(out, torch.Tensor)
    like = [qkv[i] if len(outs) == 3 else qkv[0] for i in range(len(outs))]
    placements = [tuple(t.placements) for t in like]
    if split and len(outs) == 3:  # the backward: dK, dV are sums over the split queries
        placements[1:] = [context_parallel.gradient_placements(q, t) for t in qkv[1:]]
    wrapped = (follower._wrap(o, p) for o, p in zip(outs, placements, strict=True))
    return follow._replace(out, wrapped)


def mask_block(mask: DTensor, q: DTensor) -> DTensor:
    """An attention mask ``[b|1, h|1, q, k]`` sliced to the rank's block of the batch and
    heads that ``q`` is split on where the mask is whole there (T5's relative position bias
    ``[1, h, q, k]`` beside heads split over ``tp``): a local slice, no collective (the plan's
    whole-to-split reshard is free), as ``apply``'s ``local.attention`` does."""
    want = tuple(
        Shard(p.dim)
        if isinstance(p, Shard) and p.dim < 2 and mask.shape[p.dim] > 1 and isinstance(m, Replicate)
        else m
        for p, m in zip(q.placements, mask.placements, strict=True)
    )
    if want == tuple(mask.placements):
        return mask
    with follow.paused():
        return mask.redistribute(placements=want)


def local_view(args: tuple) -> DTensor | None:
    """A view of a split DTensor as a reshape of its local shard (``views.py``), or None."""
    x = args[0]
    if not isinstance(x, DTensor) or not any(isinstance(p, Shard) for p in x.placements):
        return None
    shape = [int(d) for d in args[1]]
    if -1 in shape:
        shape[shape.index(-1)] = x.numel() // max(math.prod(d for d in shape if d != -1), 1)
    sizes = tuple(x.device_mesh.shape)
    placements = views.view_placements(tuple(x.shape), shape, tuple(x.placements), sizes)
    return None if placements is None else views.reshape_local(x, shape, placements)


def strided_reshape(args: tuple) -> DTensor | None:
    """``as_strided`` of a contiguous DTensor that reads its elements in order, which the IR
    lowered as a reshape (``ops_nn.as_strided``; autograd's backward of an in-place view
    replays one): run as that view. None: not such a call (DTensor has no ``as_strided``)."""
    x, size, stride = args[0], [int(n) for n in args[1]], [int(s) for s in args[2]]
    offset = int(args[3]) if len(args) > 3 and args[3] is not None else 0
    if not isinstance(x, DTensor) or not x.is_contiguous():
        return None
    if not ops_nn.reads_in_order(size, stride, offset, x.numel()):
        return None
    viewed = local_view((x, size))
    return viewed if viewed is not None else torch.ops.aten.view.default(x, size)


CAT = "aten.cat.default"


def local_copy(follower: PlanFollower, step: AtenStep, args: tuple, kwargs: dict) -> Any:
    """A ``clone`` (or a ``cat`` of one operand) on the local shard at its placements: a
    pending sum stays one (DTensor's ``clone`` reduces it where the plan keeps it pending;
    HF Swin's attention gradient), a split stays split (DTensor's ``cat`` would gather the
    cat dim). None: not a DTensor such call."""
    x = args[0][0] if step.target == CAT else args[0]
    if not isinstance(x, DTensor) or (step.target == CAT and len(args[0]) != 1):
        return None
    memory = {"memory_format": kwargs["memory_format"]} if "memory_format" in kwargs else {}
    return follower._wrap(x.to_local().clone(**memory), tuple(x.placements))


def copied_reshape(follower: PlanFollower, pair: tuple[AtenStep, AtenStep], args: tuple) -> Any:
    """A run-time view run as the trace's copy and view of the copy, each at its planned
    layouts (``TraceMatcher.match_copied_reshape``)."""
    copy, view = pair
    copied = follower._run(copy, torch.ops.aten.clone.default, args[:1], {})
    follower._name(copy, copied, args[:1])
    out = follower._run(view, torch.ops.aten._unsafe_view.default, (copied, *args[1:]), {})
    follower._name(view, out, (copied, *args[1:]))
    return out


def _out_of_place(func: Any) -> Any:
    """``aten.add.Tensor`` for ``aten.add_.Tensor``."""
    packet = getattr(torch.ops.aten, func._overloadpacket.__name__.removesuffix("_"))
    return getattr(packet, func._overloadname)


def _out_of_place_view(func: Any) -> Any:
    """``aten.transpose.int`` for ``aten.transpose_.default``: the overload of the out-of-place
    view taking the same arguments."""
    packet = getattr(torch.ops.aten, func._overloadpacket.__name__.removesuffix("_"))
    names = [a.name for a in func._schema.arguments]
    for overload in packet.overloads():
        op = getattr(packet, overload)
        if [a.name for a in op._schema.arguments] == names:
            return op
    raise NotImplementedError(f"{func}: no out-of-place view with its arguments")


def _assign_view(target: DTensor, value: DTensor, func: Any, args: tuple, kwargs: dict) -> None:
    """Make ``target`` hold ``value``, the result of the in-place view ``func(target, *args)``
    computed out of place: its local shard and spec become ``value``'s, and ``func`` runs on
    the wrapper's own sizes and strides only.

    Private, as ``view_writes.assign``: below Python dispatch (``_DisableTorchDispatch``)
    the view is metadata-only on the wrapper (no data is read); there is no public way to change a
    DTensor's shape in place, and an in-place view must return its very target."""
    view_writes.assign(target, value)
    with torch._C._DisableTorchDispatch():
        func(target, *args, **kwargs)
