"""Which link a mesh axis (or a group of axes) talks over.

Decision (DESIGN.md §3, §5): devices are numbered row-major over the mesh axes, and each node
holds ``devices_per_node`` consecutive devices. So the innermost (last) axes are packed inside a
node while the product of sizes, taken from the innermost axis outward, stays within
``devices_per_node``; the axis that pushes past that boundary spans nodes, and so does every axis
outside it. An axis straddling the boundary (``{"x": 8}`` on 4-device nodes) keeps part of itself
in each node: its *local factor* (here 4) is how many of its members share a node.

A collective over a group of axes is bounded by its slowest link: if any axis in the group spans
nodes the group runs at the inter-node level (max alpha). Ring collectives there run one ring per
NIC in parallel (NCCL uses one ring per NIC), so with ``k`` group members in each node the bus
bandwidth is ``min(k, nics_per_node) * nic_bw``, capped by the intra-node bus bandwidth (ref §3:
"multi-node ring AR <= #NICs x per-NIC, also capped by NVLink"). A dp-only axis with tp filling
the node has ``k = 1`` and gets one NIC's worth, ~48 GB/s on H100.

Islands (``Cluster.islands``, Pathways): above the nodes, islands of ``devices`` consecutive
devices are joined by a DCN. The same row-major packing decides which axes span islands (an axis
may straddle the boundary). A group that spans islands gets a hierarchical ``GroupLink``: its
``inner`` link is the part of the group inside one island (``inner_size`` members, priced by the
levels below) and its own alpha/bandwidths are the DCN's per-device share. How a collective
uses the two parts (reduce-scatter inside, all-reduce across, all-gather inside) is in
``collectives.py``. Clusters without islands get exactly the two-level links above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from shardplan.ir.axes import parse_axis
from shardplan.ir.mesh import Mesh

from .cluster import Cluster, island_level_name

INTRA_NODE = "intra-node"
INTER_NODE = "inter-node"
INTER_ISLAND = island_level_name(0)


@dataclass(frozen=True, slots=True)
class GroupLink:
    """How one collective group of devices communicates."""

    level: str
    """``"intra-node"`` or ``"inter-node"``."""
    latency: float
    """Alpha in seconds."""
    ring_bandwidth: float
    """Bus bandwidth (bytes/s) of ring collectives: all-gather, reduce-scatter, all-reduce."""
    p2p_bandwidth: float
    """Per-device bytes/s for all-to-all and collective-permute (no NIC aggregation)."""
    inner: GroupLink | None = None
    """For a group spanning islands: the link of its part inside one island."""
    inner_size: int = 1
    """Members of the group inside one island (``inner``'s group size)."""


def local_factors(mesh: Mesh, devices_per_node: int) -> dict[str, int]:
    """Per axis, how many of its coordinates share one node (its size when it fits inside)."""
    factors: dict[str, int] = {}
    room = devices_per_node
    for name, size in reversed(mesh.axes):
        inside = math.gcd(size, room)
        factors[name] = inside
        room //= inside
        if inside < size:  # this axis crossed the node boundary; everything outside is remote
            room = 1
    return factors


def in_domain(axis: str, factors: dict[str, int], mesh: Mesh) -> int:
    """Members of ``axis`` inside one domain, given each whole axis's local factor.

    A sub-axis ``x:(p)s`` steps through ``x`` with stride ``m = size(x) / (p * s)`` (row-major
    numbering); the domain holds the minor ``L = factors[x]`` coordinates of ``x``, so
    ``L / m`` of its members when ``m < L`` (at most ``s``), else one."""
    if ":" not in axis:
        return factors[axis]
    base, pre, size = parse_axis(axis)
    assert size is not None
    stride = mesh.axis_size(base) // (pre * size)
    return max(1, min(size, factors[base] // stride))


def axis_links(mesh: Mesh, cluster: Cluster) -> dict[str, str]:
    """Map each mesh axis to the outermost level it spans (see the module docstring):
    ``"intra-node"``, ``"inter-node"``, or ``"inter-island"`` (``-2`` ... for deeper levels)."""
    out = {}
    for name, size in mesh.axes:
        level = INTRA_NODE
        for domain, outer in _domains(cluster):
            fits = outer != INTER_NODE and mesh.size <= domain  # the mesh sits in one island
            if not fits and local_factors(mesh, domain)[name] < size:
                level = outer
        out[name] = level
    return out


def _domains(cluster: Cluster) -> list[tuple[int, str]]:
    """``(devices per domain, level crossed when a group leaves it)``, innermost first."""
    sizes = [cluster.devices_per_node] + [level.devices for level in cluster.islands]
    names = [INTER_NODE] + [island_level_name(i) for i in range(len(cluster.islands))]
    return list(zip(sizes, names, strict=True))


def island_members(axes: tuple[str, ...], mesh: Mesh, devices_per_island: int) -> int:
    """Members of a group over ``axes`` inside one island of ``devices_per_island`` devices
    (the whole group when the mesh fits in one island: devices are numbered from 0)."""
    if mesh.size <= devices_per_island:
        return mesh.group_size(axes)
    factors = local_factors(mesh, devices_per_island)
    return math.prod(in_domain(a, factors, mesh) for a in axes)


@lru_cache(maxsize=65536)
def group_link(axes: tuple[str, ...], mesh: Mesh, cluster: Cluster) -> GroupLink:
    """The link a collective over ``axes`` runs on, with its alpha and bandwidths."""
    n = mesh.group_size(axes)
    # Members inside one domain per level: [node, island 0, island 1, ...].
    factors = local_factors(mesh, cluster.devices_per_node)  # nodes: as before islands existed
    counts = [math.prod(in_domain(a, factors, mesh) for a in axes)]
    counts += [island_members(axes, mesh, level.devices) for level in cluster.islands]
    return _link(tuple(counts), n, cluster)


def _link(counts: tuple[int, ...], n: int, cluster: Cluster) -> GroupLink:
    """The link of ``n`` members with ``counts[i]`` of them in one domain of level ``i``."""
    for index in range(len(counts) - 1, 0, -1):  # the outermost island boundary crossed
        inside = counts[index]
        if inside < n:
            dcn = cluster.islands[index - 1].link
            inner = _link(counts[:index], inside, cluster)
            name = island_level_name(index - 1)
            return GroupLink(name, dcn.latency, dcn.bandwidth, dcn.bandwidth, inner, inside)
    intra = cluster.intra_node
    members_per_node = counts[0]
    if members_per_node >= n:
        return GroupLink(INTRA_NODE, intra.latency, intra.bandwidth, intra.bandwidth)
    rings = min(members_per_node, cluster.nics_per_node)
    ring_bw = min(rings * cluster.inter_node.bandwidth, intra.bandwidth)
    return GroupLink(INTER_NODE, cluster.inter_node.latency, ring_bw, cluster.all_to_all_bandwidth)
