"""Project tensor shardings onto an op's factors and back (Shardy's ShardingProjection).

A dimension made of compound factors ``(kl)`` is split by its mesh axes major to minor: the
major factor takes axes until it is fully split, then the next factor takes the rest. shardplan
has no sub-axes, so an axis that would straddle two factors is *overflow*: it stays on the
tensor but is not projected (Shardy would split it into sub-axes such as ``"x":(1)2``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import lru_cache

from shardplan.ir.mesh import Mesh
from shardplan.ir.rules import TensorFactors

FactorAxes = dict[str, tuple[str, ...]]
"""Per factor, the mesh axes (major to minor) that split it."""


def project_dim(
    axes: Sequence[str],
    factors: Sequence[str],
    sizes: Mapping[str, int],
    axis_sizes: Mapping[str, int],
) -> tuple[FactorAxes, bool]:
    """Split one dimension's axes over its factors, major first.

    Returns:
        The axes of each factor of the dimension, and whether some axes overflowed (they would
        need a sub-axis, or the dimension has no factor left to carry them).
    """
    out: dict[str, list[str]] = {f: [] for f in factors}
    k, filled = 0, 1
    for axis in axes:
        while k < len(factors) and filled == sizes[factors[k]]:  # factor fully split: next one
            k, filled = k + 1, 1
        n = axis_sizes[axis]
        if k == len(factors) or sizes[factors[k]] % (filled * n):
            return {f: tuple(a) for f, a in out.items()}, True
        out[factors[k]].append(axis)
        filled *= n
    return {f: tuple(a) for f, a in out.items()}, False


@lru_cache(maxsize=65536)
def project_tensor(
    dims: tuple[tuple[str, ...], ...],
    factors: TensorFactors,
    sizes: tuple[tuple[str, int], ...],
    mesh: Mesh,
) -> tuple[tuple[tuple[str, tuple[str, ...]], ...], frozenset[int]]:
    """Project a tensor's per-dim axes onto its factors (cached: layers repeat).

    Args:
        dims: ``Sharding.dims`` of the tensor.
        factors: the rule's factors of the tensor, per dimension.
        sizes: sizes of (at least) the tensor's factors.
        mesh: gives the axis sizes.

    Returns:
        ``(factor, axes)`` pairs for every factor of the tensor, and the overflowed dims.
    """
    size_of, axis_sizes = dict(sizes), mesh.shape
    result: FactorAxes = {}
    overflow: set[int] = set()
    for d, (axes, dim_factors) in enumerate(zip(dims, factors, strict=True)):
        per_factor, spilled = project_dim(axes, dim_factors, size_of, axis_sizes)
        result.update(per_factor)
        if spilled:
            overflow.add(d)
    return tuple(result.items()), frozenset(overflow)


def dim_axes(
    factors: Sequence[str],
    factor_axes: Mapping[str, tuple[str, ...]],
    sizes: Mapping[str, int],
    axis_sizes: Mapping[str, int],
) -> tuple[str, ...]:
    """Back-projection of one dimension: its factors' axes concatenated major to minor.

    Stops after the first factor that is not fully split, since sharding a minor factor under an
    unsplit major one would need a strided layout that a per-dim axis list cannot express.
    """
    out: list[str] = []
    for f in factors:
        axes = factor_axes.get(f, ())
        out.extend(axes)
        if math.prod(axis_sizes[a] for a in axes) != sizes[f]:
            break
    return tuple(out)
