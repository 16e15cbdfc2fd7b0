"""Per-device memory: bytes of values under a sharding, and the peak of a live-range profile.

The planner describes a step's memory as items — a value's bytes on one device over a closed
interval of time points (op indices) — and ``memory_profile`` sums them at every time point.
Which items exist (persistent state, activations saved for backward, recomputation) is decided
in ``solver/memory.py`` from the liveness analysis; this module only does the arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shardplan.ir.mesh import Mesh
from shardplan.ir.sharding import Sharding
from shardplan.ir.types import TensorType

CATEGORIES = (
    "parameters",
    "optimizer_states",
    "gradients",
    "parameter_copies",
    "activations",
    "update",
    "inputs",
    "kv_cache",
)
"""Kinds of bytes a breakdown reports (see docs/memory.md for each definition)."""


def value_bytes(type_: TensorType, sharding: Sharding, mesh: Mesh) -> int:
    """Bytes one device holds for a value: its local shard.

    Shardings are even (the IR refuses uneven splits), so this is exact: the global bytes
    divided by the shard count. A partial value holds a full-size addend per device, so partial
    axes do not divide memory.
    """
    return sharding.local_bytes(type_, mesh)


def total_value_bytes(values: Iterable[tuple[TensorType, Sharding]], mesh: Mesh) -> int:
    """Sum of ``value_bytes`` over ``(type, sharding)`` pairs, e.g. all parameters."""
    return sum(value_bytes(type_, sharding, mesh) for type_, sharding in values)


def fits(nbytes: int, capacity: int, headroom: float = 0.0) -> bool:
    """Whether ``nbytes`` fit in ``capacity`` keeping a ``headroom`` fraction free."""
    return nbytes <= capacity * (1.0 - headroom)


@dataclass(frozen=True, slots=True)
class MemoryItem:
    """``nbytes`` on every device from time ``start`` to ``stop`` (both included)."""

    label: str
    """The value's name (``%w1``), for the largest-contributor list."""
    category: str
    start: int
    stop: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    """Peak of a profile and what is live at it.

    Invariants: ``peak == sum(by_category.values())``; ``top`` is sorted by bytes, largest
    first, and lists values live at ``peak_time``.
    """

    peak: int
    peak_time: int
    by_category: dict[str, int]
    top: tuple[tuple[str, str, int], ...]
    """(label, category, bytes) of the largest items live at the peak."""

    def __getitem__(self, kind: str) -> int:
        """Bytes of one kind at the peak: ``plan.memory_breakdown()["kv_cache"]``."""
        if kind in self.by_category:
            return self.by_category[kind]
        if kind in CATEGORIES:  # a kind nothing of which is live at the peak
            return 0
        known = ", ".join(sorted({*CATEGORIES, *self.by_category}))
        raise KeyError(f"no memory kind {kind!r}; kinds: {known}")

    def __contains__(self, kind: object) -> bool:
        return kind in self.by_category or kind in CATEGORIES

    def keys(self):  # type: ignore[no-untyped-def]
        """The memory kinds (``dict(profile.items())`` is ``by_category``)."""
        return self.by_category.keys()

    def items(self):  # type: ignore[no-untyped-def]
        return self.by_category.items()

    def describe(self, count: int = 5) -> str:
        """``%w1 (parameters) 1.000 GiB, ...`` for error messages and reports."""
        return ", ".join(f"{name} ({kind}) {gib(n)}" for name, kind, n in self.top[:count])


def memory_profile(items: Sequence[MemoryItem], end: int, top: int = 10) -> MemoryProfile:
    """Sum the items at every time point 0..end (a difference array) and describe the peak.

    Ties go to the earliest time point, so the result is deterministic.
    """
    delta = [0] * (end + 2)
    for item in items:
        if item.nbytes and item.start <= item.stop:
            delta[max(item.start, 0)] += item.nbytes
            delta[min(item.stop, end) + 1] -= item.nbytes
    live, peak, peak_time = 0, 0, 0
    for t in range(end + 1):
        live += delta[t]
        if live > peak:
            peak, peak_time = live, t
    at_peak = [i for i in items if i.nbytes and i.start <= peak_time <= i.stop]
    by_category = {kind: 0 for kind in CATEGORIES}
    for item in at_peak:
        by_category[item.category] = by_category.get(item.category, 0) + item.nbytes
    ranked = sorted(at_peak, key=lambda i: (-i.nbytes, i.label))[:top]
    return MemoryProfile(
        peak,
        peak_time,
        {k: n for k, n in by_category.items() if n},
        tuple((i.label, i.category, i.nbytes) for i in ranked),
    )


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.3f} GiB"
