"""The layouts a planned reshard passes through, so the emitter can pin every step.

XLA, given only the two ends of a reshard, may choose another route than the plan's (one
all-to-all over two axes instead of two, an all-reduce of the whole tensor before a gather
instead of after, or a full rematerialization). Pinning the layout after each planned
collective leaves XLA one collective per step. The replay below reads each collective as a
layout transition (Shardy's algebra) and applies free local slices in between, as the cost
model's walk does; if the replay does not land on the target it gives up (just the target).
"""

from __future__ import annotations

from collections.abc import Sequence

from ...costmodel.collectives import Collective
from ...costmodel.reshard import reshard_steps
from ...ir import Mesh, Sharding, ShardplanError


class _Layout:
    def __init__(self, src: Sharding, dst: Sharding) -> None:
        self.dims = [list(axes) for axes in src.dims]
        self.partial = set(src.partial)
        self.target = dst
        self.home = {a: d for d, axes in enumerate(dst.dims) for a in axes}

    def sharding(self) -> Sharding:
        return Sharding(tuple(tuple(d) for d in self.dims), frozenset(self.partial))

    def _used(self, axis: str) -> bool:
        return axis in self.partial or any(axis in d for d in self.dims)

    def settle(self) -> None:
        """Free slicing: append each dim's next target axis while it is unused."""
        for d, want in enumerate(self.target.dims):
            while (
                len(self.dims[d]) < len(want)
                and list(want[: len(self.dims[d])]) == self.dims[d]
                and not self._used(want[len(self.dims[d])])
            ):
                self.dims[d].append(want[len(self.dims[d])])

    def _remove(self, axes: Sequence[str]) -> None:
        for d in self.dims:
            d[:] = [a for a in d if a not in axes]

    def apply(self, collective: Collective) -> None:
        axes = list(collective.axes)
        match collective.kind:
            case "all-reduce":
                self.partial -= set(axes)
            case "reduce-scatter":
                self.partial -= set(axes)
                self.dims[self.home[axes[0]]].extend(axes)
            case "all-to-all":
                self._remove(axes)
                self.dims[self.home[axes[0]]].extend(axes)
            case "all-gather":
                self._remove(axes)
            case "collective-permute":
                self.dims = [list(axes) for axes in self.target.dims]
        self.settle()


def replay(
    src: Sharding, dst: Sharding, collectives: Sequence[Collective]
) -> list[Sharding] | None:
    """The layout after each collective of a reshard, or None if the replay misses ``dst``."""
    layout = _Layout(src, dst)
    steps: list[Sharding] = []
    try:
        layout.settle()
        for collective in collectives:
            layout.apply(collective)
            steps.append(layout.sharding())
    except (KeyError, ValueError, ShardplanError):
        return None
    return steps if steps and steps[-1] == dst else None


def walk_layouts(
    src: Sharding, dst: Sharding, collectives: Sequence[Collective], mesh: Mesh
) -> list[Sharding] | None:
    """Every layout the cost model's walk passes through, in order, ending with ``dst``: before
    each collective (after the free slices that precede it, including a permute's staged
    slices) and right after it. None when the walk does not give ``collectives``.

    Pinning each one leaves XLA one step per constraint: a slice to a sub-tiling (a local
    dynamic-slice) or exactly the priced collective. Given a partially replicated layout and a
    target that is no sub-tiling of it, XLA's partitioner slices to a tiling of the target's
    shape and then permutes (``[{"dp"}, {}] -> [{"tp"}, {"dp"}]``: one permute where the walk
    priced an all-to-all of ``dp`` then a slice of ``tp``; ``[{"tp"}] -> [{"tp", "fsdp"}]``
    with ``dp`` free: its slice takes the major free axis ``dp`` and permutes), so the
    layouts between the walk's collectives must be pinned too.
    """
    steps = reshard_steps(src, dst, mesh)
    if [(k, tuple(a)) for k, a, _ in steps] != [(c.kind, tuple(c.axes)) for c in collectives] and [
        (k, tuple(a)) for k, a, _ in steps
    ] != [(c.kind, _mesh_order(c.axes, mesh)) for c in collectives]:
        return None
    layout = _Layout(src, dst)
    out: list[Sharding] = []

    def push(dims: Sequence[Sequence[str]]) -> None:
        sharding = Sharding(tuple(tuple(d) for d in dims), frozenset(layout.partial))
        if not out or out[-1] != sharding:
            out.append(sharding)

    layout.settle()
    for kind, axes, after in steps:
        push(layout.dims)  # after the free slices since the last collective
        if kind == "collective-permute":
            push(after)  # a permute's layout is the one it moves (its staged slices)
            layout.dims = _permuted(after, dst.dims, mesh)
        elif kind in ("all-reduce", "reduce-scatter"):
            layout.partial -= set(axes)
            layout.dims = [list(d) for d in after]
        else:
            layout.dims = [list(d) for d in after]
        push(layout.dims)
        layout.settle()
    push(layout.dims)
    if out[-1] != dst:
        return None
    return out


def _mesh_order(axes: Sequence[str], mesh: Mesh) -> tuple[str, ...]:
    return tuple(a for a in mesh.axis_names if a in axes)


def _permuted(
    staged: Sequence[Sequence[str]], target: Sequence[Sequence[str]], mesh: Mesh
) -> list[list[str]]:
    """The layout after a walk permute of ``staged``: the target when every dim already has
    the target's shard count, else (permute, then gather) the target's axes first, the rest
    after them (``costmodel.reshard._Walk.permute_to_gather``)."""
    if all(
        mesh.group_size(tuple(c)) == mesh.group_size(tuple(t))
        for c, t in zip(staged, target, strict=True)
    ):
        return [list(t) for t in target]
    return [list(t) + [a for a in c if a not in t] for c, t in zip(staged, target, strict=True)]


def pinned_layouts(
    src: Sharding,
    dst: Sharding,
    collectives: Sequence[Collective],
    mesh: Mesh | None = None,
    partial: bool = False,
) -> list[Sharding]:
    """The layouts a reshard passes through, ending with ``dst``: with ``mesh``, every layout
    of the cost model's walk (``walk_layouts``); without it, or when the walk does not give
    these collectives, the layout after each collective (``replay``).

    Partial layouts are left out unless ``partial``: ``Auto`` mode cannot express a pending
    sum, but the emitter's explicit one (``pending.Pending``) can, and a staged reduction
    (reduce-scatter over some partial axes, then all-reduce over the rest) needs its middle
    layout pinned, or the sum is reduced in one step.
    """
    steps = walk_layouts(src, dst, collectives, mesh) if mesh is not None else None
    steps = steps or replay(src, dst, collectives) or [dst]
    return [s for s in steps if (partial or not s.partial) and s != src]


def distinct_collectives(reshards: Sequence[object]) -> list[Collective]:
    """The plan's collectives with repeats of the same step on the same value counted once.

    Two consumers that need one value in the same layout share the reshard in XLA (its CSE
    merges the identical constraint chains), while the plan lists one reshard per edge. A step
    is identified by the value, its source layout and the layouts it has passed through.
    """
    seen: set[tuple[object, ...]] = set()
    out: list[Collective] = []
    for r in reshards:
        steps = replay(r.src, r.dst, r.collectives)  # type: ignore[attr-defined]
        for k, collective in enumerate(r.collectives):  # type: ignore[attr-defined]
            path = tuple(steps[: k + 1]) if steps else (r.dst, k)  # type: ignore[attr-defined]
            key = (r.value, r.src, path)  # type: ignore[attr-defined]
            if key not in seen:
                seen.add(key)
                out.append(collective)
    return out
