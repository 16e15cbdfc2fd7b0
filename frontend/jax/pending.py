"""A dot's pending sum, made explicit so that XLA reduces it the way the plan says.

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
    summed = jax.numpy.sum(array, axis=drop)
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
