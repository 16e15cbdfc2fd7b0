"""Table-wise placement: a whole embedding table on one group of devices (not SPMD).

A table-wise table lives whole on the devices whose position along ``axes`` (their flattened
group, major axis first) is ``owner``; on the others it is absent. Its lookups run there for
the bags of that position's batch share (the whole batch when ``axes`` are every axis the bags
split over); the pooled rows are then scattered to the devices that consume them, split over
their bags along ``axes`` (an all-to-all on that group: the owner sends a slice to each,
the others send nothing), and in backward the bags' gradient comes back to the owner the
reverse way. The table's gradient and optimizer state exist only on the owner: no gradient
all-reduce over ``axes``.

In the plan's SPMD layouts a table-wise table reads as a data-parallel one (the table whole,
the lookup's result split over its bags on ``axes``); its ``TableOwner`` says where it lives,
which the layouts cannot::

    TableOwner(table="emb_0_weight", module="emb.0", axes=("dp",), owner=3)
    # emb.0's table, its gradient and its optimizer state live on dp = 3 only

**Invariants**: ``axes`` is non-empty, without repeats; ``0 <= owner < group size of axes``
(``check`` against a mesh).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ShardingError
from .mesh import Mesh


@dataclass(frozen=True, slots=True)
class TableOwner:
    """Where one table-wise table lives (module docstring)."""

    table: str
    """Name of the table's graph input value (its parameter)."""
    module: str
    """Module path of the table (``"emb.0"``), for reports and the emitters."""
    axes: tuple[str, ...]
    """Mesh axes the tables are placed along (mesh order): one group of them owns the table."""
    owner: int
    """The owning position along ``axes`` (flattened, major axis first)."""

    def __post_init__(self) -> None:
        if not self.axes or len(set(self.axes)) != len(self.axes):
            raise ShardingError(
                f"table {self.module!r}: table-wise axes {list(self.axes)} must be one or more "
                "distinct mesh axes"
            )
        if self.owner < 0:
            raise ShardingError(f"table {self.module!r}: owner {self.owner} is negative")

    def check(self, mesh: Mesh) -> None:
        """Raise ``ShardingError`` when the axes are not the mesh's or the owner is out of range."""
        for axis in self.axes:
            if axis not in mesh.axis_names:
                raise ShardingError(
                    f"table {self.module!r} is placed along {axis!r}, not an axis of {mesh} "
                    f"(axes {list(mesh.axis_names)})"
                )
        groups = mesh.group_size(self.axes)
        if self.owner >= groups:
            raise ShardingError(
                f"table {self.module!r}: owner {self.owner} out of range; {'x'.join(self.axes)} "
                f"has {groups} positions (0..{groups - 1})"
            )

    def owns(self, coordinate: dict[str, int], mesh: Mesh) -> bool:
        """Whether the device at ``coordinate`` (axis -> index) holds the table."""
        return position(coordinate, self.axes, mesh) == self.owner


def position(coordinate: dict[str, int], axes: tuple[str, ...], mesh: Mesh) -> int:
    """A device's position in the flattened group of ``axes`` (major axis first)."""
    index = 0
    for axis in axes:
        index = index * mesh.axis_size(axis) + coordinate[axis]
    return index
