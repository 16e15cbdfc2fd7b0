"""Per-device work of fused attention split along the query sequence (context parallelism).

A causal fused kernel (FlashAttention) skips the key blocks above the diagonal, so its work is
half the dense product (``ir.registry.op_flops`` counts it so). Split the queries over ``n``
devices in ``n`` contiguous chunks and chunk ``i`` sees ``i + 1/2`` chunks of keys: the last
device does ``(2n - 1) / n`` times the average and every other one waits for it. Llama 3 and
``torch.distributed.tensor.experimental.context_parallel`` cut the sequence into ``2n`` chunks
and give device ``i`` chunks ``i`` and ``2n - 1 - i`` (head-tail): every device then does the
average. An attention op says which one its emitter does with the ``load_balance`` attribute
(absent: balanced). The kernel itself runs at ``Cluster.attention_efficiency`` of peak.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..ir import Mesh, Op, Sharding
from .cluster import Cluster, get_cluster

ATTENTION_KINDS = ("attention", "attention_backward")


def causal_imbalance(ranks: int, balanced: bool) -> float:
    """The slowest device's causal work over the average, for ``ranks`` query chunks."""
    if balanced or ranks <= 1:
        return 1.0
    return (2 * ranks - 1) / ranks


def query_ranks(op: Op, operands: Sequence[Sharding], mesh: Mesh) -> int:
    """Devices the op's query sequence is split over (1 for ops other than attention)."""
    if op.kind not in ATTENTION_KINDS or not operands:
        return 1
    q = operands[1 if op.kind == "attention_backward" else 0]
    if len(q.dims) < 3:
        return 1
    return mesh.group_size(q.dims[2])


def attention_work_factor(
    op: Op, operands: Sequence[Sharding], mesh: Mesh, cluster: Cluster | str
) -> float:
    """Multiplier on the op's even per-device FLOPs, for a roofline at GEMM efficiency: the
    fused kernel's own efficiency (``Cluster.attention_efficiency``) and the causal imbalance
    of its query split."""
    if op.kind not in ATTENTION_KINDS:
        return 1.0
    cluster = get_cluster(cluster)
    kernel = cluster.compute_efficiency / cluster.fused_attention_efficiency
    if not op.attrs.get("causal"):
        return kernel
    balanced = bool(op.attrs.get("load_balance", True))
    return kernel * causal_imbalance(query_ranks(op, operands, mesh), balanced)
