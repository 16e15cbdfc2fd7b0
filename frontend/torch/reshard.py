"""Reshard a DTensor by the collectives the plan priced, one at a time.

``DTensor.redistribute`` picks its own collectives: one per mesh dimension in its canonical
order, an all-gather where the cost model moves a split with an all-to-all. The follower
replays the cost model's walk instead (``costmodel.reshard.reshard_steps``): all-gathers,
reduce-scatters and all-reduces over a group of axes go through ``redistribute`` (one
collective on the flattened mesh, ``plan_layouts.flattened_meshes``); an all-to-all runs on the
group's own 1-D mesh, where DTensor's ``Shard(i) -> Shard(j)`` is exactly one all-to-all, and
so is a reduce-scatter over several axes (``redistribute`` runs ``Partial -> Shard(d)`` over
two mesh dims as an all-reduce over the minor one and a reduce-scatter over the major one).
A collective-permute (same shard count per dim, other axes or order: the walk's answer where
``redistribute`` would gather and slice again) runs as one ``all_to_all_single`` on the group
of the axes it moves along, each rank sending its whole block to one partner (XLA's pairing,
``costmodel.reshard.permuted_axes``). Steps whose layouts DTensor cannot hold (axes out of
mesh order) are left to ``redistribute`` from there to the target (counted as a deviation by
the caller).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

# torch's functional collectives (DTensor's own; the module name is private): unlike c10d's
# in-place all_to_all_single they carry autograd and are what LocalTensorMode and
# simulate.CollectiveLog see
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ...costmodel.reshard import reshard_steps
from ...ir import Mesh, Sharding
from .plan_layouts import Placements, flattened_meshes, placements_of


def sharding_of(placements: Placements, mesh: Mesh, rank: int) -> Sharding:
    """The IR sharding DTensor placements mean (each dim's axes in mesh order)."""
    dims: list[tuple[str, ...]] = [() for _ in range(rank)]
    partial = set()
    for axis, p in zip(mesh.axis_names, placements, strict=True):
        if isinstance(p, Partial):
            partial.add(axis)
        elif isinstance(p, Shard):
            dims[p.dim] = (*dims[p.dim], axis)
    return Sharding(tuple(dims), frozenset(partial))


def _ordered(dims: tuple[tuple[str, ...], ...], mesh: Mesh) -> bool:
    return all(list(a) == sorted(a, key=mesh.axis_index) for a in dims)


def reshard(t: DTensor, want: Placements, mesh: Mesh | None = None) -> tuple[DTensor, bool]:
    """``t`` at ``want`` by the cost model's collectives; the flag says whether every step
    ran as priced (False: the rest was left to ``redistribute``). ``mesh``: the plan mesh
    (default: one made from ``t``'s device mesh)."""
    if mesh is None:
        names = tuple(t.device_mesh.mesh_dim_names or ())
        mesh = Mesh(dict(zip(names, t.device_mesh.shape, strict=True)))
    src = sharding_of(tuple(t.placements), mesh, t.ndim)
    dst = sharding_of(want, mesh, t.ndim)
    partial = set(src.partial)
    held: _Local | None = None  # a permuted block in a layout DTensor cannot hold
    for kind, axes, layout in reshard_steps(src, dst, mesh):
        if kind in ("all-reduce", "reduce-scatter"):
            partial -= set(axes)
        after = Sharding(layout, frozenset(partial))
        if held is not None:  # only a gather of the out-of-order axes can follow
            moved: DTensor | _Local | None = _gather(held, kind, axes, after, t, mesh)
        elif kind == "collective-permute":  # ``layout``: the staged one it moves (same size)
            moved = _permute(t, axes, after, dst, mesh)
        else:
            moved = _step(t, kind, axes, after, mesh)
        if moved is None:
            return t.redistribute(placements=want), False
        if isinstance(moved, _Local):
            held = moved
        else:
            t, held = moved, None
    if held is not None:
        return t.redistribute(placements=want), False
    if tuple(t.placements) != tuple(want):
        t = t.redistribute(placements=want)  # local slices only (the walk ends in them)
    return t, True


def _step(
    t: DTensor, kind: str, axes: tuple[str, ...], after: Sharding, mesh: Mesh
) -> DTensor | None:
    """One all-gather, reduce-scatter, all-reduce or all-to-all of the walk (None: not as
    priced)."""
    if not _ordered(after.dims, mesh):
        return None
    if kind == "all-to-all":
        return _all_to_all(t, axes, after, mesh)
    if kind == "reduce-scatter" and len(axes) > 1:
        return _reduce_scatter(t, axes, after, mesh)
    return t.redistribute(placements=placements_of(after, mesh))


def _reduce_scatter(
    t: DTensor, axes: tuple[str, ...], after: Sharding, mesh: Mesh
) -> DTensor | None:
    """Reduce the pending sum over ``axes`` (two or more) and split it along the dim ``after``
    appends them to: one reduce-scatter on the group's flattened mesh, whose rank order (major
    axis first) is the nested split's. None when the move is not that (the group not minor-most
    on the dim, or not all partial)."""
    target = next(d for d, a in enumerate(after.dims) if axes[0] in a)
    before = sharding_of(tuple(t.placements), mesh, t.ndim)
    dims = list(before.dims)
    dims[target] = (*dims[target], *axes)
    partials = [t.placements[mesh.axis_index(a)] for a in axes]
    if tuple(dims) != after.dims or not all(isinstance(p, Partial) for p in partials):
        return None
    op = partials[0].reduce_op  # type: ignore[union-attr]
    if any(p.reduce_op != op for p in partials):  # type: ignore[union-attr]
        return None
    group = flattened_meshes(t.device_mesh)[axes]
    local = DTensor.from_local(t.to_local(), group, [Partial(op)], run_check=False)
    moved = local.redistribute(placements=[Shard(target)]).to_local()
    return DTensor.from_local(moved, t.device_mesh, placements_of(after, mesh),
                              run_check=False, shape=t.shape, stride=t.stride())  # fmt: skip


def _all_to_all(t: DTensor, axes: tuple[str, ...], after: Sharding, mesh: Mesh) -> DTensor | None:
    """Move the split over ``axes`` from its dim to the dim ``after`` gives it: one all-to-all
    on the group's 1-D mesh (the group is minor-most on both dims). None when the layout
    before the move is not one DTensor can hold."""
    device_mesh: DeviceMesh = t.device_mesh
    source = t.placements[mesh.axis_index(axes[0])]
    target = next(d for d, a in enumerate(after.dims) if axes[0] in a)
    if not isinstance(source, Shard):
        return None
    dims = [tuple(a for a in d if a not in axes) for d in after.dims]
    dims[source.dim] = (*dims[source.dim], *axes)
    if not _ordered(tuple(dims), mesh) or after.dims[target][-len(axes) :] != axes:
        return None
    staged = placements_of(Sharding(tuple(dims), after.partial), mesh)
    if tuple(t.placements) != staged:
        t = t.redistribute(placements=staged)  # free slices of the other axes
    group = device_mesh[axes[0]] if len(axes) == 1 else flattened_meshes(device_mesh)[axes]
    local = DTensor.from_local(t.to_local(), group, [Shard(source.dim)], run_check=False)
    moved = local.redistribute(placements=[Shard(target)]).to_local()
    placements = placements_of(after, mesh)
    return DTensor.from_local(moved, device_mesh, placements, run_check=False,
                              shape=t.shape, stride=t.stride())  # fmt: skip


@dataclass(frozen=True)
class _Local:
    """This rank's block after a permute into a layout DTensor's placements cannot express
    (a dim's axes out of mesh order: ``permute_to_gather`` puts the target's axes first)."""

    block: torch.Tensor
    layout: Sharding


def _permute(
    t: DTensor, axes: tuple[str, ...], before: Sharding, dst: Sharding, mesh: Mesh
) -> DTensor | _Local | None:
    """One collective-permute from ``before`` (reached from ``t`` by free slices) to the layout
    the walk's permute gives: every device sends its block to the device at the same position
    of the new layout (``permuted_after``); partners differ only along ``axes``, so it is one
    ``all_to_all_single`` on that group with a single non-empty split per rank (its backward is
    the inverse permute). The block alone (``_Local``) when DTensor cannot hold the new layout
    (the gather that follows can); None when it cannot hold ``before``, or a pending sum would
    move to other addends (a partial axis among ``axes``)."""
    after = Sharding(permuted_after(before.dims, dst.dims, mesh), before.partial)
    if not _ordered(before.dims, mesh) or not _even(t.shape, before, mesh):
        return None  # (uneven blocks: a partner's block is not the size of one's own)
    if before.partial & set(axes):
        return None
    device_mesh: DeviceMesh = t.device_mesh
    staged = placements_of(before, mesh)
    if tuple(t.placements) != staged:
        t = t.redistribute(placements=staged)  # free slices (the walk's staging)
    local = t.to_local().contiguous()
    coordinate = device_mesh.get_coordinate()
    if coordinate is None:
        return None  # this rank is not in the mesh
    plan = _Pairing(
        names=mesh.axis_names,
        sizes=tuple(mesh.axis_size(a) for a in mesh.axis_names),
        before=_order(before.dims, mesh),
        after=_order(after.dims, mesh),
        group=axes,
    )
    splits = per_rank(plan.splits)(list(coordinate), local.numel())
    n = len(splits) // 2
    out_splits, in_splits = list(splits[:n]), list(splits[n:])
    group = device_mesh[axes[0]] if len(axes) == 1 else flattened_meshes(device_mesh)[axes]
    moved = funcol.all_to_all_single(local.reshape(-1), out_splits, in_splits, group)
    if isinstance(moved, funcol.AsyncCollectiveTensor):
        moved = moved.wait()
    block = moved.view(local.shape)
    if not _ordered(after.dims, mesh):
        return _Local(block, after)
    return DTensor.from_local(block, device_mesh, placements_of(after, mesh),
                              run_check=False, shape=t.shape, stride=t.stride())  # fmt: skip


def _even(shape: Sequence[int], layout: Sharding, mesh: Mesh) -> bool:
    return all(n % mesh.group_size(a) == 0 for n, a in zip(shape, layout.dims, strict=True))


def _gather(
    held: _Local, kind: str, axes: tuple[str, ...], after: Sharding, t: DTensor, mesh: Mesh
) -> DTensor | None:
    """The all-gather after a permute into an out-of-order layout: ``axes`` (mesh order) are the
    trailing axes of one dim in that order, so gathering the block along that dim on their
    group (ranks in mesh order) gives the block of the layout without them. None when the step
    is anything else or its result is still not a layout DTensor can hold."""
    before = held.layout.dims
    dims = [d for d, (b, a) in enumerate(zip(before, after.dims, strict=True)) if b != a]
    if kind != "all-gather" or len(dims) != 1 or not _ordered(after.dims, mesh):
        return None
    d = dims[0]
    if before[d] != (*after.dims[d], *axes) or after.partial != held.layout.partial:
        return None
    device_mesh: DeviceMesh = t.device_mesh
    group = device_mesh[axes[0]] if len(axes) == 1 else flattened_meshes(device_mesh)[axes]
    split = DTensor.from_local(held.block, group, [Shard(d)], run_check=False)
    block = split.redistribute(placements=[Replicate()]).to_local()
    return DTensor.from_local(block, device_mesh, placements_of(after, mesh),
                              run_check=False, shape=t.shape, stride=t.stride())  # fmt: skip


def permuted_after(
    before: Sequence[Sequence[str]], target: Sequence[Sequence[str]], mesh: Mesh
) -> tuple[tuple[str, ...], ...]:
    """The layout a walk permute of ``before`` leaves: the target when every dim already has
    the target's shard count (``_Walk.permute``), else each dim's target axes first and its
    other axes after them (``_Walk.permute_to_gather``: a gather of the rest follows)."""
    if all(
        mesh.group_size(tuple(b)) == mesh.group_size(tuple(w))
        for b, w in zip(before, target, strict=True)
    ):
        return tuple(tuple(w) for w in target)
    return tuple((*w, *(a for a in b if a not in w)) for b, w in zip(before, target, strict=True))


def _order(dims: Sequence[Sequence[str]], mesh: Mesh) -> tuple[str, ...]:
    """The axes in the order of a device's position in a layout: each dim's axes (shard index,
    major first), then the unused axes in mesh order (replica index)."""
    used = [a for d in dims for a in d]
    return (*used, *(a for a in mesh.axis_names if a not in used))


@dataclass(frozen=True)
class _Pairing:
    """XLA's positional pairing of a collective-permute, for one rank's mesh coordinate."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    before: tuple[str, ...]
    after: tuple[str, ...]
    group: tuple[str, ...]
    """The axes the permute moves along (mesh order): the group it runs on."""

    def _position(self, coordinate: dict[str, int], order: tuple[str, ...]) -> int:
        position = 0
        for axis in order:
            position = position * self.sizes[self.names.index(axis)] + coordinate[axis]
        return position

    def _device(self, position: int, order: tuple[str, ...]) -> dict[str, int]:
        coordinate = {}
        for axis in reversed(order):
            size = self.sizes[self.names.index(axis)]
            coordinate[axis] = position % size
            position //= size
        return coordinate

    def _group_rank(self, coordinate: dict[str, int]) -> int:
        return self._position(coordinate, self.group)

    def splits(self, coordinate: list[int], numel: int) -> list[int]:
        """Output then input split sizes of this rank's ``all_to_all_single`` on the group: its
        block goes whole to the device at its position in the new layout and comes whole from
        the device whose old position is its new one."""
        mine = dict(zip(self.names, coordinate, strict=True))
        to = self._device(self._position(mine, self.before), self.after)
        source = self._device(self._position(mine, self.after), self.before)
        assert all(to[a] == mine[a] == source[a] for a in self.names if a not in self.group)
        size = math.prod(self.sizes[self.names.index(a)] for a in self.group)
        out, inp = [0] * size, [0] * size
        inp[self._group_rank(to)] = numel
        out[self._group_rank(source)] = numel
        return out + inp  # one flat list: per-rank results combine element by element


_R = TypeVar("_R")


def per_rank(fn: Callable[..., _R]) -> Callable[..., _R]:
    """``fn`` run for each rank: under ``LocalTensorMode`` (every rank simulated in one
    process, ``simulate.local_ranks``) per-rank ints (mesh coordinates) are handed to it one
    rank at a time and its int results come back per rank; elsewhere ``fn`` itself.
    Private: ``maybe_run_for_local_tensor`` is how DTensor itself computes rank-dependent
    sizes under that mode; there is no public equivalent."""
    from torch.distributed._local_tensor import maybe_run_for_local_tensor

    return maybe_run_for_local_tensor(fn)
