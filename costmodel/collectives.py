"""Alpha-beta times of collectives over groups of mesh axes.

``nbytes`` follows ``Collective.bytes``: the per-device size of the collective's *result*, as
compiled HLO shows it. With ``n`` devices in the group, alpha the link latency and ``bw`` its bus
bandwidth (nccl-tests busbw convention: AR = 2(n-1)/n * S / busbw, AG/RS = (n-1)/n * S / busbw,
with S the full buffer; ref §3 "Measured collective bandwidth"):

| kind               | time                                          | S (full buffer)        |
|--------------------|-----------------------------------------------|------------------------|
| all-gather         | alpha + (n-1)/n * out / bw                    | out (gathered result)  |
| reduce-scatter     | alpha + (n-1)/n * (n * out) / bw              | n * out (the input)    |
| all-reduce         | alpha + 2(n-1)/n * out / bw                   | out                    |
| all-to-all         | alpha + (n-1)/n * out / bw_p2p                | each device keeps 1/n  |
| collective-permute | alpha + out / bw_p2p                          | whole buffer moves     |

``bw_p2p`` is the intra-node bus bandwidth inside a node, and one NIC per device across nodes
(all-to-all traffic does not aggregate NICs; nccl-tests#267). A group of one device, or an
empty buffer, costs nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

from shardplan.ir.mesh import Mesh

from .cluster import Cluster, get_cluster
from .collective import COLLECTIVE_KINDS, Collective
from .links import group_link


def normalize_axes(axes: str | Iterable[str], mesh: Mesh) -> tuple[str, ...]:
    """Axes as a tuple in mesh order (major to minor), so equal groups hash equal."""
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    for name in names:
        mesh.axis_size(name)  # raises ShardingError naming the mesh's axes
    return tuple(a for a in mesh.axis_names if a in names)


def resolve_cluster(cluster: Cluster | str | None, mesh: Mesh) -> Cluster:
    """``None`` means the mesh's own cluster; a name is looked up in the catalogue."""
    return get_cluster(mesh.cluster if cluster is None else cluster)


def collective_time(
    kind: str,
    nbytes: float,
    axes: str | Iterable[str],
    mesh: Mesh,
    cluster: Cluster | str | None = None,
) -> float:
    """Modelled seconds of one collective (formulas in the module docstring).

    Args:
        kind: one of ``COLLECTIVE_KINDS``.
        nbytes: per-device result bytes (``Collective.bytes``).
        axes: the mesh axes forming each group (one name or several).
        mesh: the device mesh.
        cluster: a ``Cluster``, a catalogue name, or ``None`` for ``mesh.cluster``.
    Returns:
        Seconds; 0.0 when the group has one device or the buffer is empty.
    """
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; one of {COLLECTIVE_KINDS}")
    group = normalize_axes(axes, mesh)
    n = mesh.group_size(group)
    if n == 1 or nbytes <= 0:
        return 0.0
    link = group_link(group, mesh, resolve_cluster(cluster, mesh))
    ring = (n - 1) / n
    match kind:
        case "all-gather":
            volume = ring * nbytes / link.ring_bandwidth
        case "reduce-scatter":
            volume = ring * n * nbytes / link.ring_bandwidth
        case "all-reduce":
            volume = 2 * ring * nbytes / link.ring_bandwidth
        case "all-to-all":
            volume = ring * nbytes / link.p2p_bandwidth
        case _:  # collective-permute
            volume = nbytes / link.p2p_bandwidth
    return link.latency + volume


def make_collective(
    kind: str,
    nbytes: int,
    axes: str | Iterable[str],
    mesh: Mesh,
    cluster: Cluster | str | None = None,
) -> Collective:
    """A priced ``Collective`` (axes in mesh order, ``time`` from ``collective_time``)."""
    group = normalize_axes(axes, mesh)
    return Collective(kind, group, int(nbytes), collective_time(kind, nbytes, group, mesh, cluster))
