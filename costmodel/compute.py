"""Roofline time of a compute kernel on one device."""

from __future__ import annotations

from .cluster import Cluster, get_cluster


def compute_time(
    flops: float,
    bytes_accessed: float,
    dtype: str,
    cluster: Cluster | str,
    launches: bool = True,
) -> float:
    """Seconds for one kernel: ``max(flops / (peak * eff), bytes / (hbm_bw * mem_eff))``.

    The roofline model (Williams et al., CACM 2009) with achievable-efficiency factors (ref §3:
    0.70 compute, 0.70-0.84 memory). A non-empty kernel never takes less than
    ``cluster.kernel_floor`` (launch + tail; autoparallel's 7 us on GPUs): the floor is a
    lower bound, ``max(roofline, floor)``, not an added constant. An empty kernel costs 0.

    Args:
        flops: floating-point operations on this device (a multiply-add counts 2).
        bytes_accessed: HBM bytes read plus written on this device.
        dtype: the dtype whose peak applies (HLO names: ``bf16``, ``f32``, ...); dtypes the
            cluster does not list fall back to its slowest rate.
        cluster: a ``Cluster`` or a catalogue name.
        launches: False for an op fused into its consumer's kernel (``costmodel.fusion``): it
            pays no floor of its own, the kernel that writes to HBM pays one.
    """
    if flops <= 0 and bytes_accessed <= 0:
        return 0.0
    cluster = get_cluster(cluster)
    math_time = max(flops, 0.0) / (cluster.peak(dtype) * cluster.compute_efficiency)
    memory_time = max(bytes_accessed, 0.0) / (cluster.hbm_bandwidth * cluster.memory_efficiency)
    return max(math_time, memory_time, cluster.kernel_floor if launches else 0.0)
