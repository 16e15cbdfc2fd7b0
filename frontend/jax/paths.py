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

from ...costmodel.collective import Collective
from ...ir import Sharding, ShardplanError


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


def pinned_layouts(
    src: Sharding, dst: Sharding, collectives: Sequence[Collective]
) -> list[Sharding]:
    """The non-partial layouts after each collective of a reshard, ending with ``dst``.

    Partial layouts are left out: ``Auto`` mode cannot express a pending sum.
    """
    steps = replay(src, dst, collectives) or [dst]
    return [s for s in steps if not s.partial]


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
