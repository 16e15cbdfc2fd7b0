"""Tensor shardings in Shardy's form: per-dimension mesh axes plus pending-sum (partial) axes."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .axes import axis_text, first_overlap
from .errors import ShardingError
from .mesh import Mesh
from .types import TensorType


@dataclass(frozen=True, slots=True)
class Sharding:
    """How one tensor is laid out on a mesh.

    ``dims[d]`` lists the mesh axes (major to minor) that split tensor dimension ``d``;
    ``partial`` are axes over which each device holds a pending sum (DTensor ``Partial``,
    JAX ``unreduced``). Mesh axes used nowhere mean the tensor is replicated over them.

    An axis may be a Shardy sub-axis ``"x":(pre)size`` (``ir/axes.py``): propagation through
    a reshape that splits or merges a dimension inside an axis produces them.

    Invariants:
      - an axis appears at most once across all dims and ``partial``, and no two entries
        overlap (an axis and its sub-axes; two disjoint sub-axes of one axis may both be used);
      - shardings are even: each dim size is divisible by the product of its axes
        (uneven splits are refused, not padded: the planner never proposes them and
        the verifier rejects them; see docs/design.md).

    Text form: ``[{"dp"}, {}, {"tp"}]`` or ``[{"dp", "tp"}, {}] partial={"sp"}``.
    """

    dims: tuple[tuple[str, ...], ...]
    partial: frozenset[str] = frozenset()
    _hash: int = field(default=0, init=False, repr=False, compare=False)
    """Cached: shardings key the planner's price and layout tables (millions of lookups)."""

    def __post_init__(self) -> None:
        dims = tuple(tuple(axes) for axes in self.dims)
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "partial", frozenset(self.partial))
        object.__setattr__(self, "_hash", hash((dims, self.partial)))
        used = [axis for axes in dims for axis in axes] + sorted(self.partial)
        if len(set(used)) != len(used):
            dup = sorted({a for a in used if used.count(a) > 1})
            raise ShardingError(
                f"sharding {self} uses mesh axis {dup[0]!r} more than once; "
                "an axis shards at most one dimension"
            )
        if len(used) > 1 and ":" in "".join(used):  # sub-axes (rare): check overlaps
            clash = first_overlap(used)
            if clash is not None:
                raise ShardingError(
                    f"sharding {self} uses {clash[0]!r} and {clash[1]!r}, which overlap (an "
                    "axis and its sub-axis, or overlapping sub-axes); use disjoint parts"
                )

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple:
        """Rebuilt through ``__init__``: string hashes differ between processes."""
        return (Sharding, (self.dims, self.partial))

    @staticmethod
    def replicated(rank: int) -> Sharding:
        return Sharding(((),) * rank)

    @staticmethod
    def of(*dims: str | Sequence[str] | None, partial: Iterable[str] = ()) -> Sharding:
        """PartitionSpec-like constructor: ``Sharding.of("dp", None, ("tp", "sp"))``."""
        norm: list[tuple[str, ...]] = []
        for d in dims:
            if d is None:
                norm.append(())
            elif isinstance(d, str):
                norm.append((d,))
            else:
                norm.append(tuple(d))
        return Sharding(tuple(norm), frozenset(partial))

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def sharded_axes(self) -> frozenset[str]:
        return frozenset(axis for axes in self.dims for axis in axes)

    @property
    def used_axes(self) -> frozenset[str]:
        return self.sharded_axes | self.partial

    @property
    def has_sub_axes(self) -> bool:
        """Whether some entry is a sub-axis ``"x":(pre)size``."""
        return any(":" in axis for axis in self.used_axes)

    @property
    def is_replicated(self) -> bool:
        return not self.used_axes

    def without_partial(self) -> Sharding:
        return Sharding(self.dims)

    def shard_count(self, mesh: Mesh) -> int:
        """Number of distinct shards (devices holding different data) of the tensor."""
        return math.prod(mesh.axis_size(a) for axes in self.dims for a in axes)  # axes unique

    def local_shape(self, type_: TensorType, mesh: Mesh) -> tuple[int, ...]:
        self.check(type_, mesh)
        return tuple(
            size // mesh.group_size(axes) for size, axes in zip(type_.shape, self.dims, strict=True)
        )

    def local_bytes(self, type_: TensorType, mesh: Mesh) -> int:
        return math.prod(self.local_shape(type_, mesh)) * type_.itemsize

    def check(self, type_: TensorType, mesh: Mesh) -> None:
        """Raise ShardingError unless this sharding fits ``type_`` on ``mesh`` evenly."""
        if self.rank != type_.rank:
            raise ShardingError(
                f"sharding {self} has rank {self.rank} but the value {type_} has rank {type_.rank}"
            )
        for axis in self.used_axes:
            mesh.axis_size(axis)
        for d, (size, axes) in enumerate(zip(type_.shape, self.dims, strict=True)):
            split = mesh.group_size(axes)
            if size % split:
                raise ShardingError(
                    f"dimension {d} of {type_} (size {size}) is not divisible by "
                    f"{'x'.join(axes)}={split} in sharding {self}; shard a divisible dimension "
                    "or pad the model"
                )

    def __str__(self) -> str:
        text = "[" + ", ".join("{" + ", ".join(map(axis_text, axes)) + "}" for axes in self.dims)
        text += "]"
        if self.partial:
            text += " partial={" + ", ".join(map(axis_text, sorted(self.partial))) + "}"
        return text

    def __repr__(self) -> str:
        return f"Sharding({self})"


@dataclass(frozen=True, slots=True)
class Pin:
    """A user pin with Shardy's user priority: ``sp.plan(pins={"x": Pin(s, priority=0)})``.

    ``priority`` is Shardy's ``p0``, ``p1``, ...: propagation runs priority by priority (lower
    numbers first), so a lower-numbered pin reaches an open tensor before a higher one can,
    and wins a conflict with it; a pin without a priority (a bare ``Sharding``) counts as
    ``p0``, as in Shardy.
    ``source`` says where the pin comes from (``with_sharding_constraint at f.py:3``) for
    ``shardplan plan --print-ir``; empty means the key it was pinned by.
    """

    sharding: Sharding
    priority: int | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.sharding, Sharding):
            raise ShardingError(
                f"Pin takes a Sharding, got {type(self.sharding).__name__}; "
                'write Pin(Sharding.of("dp", None), priority=0)'
            )
        if self.priority is not None and (
            isinstance(self.priority, bool)
            or not isinstance(self.priority, int)
            or self.priority < 0
        ):
            raise ShardingError(
                f"pin priority must be an int >= 0 (Shardy's p0, p1, ...), got {self.priority!r}"
            )
