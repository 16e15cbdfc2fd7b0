"""Project tensor shardings onto an op's factors and back (Shardy's ShardingProjection).

A dimension made of compound factors ``(kl)`` is split by its mesh axes major to minor: the
major factor takes axes until it is fully split, then the next factor takes the rest. An axis
that straddles two factors is split into sub-axes as Shardy does (``x`` of size 4 over factors
of sizes 2 and 4: ``x:(1)2`` to the first, ``x:(2)2`` to the second; ``ir/axes.py``). An axis
that cannot be split that way (the factor's remaining size and the axis size do not divide one
another, or no factor is left) is *overflow*: it stays on the tensor but is not projected.
Conservative propagation forbids sub-axes (as Shardy's does), so there a straddling axis is
overflow too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache

from shardplan.ir.axes import merge_adjacent, split_axis
from shardplan.ir.mesh import Mesh
from shardplan.ir.rules import TensorFactors

FactorAxes = dict[str, tuple[str, ...]]
"""Per factor, the mesh axes (major to minor) that split it."""


def project_dim(
    axes: Sequence[str],
    factors: Sequence[str],
    sizes: Mapping[str, int],
    axis_size: Callable[[str], int] | Mapping[str, int],
    sub_axes: bool = True,
) -> tuple[FactorAxes, bool]:
    """Split one dimension's axes over its factors, major first.

    Args:
        axis_size: the size of a mesh axis or sub-axis (``Mesh.axis_size``).
        sub_axes: whether an axis straddling two factors may be split into sub-axes.
    Returns:
        The axes of each factor of the dimension, and whether some axes overflowed (no sub-axis
        split fits, or the dimension has no factor left to carry them).
    """
    axis_size = _sizer(axis_size)
    out: dict[str, list[str]] = {f: [] for f in factors}
    k, filled = 0, 1
    pending = list(axes)
    while pending:
        axis = pending.pop(0)
        while k < len(factors) and filled == sizes[factors[k]]:  # factor fully split: next one
            k, filled = k + 1, 1
        if k == len(factors):
            return {f: tuple(a) for f, a in out.items()}, True
        n, room = axis_size(axis), sizes[factors[k]] // filled
        if room % n == 0:
            out[factors[k]].append(axis)
            filled *= n
        elif sub_axes and room > 1 and n % room == 0:
            major, minor = split_axis(axis, room, axis_size)  # Shardy's sub-axes
            out[factors[k]].append(major)
            filled *= room
            pending.insert(0, minor)
        else:
            return {f: tuple(a) for f, a in out.items()}, True
    return {f: tuple(a) for f, a in out.items()}, False


@lru_cache(maxsize=65536)
def project_tensor(
    dims: tuple[tuple[str, ...], ...],
    factors: TensorFactors,
    sizes: tuple[tuple[str, int], ...],
    mesh: Mesh,
    sub_axes: bool = True,
) -> tuple[tuple[tuple[str, tuple[str, ...]], ...], frozenset[int]]:
    """Project a tensor's per-dim axes onto its factors (cached: layers repeat).

    Args:
        dims: ``Sharding.dims`` of the tensor.
        factors: the rule's factors of the tensor, per dimension.
        sizes: sizes of (at least) the tensor's factors.
        mesh: gives the axis sizes.
        sub_axes: whether straddling axes split into sub-axes (not in conservative mode).

    Returns:
        ``(factor, axes)`` pairs for every factor of the tensor, and the overflowed dims.
    """
    size_of = dict(sizes)
    result: FactorAxes = {}
    overflow: set[int] = set()
    for d, (axes, dim_factors) in enumerate(zip(dims, factors, strict=True)):
        per_factor, spilled = project_dim(axes, dim_factors, size_of, mesh.axis_size, sub_axes)
        result.update(per_factor)
        if spilled:
            overflow.add(d)
    return tuple(result.items()), frozenset(overflow)


@lru_cache(maxsize=65536)
def has_sub_axes(projected: tuple[tuple[str, tuple[str, ...]], ...]) -> bool:
    """Whether a projection (``project_tensor``'s pairs) names a sub-axis (cached: the
    propagation's sub-axis handling is skipped for the ops that have none)."""
    return any(":" in axis for _, axes in projected for axis in axes)


def dim_axes(
    factors: Sequence[str],
    factor_axes: Mapping[str, tuple[str, ...]],
    sizes: Mapping[str, int],
    axis_size: Callable[[str], int] | Mapping[str, int],
    sub_axes: bool = True,
) -> tuple[str, ...]:
    """Back-projection of one dimension: its factors' axes concatenated major to minor, with
    adjacent sub-axes merged (``x:(1)2, x:(2)2`` -> ``x``, as Shardy projects back).

    Stops after the first factor that is not fully split, since sharding a minor factor under an
    unsplit major one would need a strided layout that a per-dim axis list cannot express.
    ``sub_axes=False`` says the factor axes hold none (skips the merge; a plain name -> size
    table is then read directly, as propagation does on its hot path).
    """
    axis_size = (
        axis_size.__getitem__ if not sub_axes and type(axis_size) is dict else _sizer(axis_size)
    )
    out: list[str] = []
    for f in factors:
        axes = factor_axes.get(f, ())
        out.extend(axes)
        if math.prod(axis_size(a) for a in axes) != sizes[f]:
            break
    if sub_axes and any(":" in a for a in out):
        return merge_adjacent(out, axis_size)
    return tuple(out)


def _sizer(axis_size: Callable[[str], int] | Mapping[str, int]) -> Callable[[str], int]:
    """``Mesh.axis_size``, or a plain name -> size table (a sub-axis's size is in its name)."""
    if callable(axis_size):
        return axis_size
    table = axis_size
    return lambda name: table[name] if ":" not in name else int(name.rsplit(")", 1)[1])
