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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from shardplan.ir.mesh import Mesh

from .cluster import Cluster

INTRA_NODE = "intra-node"
INTER_NODE = "inter-node"


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


def axis_links(mesh: Mesh, cluster: Cluster) -> dict[str, str]:
    """Map each mesh axis to ``"intra-node"`` or ``"inter-node"`` (see the module docstring)."""
    factors = local_factors(mesh, cluster.devices_per_node)
    return {name: INTRA_NODE if factors[name] == size else INTER_NODE for name, size in mesh.axes}


@lru_cache(maxsize=65536)
def group_link(axes: tuple[str, ...], mesh: Mesh, cluster: Cluster) -> GroupLink:
    """The link a collective over ``axes`` runs on, with its alpha and bandwidths."""
    factors = local_factors(mesh, cluster.devices_per_node)
    spans_nodes = any(factors[a] < mesh.axis_size(a) for a in axes)
    intra = cluster.intra_node
    if not spans_nodes:
        return GroupLink(INTRA_NODE, intra.latency, intra.bandwidth, intra.bandwidth)
    members_per_node = math.prod(factors[a] for a in axes)
    rings = min(members_per_node, cluster.nics_per_node)
    ring_bw = min(rings * cluster.inter_node.bandwidth, intra.bandwidth)
    return GroupLink(INTER_NODE, cluster.inter_node.latency, ring_bw, cluster.all_to_all_bandwidth)
