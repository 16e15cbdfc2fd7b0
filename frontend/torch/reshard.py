"""Reshard a DTensor by the collectives the plan priced, one at a time.

``DTensor.redistribute`` picks its own collectives: one per mesh dimension in its canonical
order, an all-gather where the cost model moves a split with an all-to-all. The follower
replays the cost model's walk instead (``costmodel.reshard.reshard_steps``): all-gathers,
reduce-scatters and all-reduces over a group of axes go through ``redistribute`` (one
collective on the flattened mesh, ``emit.flattened_meshes``); an all-to-all is run on the
group's own 1-D mesh, where DTensor's ``Shard(i) -> Shard(j)`` is exactly one all-to-all, and
so is a reduce-scatter over several axes (``redistribute`` runs ``Partial -> Shard(d)`` over
two mesh dims as an all-reduce over the minor one and a reduce-scatter over the major one).
Steps whose layouts DTensor cannot hold (axes out of mesh order) and collective-permutes are
left to ``redistribute`` from there to the target (counted as a deviation by the caller).
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard

from ...costmodel.reshard import reshard_steps
from ...ir import Mesh, Sharding
from . import emit  # a module import: emit -> follow -> this module


def sharding_of(placements: emit.Placements, mesh: Mesh, rank: int) -> Sharding:
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


def reshard(t: DTensor, want: emit.Placements, mesh: Mesh | None = None) -> tuple[DTensor, bool]:
    """``t`` at ``want`` by the cost model's collectives; the flag says whether every step
    ran as priced (False: the rest was left to ``redistribute``). ``mesh``: the plan mesh
    (default: one made from ``t``'s device mesh)."""
    if mesh is None:
        names = tuple(t.device_mesh.mesh_dim_names or ())
        mesh = Mesh(dict(zip(names, t.device_mesh.shape, strict=True)))
    src = sharding_of(tuple(t.placements), mesh, t.ndim)
    dst = sharding_of(want, mesh, t.ndim)
    partial = set(src.partial)
    for kind, axes, layout in reshard_steps(src, dst, mesh):
        if kind in ("all-reduce", "reduce-scatter"):
            partial -= set(axes)
        if kind == "collective-permute" or not _ordered(layout, mesh):
            return t.redistribute(placements=want), False
        after = Sharding(layout, frozenset(partial))
        if kind == "all-to-all":
            moved = _all_to_all(t, axes, after, mesh)
            if moved is None:
                return t.redistribute(placements=want), False
            t = moved
        elif kind == "reduce-scatter" and len(axes) > 1:
            moved = _reduce_scatter(t, axes, after, mesh)
            if moved is None:
                return t.redistribute(placements=want), False
            t = moved
        else:
            t = t.redistribute(placements=emit.placements_of(after, mesh))
    if tuple(t.placements) != tuple(want):
        t = t.redistribute(placements=want)  # local slices only (the walk ends in them)
    return t, True


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
    group = emit.flattened_meshes(t.device_mesh)[axes]
    local = DTensor.from_local(t.to_local(), group, [Partial(op)], run_check=False)
    moved = local.redistribute(placements=[Shard(target)]).to_local()
    return DTensor.from_local(moved, t.device_mesh, emit.placements_of(after, mesh),
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
    staged = emit.placements_of(Sharding(tuple(dims), after.partial), mesh)
    if tuple(t.placements) != staged:
        t = t.redistribute(placements=staged)  # free slices of the other axes
    group = device_mesh[axes[0]] if len(axes) == 1 else emit.flattened_meshes(device_mesh)[axes]
    local = DTensor.from_local(t.to_local(), group, [Shard(source.dim)], run_check=False)
    moved = local.redistribute(placements=[Shard(target)]).to_local()
    placements = emit.placements_of(after, mesh)
    return DTensor.from_local(moved, device_mesh, placements, run_check=False,
                              shape=t.shape, stride=t.stride())  # fmt: skip
