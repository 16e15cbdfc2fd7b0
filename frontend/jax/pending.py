"""A pending sum (of a dot, a ``reduce_sum`` or an embedding gradient), made explicit so that
XLA reduces it the way the plan says.

In ``Auto`` mode a partial (unreduced) layout cannot be written, so the emitter used to leave a
dot's partial result unconstrained and pin only its reader. XLA's dot partitioner then chose
the reduction itself, and when the operands are replicated over other mesh axes (e.g. ``dp``
with ``tp`` contracted) it computes the dot already sliced over those axes, all-reduces that
slice and collective-permutes it into place: an all-reduce + permute where the plan priced one
reduce-scatter (docs/costmodel.md, "Reductions: what XLA runs for a dot's pending sum").

The emitter therefore binds such a dot with each contracted mesh axis split off its contracting
dim as a leading *batch* dim of that axis' size, sharded over that axis: the per-device
arithmetic is the plan's local dot, the result is an ordinary (pinnable) array, and the pending
sum is a ``reduce_sum`` over those leading dims. XLA's reduce partitioner reduces exactly the
axes summed, into the layout pinned on the sum: one reduce-scatter, or one all-reduce, per
planned step.

A ``reduce_sum`` over several sharded dims, and an embedding gradient (a scatter-add of rows)
whose ids are sharded on several dims, get the same form (``explicit_reduce``,
``explicit_scatter_rows``): left to XLA, each reduces its pending sum with one collective per
sharded dim, in turn over the full result (a loss summed over a batch split over
``dp,fsdp,cp`` and a sequence split over ``tp``: an all-reduce over tp, then one over
``dp,fsdp,cp``), where the plan has one collective over all the axes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax

from ...ir import Mesh, Sharding


@dataclass(eq=False)
class Pending:
    """A value with pending sums over ``axes``: ``array`` has one leading dim per axis, of
    that axis' size and sharded over it; the value is ``array`` summed over those dims.

    One dim per axis (not one dim over their group) so that reducing some of them never
    splits a dim sharded over several axes: that reshape makes XLA gather the array's other
    sharded dims first (measured on (2, 2, 2): an all-gather over tp and an all-reduce of the
    whole product where the plan reduce-scatters over fsdp)."""

    array: Any
    axes: tuple[str, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape[len(self.axes) :])

    def expanded(self, sharding: Sharding) -> Sharding:
        """The array's (non-partial) layout for the value's layout ``sharding``."""
        return Sharding(tuple((a,) for a in self.axes) + sharding.dims)

    def total(self) -> Any:
        """The value: every pending sum reduced, in one collective (``sum_axes``)."""
        return sum_axes(self, frozenset())


def sum_axes(x: Pending, keep: frozenset[str] | set[str]) -> Pending | Any:
    """Sum the pending sums over the axes not in ``keep`` in one reduction (a plain array when
    none is left). Their dims are first moved to the front (a local transpose) and merged into
    one dim sharded over all of them: XLA reduces one ``reduce_sum`` over several sharded dims
    with one collective per dim, over a merged dim with one collective."""
    drop = tuple(k for k, a in enumerate(x.axes) if a not in keep)
    kept = tuple(k for k, a in enumerate(x.axes) if a in keep)
    if not drop:
        return x
    n = len(x.axes)
    array = x.array
    if len(drop) > 1:
        array = jax.numpy.transpose(array, (*drop, *kept, *range(n, array.ndim)))
        array = array.reshape(-1, *array.shape[len(drop) :])
        drop = (0,)
    summed = jax.numpy.sum(array, axis=drop, dtype=array.dtype)
    if not kept:
        return summed
    return Pending(summed, tuple(x.axes[k] for k in kept))


def explicit_dot(
    lhs: Any,
    rhs: Any,
    layouts: tuple[Sharding, Sharding],
    result: Sharding,
    params: dict[str, Any],
    mesh: Mesh,
    pin: Any,
) -> Pending | None:
    """Bind ``dot_general`` with its contracted mesh axes as leading batch dims (module
    docstring); None when the planned layouts are not a plain sharded contraction (the caller
    binds the dot as captured). ``pin(x, sharding)`` constrains an array."""
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    left, right = layouts
    if left.partial or right.partial or not result.partial:
        return None
    axes = [a for c in lc for a in left.dims[c]]
    if [[a for a in right.dims[c]] for c in rc] != [list(left.dims[c]) for c in lc]:
        return None  # the two sides split their contracting dims differently
    if set(axes) != set(result.partial) or len(axes) != len(set(axes)):
        return None
    order = tuple(a for a in mesh.axis_names if a in set(axes))
    lhs, lmap, lsplit = _split(lhs, left, lc, mesh)
    rhs, rmap, rsplit = _split(rhs, right, rc, mesh)
    lhs, rhs = pin(lhs, lsplit), pin(rhs, rsplit)
    batch_l = [lmap[a] for a in order] + [lmap[d] for d in lb]
    batch_r = [rmap[a] for a in order] + [rmap[d] for d in rb]
    numbers = (([lmap[c] for c in lc], [rmap[c] for c in rc]), (batch_l, batch_r))
    out = jax.lax.dot_general(
        lhs,
        rhs,
        numbers,
        precision=params.get("precision"),
        preferred_element_type=params.get("preferred_element_type"),
    )
    pending = Pending(out, order)
    pending.array = pin(out, pending.expanded(result.without_partial()))
    return pending


def _split(
    x: Any, layout: Sharding, contracting: Sequence[int], mesh: Mesh
) -> tuple[Any, dict[Any, int], Sharding]:
    """Reshape each contracting dim split over axes (a1, ..., ak) into [|a1|, ..., |ak|, rest]
    (a local view: the shards are the major blocks). Returns the array, where each old dim and
    each split-off axis went, and the reshaped layout."""
    shape: list[int] = []
    dims: list[tuple[str, ...]] = []
    where: dict[Any, int] = {}
    for d, size in enumerate(x.shape):
        split = layout.dims[d] if d in contracting else ()
        for axis in split:
            where[axis] = len(shape)
            shape.append(mesh.axis_size(axis))
            dims.append((axis,))
        where[d] = len(shape)
        shape.append(size // math.prod(mesh.axis_size(a) for a in split))
        dims.append(() if split else layout.dims[d])
    return x.reshape(shape), where, Sharding(tuple(dims))


def _order(axes: Sequence[str], mesh: Mesh) -> tuple[str, ...] | None:
    """The axes in mesh order, or None when one repeats (not one split per axis)."""
    if len(axes) != len(set(axes)):
        return None
    return tuple(a for a in mesh.axis_names if a in set(axes))


def _split_dims(layout: Sharding, dims: Sequence[int]) -> int:
    """How many of ``dims`` are split (XLA's own reduction: one collective per such dim)."""
    return sum(1 for d in dims if layout.dims[d])


def explicit_reduce(
    x: Any, layout: Sharding, axes: Sequence[int], result: Sharding, mesh: Mesh, pin: Any
) -> Pending | None:
    """``reduce_sum(x, axes)`` whose planned result is the pending sum over the mesh axes of the
    reduced dims, as a ``Pending``: each reduced dim split per mesh axis (``_split``, a local
    view), the local rest summed, the axis dims moved to the front. None unless the reduced
    dims are split over two or more dims (one split dim is one collective already) and the
    layouts are exactly that."""
    if layout.partial or layout.has_sub_axes or not result.partial or result.has_sub_axes:
        return None
    kept = [d for d in range(len(x.shape)) if d not in axes]
    split_axes = [a for d in axes for a in layout.dims[d]]
    order = _order(split_axes, mesh)
    if order is None or set(order) != set(result.partial) or _split_dims(layout, axes) < 2:
        return None
    if tuple(layout.dims[d] for d in kept) != result.dims:
        return None
    array, where, split = _split(x, layout, axes, mesh)
    array = pin(array, split)
    summed_dims = {where[d] for d in axes}
    left = [k for k in range(array.ndim) if k not in summed_dims]
    summed = jax.numpy.sum(array, axis=tuple(sorted(summed_dims)), dtype=array.dtype)
    front = [left.index(where[a]) for a in order]
    summed = summed.transpose((*front, *(left.index(where[d]) for d in kept)))
    pending = Pending(summed, order)
    pending.array = pin(summed, pending.expanded(result.without_partial()))
    return pending


def explicit_scatter_rows(
    base: Any,
    indices: Any,
    updates: Any,
    layouts: tuple[Sharding, Sharding],
    result: Sharding,
    mode: Any,
    mesh: Mesh,
    pin: Any,
) -> Pending | None:
    """An embedding gradient (``updates[..., d]`` rows added into zeros shaped like ``base`` at
    ``indices[..., 1]``) whose planned result is the pending sum over the mesh axes splitting
    the ids, as a ``Pending``: ids and updates split per mesh axis (``_split``) and those dims
    moved to the front, a scatter-add into one table per shard (the axis dims are batching
    dims, so XLA scatters locally). ``layouts``: the updates' and the ids' planned layouts.
    None unless the ids are split over two or more dims, the table's rows are whole and the
    layouts are exactly that."""
    upd_layout, ids_layout = layouts
    index_dims = tuple(range(len(updates.shape) - 1))
    if upd_layout.partial or ids_layout.partial or upd_layout.has_sub_axes:
        return None
    if ids_layout.dims != upd_layout.dims[:-1] or _split_dims(upd_layout, index_dims) < 2:
        return None
    order = _order([a for d in index_dims for a in upd_layout.dims[d]], mesh)
    if order is None or set(order) != set(result.partial) or result.has_sub_axes:
        return None
    if result.dims != ((), upd_layout.dims[-1]):
        return None
    updates = _front(updates, upd_layout, index_dims, order, mesh, pin)
    indices = _front(indices, Sharding((*ids_layout.dims, ())), index_dims, order, mesh, pin)
    k = len(order)
    sizes = tuple(mesh.axis_size(a) for a in order)
    pending = Pending(jax.numpy.zeros((*sizes, *base.shape), base.dtype), order)
    zeros = pin(pending.array, pending.expanded(result.without_partial()))
    numbers = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(len(updates.shape) - 1,),
        inserted_window_dims=(k,),
        scatter_dims_to_operand_dims=(k,),
        operand_batching_dims=tuple(range(k)),
        scatter_indices_batching_dims=tuple(range(k)),
    )
    out = jax.lax.scatter_add(zeros, indices, updates, numbers, mode=mode)
    pending.array = pin(out, pending.expanded(result.without_partial()))
    return pending


def _front(
    x: Any, layout: Sharding, dims: Sequence[int], order: Sequence[str], mesh: Mesh, pin: Any
) -> Any:
    """``x`` with ``dims`` split per mesh axis (``_split``) and the axis dims first, in
    ``order``; pinned before and after the (local) transpose."""
    array, where, split = _split(x, layout, dims, mesh)
    array = pin(array, split)
    front = [where[a] for a in order]
    perm = (*front, *(k for k in range(array.ndim) if k not in front))
    moved = Sharding(tuple(split.dims[k] for k in perm))
    return pin(array.transpose(perm), moved)
