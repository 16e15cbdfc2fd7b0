"""Per-device memory of values under a sharding (helpers; memory planning builds on them)."""

from __future__ import annotations

from collections.abc import Iterable

from shardplan.ir.mesh import Mesh
from shardplan.ir.sharding import Sharding
from shardplan.ir.types import TensorType


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
