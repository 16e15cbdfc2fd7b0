"""Logical device mesh: ordered named axes (outer/major first)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ShardingError


@dataclass(frozen=True, slots=True, init=False)
class Mesh:
    """An ordered set of named mesh axes and the cluster the devices belong to.

    Invariants:
      - axis names are unique identifiers, sizes are >= 1;
      - order is major -> minor (row-major device numbering); the cost model maps the
        innermost axes inside a node and the outer ones across nodes.

    Example: ``Mesh({"dp": 8, "tp": 8}, cluster="h100-sxm")`` prints as ``<["dp"=8, "tp"=8]>``.
    ``cluster=`` is a catalogue name or a cluster object (``costmodel.Cluster``): a mesh built
    with the object holds it (``hardware``), so it plans on that cluster without any registry
    (``costmodel.cluster.cluster_of(mesh)`` is the one place a mesh's cluster is read).
    """

    axes: tuple[tuple[str, int], ...]
    """(name, size) pairs, major to minor."""
    cluster: str
    """Name of a cluster in the cost-model catalogue (or a user cluster registered there);
    without ``cluster=`` it is ``validate.DEFAULT_CLUSTER`` (``h100-sxm``), the default of every
    way of writing a mesh (a dict ``mesh=``, ``devices=N``, the CLI)."""
    cluster_given: bool = field(default=True, compare=False, repr=False)
    """Whether ``cluster=`` was passed (when not, ``sp.plan(..., cluster=...)`` picks it)."""
    hardware: Any = field(default=None, compare=False, repr=False)
    """The resolved cluster object when one was passed (or an entry point resolved the name),
    else ``None`` (looked up by ``cluster`` name). Duck-typed here: the IR does not import the
    cost model. Not compared nor hashed: ``cluster`` (its name) stands for it in equality,
    printing and plan files."""
    _index: dict[str, tuple[int, int]] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    """name -> (position, size): the planner asks an axis's size millions of times."""
    _names: tuple[str, ...] = field(default=(), init=False, compare=False, repr=False)
    """The axis names, major to minor (asked as often as the sizes)."""

    def __init__(
        self,
        axes: Mapping[str, int] | Iterable[tuple[str, int]],
        cluster: Any = None,
    ) -> None:
        from .checks import DEFAULT_CLUSTER, mesh_axes

        name, hardware = _cluster_name(cluster)
        object.__setattr__(self, "axes", mesh_axes(axes))
        object.__setattr__(self, "cluster", name or DEFAULT_CLUSTER)
        object.__setattr__(self, "cluster_given", cluster is not None)
        object.__setattr__(self, "hardware", hardware)
        index = {name: (i, size) for i, (name, size) in enumerate(self.axes)}
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_names", tuple(name for name, _ in self.axes))

    def with_axes(self, axes: Mapping[str, int] | Iterable[tuple[str, int]]) -> Mesh:
        """A mesh of other axes on the same cluster (the held object too, when there is one)."""
        mesh = Mesh(axes, cluster=self.hardware if self.hardware is not None else self.cluster)
        object.__setattr__(mesh, "cluster_given", self.cluster_given)
        return mesh

    @property
    def axis_names(self) -> tuple[str, ...]:
        return self._names

    @property
    def shape(self) -> dict[str, int]:
        return dict(self.axes)

    @property
    def size(self) -> int:
        return math.prod(size for _, size in self.axes)

    def axis_size(self, name: str) -> int:
        """Size of a mesh axis, or of a sub-axis ``x:(pre)size`` of one (``ir/axes.py``)."""
        found = self._index.get(name)
        if found is not None:
            return found[1]
        if ":" in name:
            return self._sub_axis_size(name)
        raise ShardingError(
            f"unknown mesh axis {name!r}; the mesh has axes {list(self.axis_names)}"
        )

    def _sub_axis_size(self, name: str) -> int:
        from .axes import parse_axis

        base, pre, size = parse_axis(name)
        full = self.axis_size(base)
        assert size is not None
        if full % (pre * size) or size == full:
            raise ShardingError(
                f"sub-axis {name!r} does not fit mesh axis {base!r} of size {full}: pre-size "
                f"x size ({pre}x{size}) must divide {full} and the size must be less than it"
            )
        return size

    def group_size(self, names: Iterable[str]) -> int:
        """Number of devices in one group spanning the given axes."""
        index, size = self._index, 1
        for name in names:
            found = index.get(name)
            size *= found[1] if found is not None else self.axis_size(name)  # raises if unknown
        return size

    def axis_index(self, name: str) -> int:
        """Position of an axis (a sub-axis sits at its axis's position)."""
        found = self._index.get(name)
        if found is not None:
            return found[0]
        if ":" in name:
            self.axis_size(name)  # raises unless the sub-axis fits
            return self._index[name.split(":", 1)[0]][0]
        self.axis_size(name)  # raises the unknown-axis error
        return -1

    def __str__(self) -> str:
        return "<[" + ", ".join(f'"{name}"={size}' for name, size in self.axes) + "]>"

    def __repr__(self) -> str:
        return f"Mesh({dict(self.axes)!r}, cluster={self.cluster!r})"


def _cluster_name(cluster: Any) -> tuple[str | None, Any]:
    """(the name, the held object) of ``cluster=``: a catalogue name, or a cluster object (one
    with a ``name`` and ``devices_per_node``: ``costmodel.Cluster``, duck-typed)."""
    if cluster is None or (isinstance(cluster, str) and cluster):
        return cluster, None
    name = getattr(cluster, "name", None)
    if isinstance(name, str) and name and hasattr(cluster, "devices_per_node"):
        return name, cluster
    raise ShardingError(
        f"cluster= must be a catalogue name like 'h100-sxm' or a Cluster object "
        f"(shardplan.costmodel.Cluster), got {cluster!r}"
    )
