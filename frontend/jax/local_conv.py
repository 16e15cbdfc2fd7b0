"""Convolutions XLA would partition otherwise than planned, bound per device in a ``shard_map``.

Two planned layouts of a ``conv_general_dilated`` are not what XLA's SPMD partitioner makes of
them when it only sees the pinned operands and result (measured, jax 0.10.2 on CPU, Shardy and
GSPMD alike):

* a *grouped* convolution (``feature_group_count > 1`` with more than one input channel per
  group; a depthwise one is fine) with its batch split: XLA all-gathers the input and runs
  the whole batch on every device, then slices the result;
* a convolution whose input features (the contraction: the batch of a weight gradient) are
  split over several mesh axes, planned as a pending sum the plan reduces in steps (a
  reduce-scatter over one axis, then an all-reduce over another): XLA reduces all the axes
  at once (one all-reduce of the larger piece, then a slice), since a pending sum cannot be
  pinned in ``Auto`` mode.

Both are the local convolution the plan prices: each device convolves its own shards. The
emitter binds exactly that, inside a ``shard_map`` that is manual over the split axes (every
other axis stays ``Auto`` for XLA to partition as pinned): the batch-split one returns the
batch-split result; the summed one returns its per-device partial sums stacked along leading
dims, one per summed axis (``pending.Pending``), which the planned steps then reduce.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from ...ir import Sharding
from .pending import Pending


def explicit_conv(
    eqn: Any,
    ins: Sequence[Any],
    layouts: Sequence[Sharding],
    result: Sharding,
    params: dict[str, Any],
    jax_mesh: jax.sharding.Mesh,
    pin: Callable[[Any, Sharding], Any],
) -> Any | None:
    """Bind a ``conv_general_dilated`` per device (module docstring) when its planned layouts
    are one of the two XLA would partition otherwise; None to bind it as captured.

    Args:
        eqn: the equation (its primitive is bound inside the ``shard_map``).
        ins: (lhs, rhs) arrays.
        layouts: the planned (lhs, rhs) layouts.
        result: the planned result layout as the convolution computes it (maybe partial).
        params: the bind parameters.
        jax_mesh: the jax mesh (``Auto`` axes).
        pin: constrains an array to a layout.

    Returns:
        A ``Pending`` (a planned pending sum), a batch-split array, or None.
    """
    lhs_layout, rhs_layout = layouts
    if lhs_layout.partial or rhs_layout.partial or int(params["batch_group_count"]) != 1:
        return None
    dn = params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    if result.partial:
        axes = _summed_axes(lhs_layout, rhs_layout, result, lhs_spec[1], rhs_spec[1], params)
        dims = (lhs_spec[1], rhs_spec[1])
    else:
        axes = _grouped_batch_axes(
            ins[0], lhs_layout, rhs_layout, result, lhs_spec, out_spec, params
        )
        dims = (lhs_spec[0], None)
    if not axes:
        return None
    order = tuple(a for a in jax_mesh.axis_names if a in set(axes))
    in_specs = tuple(_spec(len(x.shape), d, axes) for x, d in zip(ins, dims, strict=True))
    lhs, rhs = (pin(x, layout) for x, layout in zip(ins, layouts, strict=True))
    if result.partial:
        pending = _summed(eqn, (lhs, rhs), in_specs, order, params, jax_mesh)
        pending.array = pin(pending.array, pending.expanded(result.without_partial()))
        return pending
    out_specs = _spec(len(out_spec), out_spec[0], axes)
    local = _shard_map(eqn, params, jax_mesh, in_specs, out_specs, axes)
    return pin(local(lhs, rhs), result)


def _summed_axes(
    lhs: Sharding, rhs: Sharding, result: Sharding, lhs_dim: int, rhs_dim: int, params: dict
) -> tuple[str, ...]:
    """The axes of a planned pending sum that splits the input features alone (both operands
    alike, nothing else on those axes), the only sum a per-device convolution computes (a
    halo split of the rows needs its neighbours' rows); () otherwise."""
    axes = tuple(lhs.dims[lhs_dim])
    if int(params["feature_group_count"]) != 1 or len(result.partial) < 2:
        return ()  # one summed axis is one reduction, whichever way XLA runs it
    if tuple(rhs.dims[rhs_dim]) != axes or set(axes) != set(result.partial):
        return ()
    if _used_elsewhere(lhs, lhs_dim, axes) or _used_elsewhere(rhs, rhs_dim, axes):
        return ()
    return axes


def _grouped_batch_axes(
    lhs_value: Any,
    lhs: Sharding,
    rhs: Sharding,
    result: Sharding,
    lhs_spec: Sequence[int],
    out_spec: Sequence[int],
    params: dict,
) -> tuple[str, ...]:
    """The batch axes of a grouped convolution with several input channels per group whose
    batch is split (XLA would gather it); () otherwise."""
    groups = int(params["feature_group_count"])
    if groups == 1 or lhs_value.shape[lhs_spec[1]] == groups:
        return ()  # ungrouped or depthwise: XLA splits the batch itself
    axes = tuple(lhs.dims[lhs_spec[0]])
    if not axes or tuple(result.dims[out_spec[0]]) != axes:
        return ()
    if _used_elsewhere(lhs, lhs_spec[0], axes) or any(a in d for d in rhs.dims for a in axes):
        return ()
    return axes


def _used_elsewhere(layout: Sharding, dim: int, axes: Sequence[str]) -> bool:
    return any(a in d for k, d in enumerate(layout.dims) if k != dim for a in axes)


def _spec(rank: int, dim: int | None, axes: Sequence[str]) -> PartitionSpec:
    """A ``shard_map`` spec naming only the manual ``axes``, on ``dim``."""
    entries: list[Any] = [None] * rank
    if dim is not None:
        entries[dim] = axes[0] if len(axes) == 1 else tuple(axes)
    return PartitionSpec(*entries)


def _shard_map(
    eqn: Any,
    params: dict[str, Any],
    jax_mesh: jax.sharding.Mesh,
    in_specs: tuple[PartitionSpec, ...],
    out_specs: PartitionSpec,
    axes: Sequence[str],
    lead: int = 0,
) -> Callable[[Any, Any], Any]:
    """The convolution on each device's shards, manual over ``axes`` (with ``lead`` leading
    size-1 dims on its result)."""

    def local(lhs: Any, rhs: Any) -> Any:
        out = eqn.primitive.bind(lhs, rhs, **params)
        return out.reshape((1,) * lead + tuple(out.shape)) if lead else out

    return jax.shard_map(
        local,
        mesh=jax_mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=frozenset(axes),
        check_vma=False,
    )


def _summed(
    eqn: Any,
    ins: tuple[Any, Any],
    in_specs: tuple[PartitionSpec, ...],
    order: tuple[str, ...],
    params: dict[str, Any],
    jax_mesh: jax.sharding.Mesh,
) -> Pending:
    """Each device's partial sum, stacked along one leading dim per summed axis."""
    rank = len(params["dimension_numbers"].out_spec)
    out_specs = PartitionSpec(*order, *([None] * rank))
    local = _shard_map(eqn, params, jax_mesh, in_specs, out_specs, order, lead=len(order))
    return Pending(local(*ins), order)
