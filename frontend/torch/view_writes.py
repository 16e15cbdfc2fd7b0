"""Writes into a slice of a tensor under ``follow_plan``: replayed so they reach the base.

Hugging Face's label shift (``shift_tokens_right``, T5's ``_shift_right``) writes into views::

    shifted = labels.new_zeros(labels.shape)
    shifted[:, 1:] = labels[:, :-1].clone()    # slice(shifted) -> copy_ into it
    shifted[:, 0] = start                      # select(shifted) -> fill_ into it
    shifted.masked_fill_(shifted == -100, pad)  # reads the base: both writes must be there

The follower (``follow.py``) may run an in-place call out of place at its planned layout (the
target takes the result: ``assign``); into a view, the write then never reached the base (the
decoder read zeros: BART on (8,) free 4.1663 against 4.1289). So the follower remembers, for
each ``slice``/``select`` result that a traced in-place call writes into, the run-time base and
the view's window; after the write it writes the view's new value into the base at the base's
own layout (``write_back``; the view's value is moved there first: for the label shift a
gather of the labels the plan does not price - the IR sees the base as a constant). Slice and
select views are written back, and ``as_strided`` views that reshape their whole base
(autograd's backward of an in-place ``as_strided_``: HF Swin's pooler); a write into another
reshape (Falcon's ``mlp_output += attention_output`` into a linear's ``_unsafe_view``) leaves a
base nothing reads again.

Lowering the write into the IR as ``dynamic_update_slice`` of the base (``ir/writes.py``) was
tried: it made the plan split the shifted labels with the batch, and ``plan.apply`` of T5 with
row-split relative-bias tables on (2, 4) then failed in backward ("view size is not
compatible"; test_t5_apply), so the IR keeps the base a constant for now.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from . import views

if TYPE_CHECKING:
    from .capture import AtenStep

VIEW_TARGETS = ("aten.slice.Tensor", "aten.select.int", "aten.as_strided.default")
"""Run-time view calls whose base a write into the view must reach. An ``as_strided`` the
follower runs is a reshape (``follow_calls.strided_reshape``): autograd's backward of an
in-place view writes the gradient into ``as_strided(new_zeros(...))`` and reads the buffer
back (HF Swin's pooler, CPU ``adaptive_avg_pool2d``'s channels-last ``as_strided_``)."""

Window = tuple[int, int, int, int] | None
"""A slice's ``(dim, start, end, step)``; None: the view is a reshape of its whole base."""


def window(target: str, args: tuple) -> Window:
    """``(dim, start, end, step)`` of a run-time ``slice``/``select`` call on ``args[0]``;
    None for a reshape (``as_strided``)."""
    if target == "aten.as_strided.default":
        return None
    base = args[0]
    rest = list(args[1:]) + [None] * 4
    dim = int(rest[0] if rest[0] is not None else 0) % base.dim()
    size = base.shape[dim]
    if target == "aten.select.int":
        start = int(rest[1]) % size
        return dim, start, start + 1, 1
    step = int(rest[3] if rest[3] is not None else 1)
    begin, stop, _ = slice(rest[1], rest[2], step).indices(size)
    return dim, begin, max(begin, stop), step


def written_views(steps: list[AtenStep]) -> set[str]:
    """IR names of slice/select results that a later traced in-place call writes into."""
    views = {s.results[0] for s in steps if s.target in VIEW_TARGETS and s.results}
    return {
        s.operands[0]
        for s in steps
        if s.operands and s.operands[0] in views and _in_place(s.target)
    }


def write_back(follower: Any, step: AtenStep, view: torch.Tensor) -> None:
    """After an in-place ``step`` into ``view``: each base up the chain (``follower.bases``)
    takes the view's new value, at the base's own layout."""
    while (entry := follower.bases.get(view)) is not None:
        base, span = entry
        if span is None:  # a reshape: the base is the view's new value, reshaped back
            _take(base, follower._to(_reshaped(view, tuple(base.shape)), _layout(base), step))
            view = base
            continue
        dim = span[0]
        update = view.unsqueeze(dim) if view.dim() < base.dim() else view
        whole = base if isinstance(base, DTensor) else follower._to(base, _replicated(view), step)
        update = follower._to(update, tuple(whole.placements), step)
        _take(base, _scatter(whole, update, span))
        view = base


def _reshaped(view: torch.Tensor, shape: tuple) -> torch.Tensor:
    """``view`` reshaped to ``shape``: on local shards where the split allows (``views.py``)."""
    local = views.local_view(view, shape) if isinstance(view, DTensor) else None
    return local if local is not None else view.reshape(shape)


def _layout(base: torch.Tensor) -> tuple:
    return tuple(base.placements) if isinstance(base, DTensor) else _replicated(base)


def _replicated(like: torch.Tensor) -> tuple:
    mesh = like.device_mesh if isinstance(like, DTensor) else None
    return (Replicate(),) * (mesh.ndim if mesh is not None else 1)


def _in_place(target: str) -> bool:
    name = target.split(".")[1] if target.count(".") >= 1 else target
    return name.endswith("_") and not name.endswith("__")


def _scatter(base: DTensor, update: DTensor, window: tuple[int, int, int, int]) -> DTensor:
    """``base`` with ``update`` written at ``window``: on local shards where both are laid out
    alike and the written dim is whole (the IR rule's layouts), else through DTensor."""
    dim, start, end, step = window
    placements = tuple(base.placements)
    local = placements == tuple(update.placements) and not any(
        isinstance(p, Partial) or (isinstance(p, Shard) and p.dim == dim) for p in placements
    )
    if not local:
        return torch.ops.aten.slice_scatter.default(base, update, dim, start, end, step)
    out = torch.ops.aten.slice_scatter.default(
        base.to_local(), update.to_local(), dim, start, end, step
    )
    return DTensor.from_local(out, base.device_mesh, placements, run_check=False,
                              shape=base.shape, stride=base.stride())  # fmt: skip


def _take(base: torch.Tensor, new: DTensor) -> None:
    """``base`` holds ``new`` from now on (the same object: the model holds it)."""
    if isinstance(base, DTensor):
        assign(base, new)
    else:
        base.copy_(new.full_tensor())


def assign(target: DTensor, value: DTensor) -> None:
    """Make ``target`` hold ``value`` (same global shape) at ``value``'s placements.

    Private: DTensor has no public way to change a tensor's placements in place, and an
    in-place call must leave its result in the very tensor object it was given (autograd
    returns that object; the model may keep other references to it). The wrapper keeps its
    global shape and autograd identity; its local shard and spec are replaced.
    """
    target._local_tensor = value._local_tensor
    target._spec = value._spec
