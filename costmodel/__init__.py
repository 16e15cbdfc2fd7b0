"""Cost model: cluster catalogue, compute roofline, collectives, resharding, memory."""

from __future__ import annotations

from .catalogue import CLUSTERS
from .cluster import (
    Cluster,
    ClusterConfigError,
    IslandLevel,
    LinkLevel,
    UnknownClusterError,
    cluster_from_dict,
    cluster_of,
    get_cluster,
    known_clusters,
    load_cluster,
    nchw_convolutions,
    peak_table,
    register_cluster,
    tf32_matmuls,
)
from .collectives import COLLECTIVE_KINDS, Collective, collective_time, make_collective
from .compute import compute_time
from .links import GroupLink, axis_links, group_link
from .memory import total_value_bytes, value_bytes
from .reshard import reshard, reshard_time

__all__ = [
    "CLUSTERS",
    "COLLECTIVE_KINDS",
    "Cluster",
    "ClusterConfigError",
    "Collective",
    "GroupLink",
    "IslandLevel",
    "LinkLevel",
    "UnknownClusterError",
    "axis_links",
    "cluster_from_dict",
    "cluster_of",
    "collective_time",
    "compute_time",
    "get_cluster",
    "group_link",
    "known_clusters",
    "load_cluster",
    "make_collective",
    "nchw_convolutions",
    "peak_table",
    "register_cluster",
    "reshard",
    "reshard_time",
    "tf32_matmuls",
    "total_value_bytes",
    "value_bytes",
]
