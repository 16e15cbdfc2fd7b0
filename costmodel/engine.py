"""Execution engines: how a serving or training runtime launches the kernels a plan prices.

The roofline prices each kernel ``max(math, memory, floor)``. The floor is what the engine pays
per kernel, and what it launches at all:

- ``eager``: every kernel pays the cluster's ``kernel_floor``, a host launch plus tail
  (autoparallel's 7 us; ~18 us measured for an eager call on one H100 VM); elementwise ops
  are kernels of their own unless the elementwise fusion (``fusion.py``) folds them;
- ``cuda_graph``: a replayed CUDA graph has no host launch: the floor is the GPU-side
  ``GRAPH_KERNEL_FLOOR``;
- ``fused``: ``cuda_graph``, and every elementwise op runs inside the GEMM or attention kernel
  next to it (no launch of its own; its HBM bytes stay counted).

``eager`` is PyTorch eager (HF ``generate``); vLLM and TensorRT-LLM replay CUDA graphs of
decode steps with fused norm, activation and RoPE kernels; ``bench/serving_fidelity.py``
prices both as ``cuda_graph`` (its docstring and docs/costmodel.md say why). On the
``cuda_graph`` and ``fused`` engines a ring collective inside one node is priced with NCCL's
protocol latencies (``nccl.py``), the latency a decode step's small all-reduces pay; ``eager``
keeps the catalogue's flat alpha. Paged KV-cache reads are priced as the cache's bytes at HBM
rate, the same for every engine. Use ``Mesh(axes, cluster=with_engine("h200-sxm", "cuda_graph"))``.
"""

from __future__ import annotations

from dataclasses import replace

from .cluster import Cluster, ClusterConfigError, get_cluster, register_cluster

ENGINES = ("eager", "cuda_graph", "fused")

GRAPH_KERNEL_FLOOR = 2.7e-6
"""Seconds: the least a kernel takes inside a replayed CUDA graph. Measured on one H100 SXM
(``bench/microbench_gpu.py``, ``data/calibration/h100-sxm-measured-raw.json``: a 256^3 bf16 GEMM
replays in 2.73 us, where the eager call took 17.7 us); the same Hopper part is assumed on H200,
and Ampere is assumed alike (not measured)."""


def with_engine(cluster: Cluster | str, engine: str) -> str:
    """Register ``cluster`` as run by ``engine`` and return the registered name (``eager``: the
    cluster itself)."""
    base = get_cluster(cluster)
    if engine not in ENGINES:
        raise ClusterConfigError(
            f"unknown engine {engine!r}; one of {ENGINES} (eager: PyTorch eager, cuda_graph: "
            "replayed CUDA graphs, fused: CUDA graphs with fused elementwise kernels)"
        )
    if engine == "eager":
        return base.name
    floor = min(base.kernel_floor, GRAPH_KERNEL_FLOOR)
    name = f"{base.name}+{engine}"
    return register_cluster(replace(base, name=name, kernel_floor=floor, engine=engine)).name


def launches(kind: str, fused_launches: bool, cluster: Cluster) -> bool:
    """Whether an op of ``kind`` pays a kernel floor of its own: not when the elementwise
    fusion folds it into its consumer (``fused_launches`` False), nor under the ``fused``
    engine when it is elementwise."""
    if not fused_launches:
        return False
    if cluster.engine == "fused":
        from .fusion import ELEMENTWISE_KINDS

        return kind not in ELEMENTWISE_KINDS
    return True


__all__ = ["ENGINES", "GRAPH_KERNEL_FLOOR", "launches", "with_engine"]
