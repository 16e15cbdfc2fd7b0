"""Writes into a slice of a tensor: captured as a write of the base, replayed so it reaches it.

Hugging Face's label shift (``shift_tokens_right``, T5's ``_shift_right``) writes into views::

    shifted = labels.new_zeros(labels.shape)
    shifted[:, 1:] = labels[:, :-1].clone()    # slice(shifted) -> copy_ into it
    shifted[:, 0] = start                      # select(shifted) -> fill_ into it
    shifted.masked_fill_(shifted == -100, pad)  # reads the base: both writes must be there

The trace has no functional form of these writes (``make_fx`` records the ``copy_`` into the
slice). The capture (``record``) lowers the in-place call as usual - its result is the view's
new value - and then writes that value back into the base: ``dynamic_update_slice(base,
update)`` with the view's ``dim``/``start``/``end``/``step`` (``ir/writes.py``; a ``select`` is
a one-wide slice, its update reshaped to keep the dim), each view of a chain in turn. The base's
later readers read the write's result, so the plan lays the base out knowing it holds the
labels (a batch split), not a free constant.

The follower (``follow.py``) runs the in-place call as it runs any (in place, or out of place
at the planned layouts), then performs each ``dynamic_update_slice`` of that call at its planned
operand and result layouts (``write_back``): the run-time base takes the result, and its name
becomes the written value's, so the next readers match the trace. No collective is issued that
the plan does not price. Only slice and select views are written back: a write into a reshape
(Falcon's ``mlp_output += attention_output`` into a linear's ``_unsafe_view``) leaves a base
nothing reads again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import fx
from torch.distributed.tensor import DTensor, Partial, Shard

from ...ir import TensorType, Value

if TYPE_CHECKING:
    from .capture import AtenStep
    from .lower import Lowering

KIND = "dynamic_update_slice"
VIEW_TARGETS = ("aten.slice.Tensor", "aten.select.int")
"""Run-time view calls whose base a write into the view must reach."""
_SLICE, _SELECT = torch.ops.aten.slice.Tensor, torch.ops.aten.select.int


def _window(view: fx.Node, size: int) -> tuple[int, int, int]:
    """``(start, end, step)`` of a slice/select node on a base dim of ``size``."""
    args = list(view.args) + [None] * 5
    if view.target is _SELECT:
        start = int(args[2]) % size
        return start, start + 1, 1
    step = int(args[4] if args[4] is not None else view.kwargs.get("step", 1))
    begin, stop, _ = slice(args[2], args[3], step).indices(size)
    return begin, max(begin, stop), step


def record(low: Lowering, view: Any) -> None:
    """After an in-place call into ``view`` (its new value in ``low.env[view]``): write the
    value back into the base of each slice/select view up the chain (module docstring)."""
    while isinstance(view, fx.Node) and view.target in (_SLICE, _SELECT):
        base = view.args[0]
        value, old = low.env.get(view), low.env.get(base) if isinstance(base, fx.Node) else None
        if not (isinstance(value, Value) and isinstance(old, Value)):
            return
        dim = int(view.args[1]) % old.type.rank
        start, end, step = _window(view, old.type.shape[dim])
        if value.type.rank < old.type.rank:  # a select: keep the dim, one wide
            shape = list(old.type.shape)
            shape[dim] = 1
            value = low.emit("reshape", [value], [TensorType(tuple(shape), value.type.dtype)])[0]
        attrs = {"dim": dim, "start": start, "end": end, "step": step}
        low.env[base] = low.emit(KIND, [old, value], [old.type], attrs)[0]
        view = base


def written_views(steps: list[AtenStep], ops: list) -> set[str]:
    """IR names of views some traced write reaches the base of (their bases are kept)."""
    names: set[str] = set()
    for s in steps:
        writes = [ops[i] for i in s.ops if ops[i].kind == KIND]
        if writes and s.operands and s.operands[0]:
            names.add(s.operands[0])
            names.update(op.operands[0].name for op in writes[:-1])  # views up the chain
    return names


def write_back(follower: Any, step: AtenStep, view: torch.Tensor) -> None:
    """Run the ``dynamic_update_slice`` ops of an in-place ``step`` into ``view``: each base
    (``follower.bases``) takes the written value at the planned layouts, and its new name."""
    plan = follower.plan
    for index in step.ops:
        op = plan.graph.ops[index]
        if op.kind != KIND:
            continue
        base = follower.bases.get(view)
        if base is None:
            follower.deviations.append(f"{step.target}: the base of a written view is unknown")
            return
        dim, start, end, stride = (int(op.attrs[k]) for k in ("dim", "start", "end", "step"))
        want = [
            follower._placements(plan.operand_shardings.get((index, j)), op.operands[j].name)
            for j in (0, 1)
        ]
        update = view.unsqueeze(dim) if view.dim() < base.dim() else view
        whole = follower._to(base, want[0], step)
        update = follower._to(update, want[1], step)
        new = _scatter(whole, update, (dim, start, end, stride))
        new = follower._to(new, follower._placements(None, op.results[0].name), step)
        _take(base, new)
        follower.names[base] = op.results[0].name
        view = base


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
