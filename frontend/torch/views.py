"""Views of split dimensions as local reshapes, the way the IR's reshape rule means them.

DTensor's ``view`` rule refuses (or turns into ``_StridedShard``, which a later view cannot
unflatten) a reshape of a dimension split over mesh axes whenever the split moves to another
dim: ``[b, s, (kv d)]`` split ``(dp, tp)`` viewed as ``[b, s, kv, d]`` raises "would remove
or reshape sharded dimension". The IR's rule (Shardy's GCD factorisation, ``ir.shape_rules``)
allows a minor factor to be split only when every more-major factor of its dim is fully
split, so each device's shard is one contiguous block on both sides and the view is a
reshape of the local shard: no data moves. ``view_placements`` maps placements through that
rule; ``local_view`` performs it (forward and backward) for ``apply`` and ``follow_plan``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from ...ir import ShardingError, TensorType
from ...ir.shape_rules import reshape as reshape_rule

Placements = tuple[Placement, ...]


def view_placements(
    src: Sequence[int], dst: Sequence[int], placements: Placements, mesh_sizes: Sequence[int]
) -> Placements | None:
    """Placements of ``x.view(dst)`` for ``x`` of shape ``src`` at ``placements`` when the view
    is a reshape of each local shard; None when it is not (a split spans two result dims, an
    uneven split, or the result dim would list its axes out of mesh order)."""
    if not all(type(p) in (Shard, Replicate) or isinstance(p, Partial) for p in placements):
        return None  # e.g. DTensor's own _StridedShard: left to DTensor
    try:
        rule = reshape_rule((TensorType(tuple(src)),), (TensorType(tuple(dst)),), {})
    except ShardingError:
        return None
    left = rule.size_of  # unsplit size left in each factor
    owner: dict[int, str] = {}  # mesh axis -> factor it splits
    for d, factors in enumerate(rule.operands[0]):
        axes = [a for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim == d]
        k = 0
        for axis in axes:  # mesh order: major first, as DTensor splits
            while k < len(factors) and left[factors[k]] == 1:
                k += 1
            if k == len(factors) or factors[k] in rule.need_replication:
                return None
            if left[factors[k]] % mesh_sizes[axis]:
                return None
            left[factors[k]] //= mesh_sizes[axis]
            owner[axis] = factors[k]
    return _result_placements(rule.results[0], rule.size_of, left, owner, placements)


def _result_placements(
    dims: Sequence[tuple[str, ...]],
    size: dict[str, int],
    left: dict[str, int],
    owner: dict[int, str],
    placements: Placements,
) -> Placements | None:
    """Shard each axis on the result dim holding its factor; every dim's axes must run in mesh
    order and split its factors major first (a minor factor only under fully split majors)."""
    out: list[Placement] = [p if not isinstance(p, Shard) else Replicate() for p in placements]
    for d, factors in enumerate(dims):
        axes = sorted(a for a, f in owner.items() if f in factors)
        rank = [factors.index(owner[a]) for a in axes]
        if rank != sorted(rank):
            return None
        for k, f in enumerate(factors):
            if any(left[g] != 1 for g in factors[:k]) and left[f] != size[f]:
                return None  # a minor factor split under a partly split major one
        for a in axes:
            out[a] = Shard(d)
    return tuple(out)


def local_shape(shape: Sequence[int], placements: Placements, mesh_sizes: Sequence[int]) -> list:
    local = list(shape)
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            local[p.dim] //= mesh_sizes[axis]
    return local


def reshape_local(x: DTensor, shape: Sequence[int], placements: Placements) -> DTensor:
    """``x`` viewed as ``shape`` at ``placements`` by reshaping its local shard (no collective;
    ``placements`` must be ``view_placements``'s answer)."""
    sizes = tuple(x.device_mesh.shape)
    local = x.to_local().reshape(local_shape(shape, placements, sizes))
    stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
    return DTensor.from_local(
        local, x.device_mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
    )


class _LocalView(torch.autograd.Function):
    """A local reshape whose backward reshapes the gradient back the same way."""

    @staticmethod
    def forward(ctx: Any, x: DTensor, shape: tuple, placements: Placements) -> DTensor:  # type: ignore[override]
        ctx.source = (tuple(x.shape), tuple(x.placements))
        ctx.result = (tuple(shape), placements)
        return reshape_local(x, shape, placements)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple:  # type: ignore[override]
        (src, _), (dst, dst_placements) = ctx.source, ctx.result
        sizes = tuple(grad.device_mesh.shape)
        keep = tuple(  # a pending sum stays pending through a (linear) view; none is made
            g if isinstance(g, Partial) else Replicate() if isinstance(p, Partial) else p
            for g, p in zip(grad.placements, dst_placements, strict=True)
        )
        back = view_placements(dst, src, keep, sizes)
        if back is None:
            keep = tuple(Replicate() if isinstance(p, Partial) else p for p in dst_placements)
            back = view_placements(dst, src, keep, sizes)
            assert back is not None  # the forward's placements, with whole dims for sums
        moved = grad if tuple(grad.placements) == keep else grad.redistribute(placements=keep)
        return reshape_local(moved, src, back), None, None


def local_view(x: DTensor, shape: Sequence[int]) -> DTensor | None:
    """``x.view(shape)`` as a local reshape (autograd-aware), or None when it is not local."""
    sizes = tuple(x.device_mesh.shape)
    placements = view_placements(tuple(x.shape), tuple(shape), tuple(x.placements), sizes)
    if placements is None or tuple(shape) == tuple(x.shape):
        return None
    if not any(isinstance(p, Shard) for p in x.placements):
        return None  # nothing split: DTensor's own view is already local
    return _LocalView.apply(x, tuple(shape), placements)
