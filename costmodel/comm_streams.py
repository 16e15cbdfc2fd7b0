"""The link a planned reshard's collectives ride: the communication stream it queues on.

NCCL gives every process group its own communicator and CUDA stream, so tensor-parallel,
FSDP, expert and pipeline collectives run concurrently. What they contend for is the link
under them: the NVLink switch inside a node, the NICs between nodes, the DCN between islands.
The step simulation (``simulate.py``) keeps one communication clock per link: collectives on
different links overlap each other, collectives on one link take turns at its whole bandwidth
(the same total time as sharing it, ref §3 "Measured collective bandwidth": busbw is what one
collective gets alone). A group that leaves its node is bounded by its NIC share, so it is
priced on the outermost link it crosses.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardplan.ir.mesh import Mesh

from .cluster import Cluster
from .collectives import Collective, normalize_axes
from .links import INTER_NODE, INTRA_NODE, group_link

LOCAL = ""
"""The link key of a reshard with no collective over any axis (a local slice)."""


def link_rank(level: str) -> int:
    """Order of link levels from the innermost: none -1, intra-node 0, inter-node 1,
    inter-island 2, inter-island-k k + 1 (``cluster.island_level_name``)."""
    if level in (LOCAL, INTRA_NODE, INTER_NODE):
        return (LOCAL, INTRA_NODE, INTER_NODE).index(level) - 1
    _, _, depth = level.partition("inter-island-")
    return int(depth) + 1 if depth else 2


def reshard_link(collectives: Sequence[Collective], mesh: Mesh, cluster: Cluster) -> str:
    """The outermost link level any of ``collectives`` crosses (``LOCAL`` for none)."""
    levels = [
        group_link(normalize_axes(c.axes, mesh), mesh, cluster).level
        for c in collectives
        if c.axes and mesh.group_size(c.axes) > 1
    ]
    return max(levels, key=link_rank, default=LOCAL)


__all__ = ["LOCAL", "link_rank", "reshard_link"]
