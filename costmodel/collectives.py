"""Collectives: the priced ``Collective`` (the unit the cost model, the plan and the checkers all
speak) and the alpha-beta times of collectives over groups of mesh axes.

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

An all-to-all sends one message of ``out / n`` bytes to each of its ``n - 1`` peers, all at
once. Inside one node every message rides NVLink: ``(n-1)/n * out / bw_intra``. A group with
``k`` members in each node sends ``k - 1`` messages over NVLink and ``n - k`` through the
device's one NIC, concurrently, so the slower share bounds it:
``max((k-1)/n * out / bw_intra, (n-k)/n * out / bw_nic)`` (MoE dispatch and combine: the
expert axis inside a node costs NVLink time only; each node added moves more of the buffer
onto the NIC).

**Groups spanning islands** (``Cluster.islands``; the link has an ``inner`` part of ``m``
members per island, ``k = n / m`` islands, DCN alpha ``a_d`` and per-device bandwidth ``d``) are
priced hierarchically, the way a two-level NCCL/XLA collective runs over a slow DCN: only
``1/m`` of the data crosses islands per device, each in-island member carrying its own shard.

| kind               | time                                                               |
|--------------------|--------------------------------------------------------------------|
| all-reduce         | RS_inner(out / m) + [a_d + 2(k-1)/k * (out/m) / d] + AG_inner(out)  |
| all-gather         | [a_d + (k-1)/k * (out/m) / d] + AG_inner(out)                       |
| reduce-scatter     | RS_inner(k * out) + [a_d + (k-1)/k * k * out / d]                   |
| all-to-all         | A2A_inner(out * m / n) + [a_d + (n-m)/n * out / d]                  |
| collective-permute | a_d + out / d (the whole buffer may cross islands)                  |

``X_inner(r)`` is the in-island collective with per-device result ``r`` over ``m`` members
(itself hierarchical when there are deeper levels). Clusters without islands keep the flat
formulas above unchanged.

**Serving engines** (``Cluster.engine`` ``cuda_graph`` or ``fused``): a ring collective inside
one node is priced with NCCL's protocol latencies instead of the flat alpha (``nccl.py``: LL,
LL128 or Simple, whichever is least; the latency grows with the ring's ``2(n-1)`` steps). The
``eager`` clusters keep the table above.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from shardplan.ir.axes import parse_axis
from shardplan.ir.errors import ArgumentError
from shardplan.ir.mesh import Mesh

from .cluster import Cluster, cluster_of, get_cluster
from .links import INTRA_NODE, GroupLink, group_link, in_domain, local_factors
from .nccl import RING_KINDS, ring_time

COLLECTIVE_KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective over a group of mesh axes.

    ``bytes`` is per device and is the size of the collective's *result* on one device, the
    way compiled HLO shows it: all-gather -> the gathered tensor, reduce-scatter -> the
    scattered shard, all-reduce / all-to-all / collective-permute -> the local tensor.
    """

    kind: str
    axes: tuple[str, ...]
    bytes: int
    time: float = 0.0
    """Modelled seconds on the plan's cluster."""

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVE_KINDS:
            raise ArgumentError(f"unknown collective kind {self.kind!r}; one of {COLLECTIVE_KINDS}")

    def __str__(self) -> str:
        axes = ",".join(self.axes)
        return f"{self.kind}[{axes}] {self.bytes} B ({self.time * 1e6:.1f} us)"


def normalize_axes(axes: str | Iterable[str], mesh: Mesh) -> tuple[str, ...]:
    """Axes as a tuple in mesh order (major to minor), so equal groups hash equal."""
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    return _normalized(names, mesh)


@lru_cache(maxsize=1 << 14)
def _normalized(names: tuple[str, ...], mesh: Mesh) -> tuple[str, ...]:
    """``normalize_axes`` of a tuple (cached: the pricing asks the same few groups ~10^5 times)."""
    for name in names:
        mesh.axis_size(name)  # raises ShardingError naming the mesh's axes (not cached)
    if any(":" in name for name in names):  # sub-axes sit at their axis, major part first
        return tuple(sorted(set(names), key=lambda a: (mesh.axis_index(a), span_start(a))))
    return tuple(a for a in mesh.axis_names if a in names)


def span_start(name: str) -> int:
    """A sub-axis's pre-size (1 for a whole axis): orders the parts of one axis."""
    return parse_axis(name)[1]


def resolve_cluster(cluster: Cluster | str | None, mesh: Mesh) -> Cluster:
    """``None`` means the mesh's own cluster; a name is looked up in the catalogue."""
    return cluster_of(mesh) if cluster is None else get_cluster(cluster)


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
        raise ArgumentError(f"unknown collective kind {kind!r}; one of {COLLECTIVE_KINDS}")
    group = normalize_axes(axes, mesh)
    n = mesh.group_size(group)
    if n == 1 or nbytes <= 0:
        return 0.0
    resolved = resolve_cluster(cluster, mesh)
    link = group_link(group, mesh, resolved)
    if kind == "all-to-all" and link.inner is None:
        return link.latency + _all_to_all_volume(nbytes, n, group, mesh, link, resolved)
    if resolved.engine != "eager" and link.level == INTRA_NODE and kind in RING_KINDS:
        full = nbytes * n if kind == "reduce-scatter" else nbytes  # S, the full buffer
        return ring_time(kind, float(full), n, link.ring_bandwidth)  # NCCL protocols (nccl.py)
    return _time(kind, float(nbytes), n, link)


def _all_to_all_volume(
    nbytes: float, n: int, group: tuple[str, ...], mesh: Mesh, link: GroupLink, cluster: Cluster
) -> float:
    """Seconds of bandwidth of one all-to-all: per-peer messages of ``nbytes / n``, the ones to
    peers in the same node over NVLink and the others through one NIC, concurrently."""
    if link.level == INTRA_NODE:
        return (n - 1) / n * nbytes / link.p2p_bandwidth
    factors = local_factors(mesh, cluster.devices_per_node)
    k = math.prod(in_domain(a, factors, mesh) for a in group)  # group members in each node
    intra = (k - 1) / n * nbytes / cluster.intra_node.bandwidth
    return max(intra, (n - k) / n * nbytes / link.p2p_bandwidth)


def _time(kind: str, nbytes: float, n: int, link: GroupLink) -> float:
    """Seconds of ``kind`` over ``n`` members on ``link`` (hierarchical when it spans islands)."""
    if n == 1 or nbytes <= 0:
        return 0.0
    if link.inner is not None:
        return _hierarchical_time(kind, nbytes, n, link, link.inner)
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


def _hierarchical_time(kind: str, out: float, n: int, link: GroupLink, inner: GroupLink) -> float:
    """The island-spanning prices of the module docstring's second table."""
    m = link.inner_size
    k = n // m
    across = (k - 1) / k
    match kind:
        case "all-reduce":
            dcn = link.latency + 2 * across * (out / m) / link.ring_bandwidth
            return (
                _time("reduce-scatter", out / m, m, inner)
                + dcn
                + _time("all-gather", out, m, inner)
            )
        case "all-gather":
            dcn = link.latency + across * (out / m) / link.ring_bandwidth
            return dcn + _time("all-gather", out, m, inner)
        case "reduce-scatter":
            dcn = link.latency + across * k * out / link.ring_bandwidth
            return _time("reduce-scatter", k * out, m, inner) + dcn
        case "all-to-all":
            dcn = link.latency + (n - m) / n * out / link.p2p_bandwidth
            return _time("all-to-all", out * m / n, m, inner) + dcn
        case _:  # collective-permute
            return link.latency + out / link.p2p_bandwidth


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
