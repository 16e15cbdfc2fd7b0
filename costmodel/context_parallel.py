"""Per-device work of fused attention split along the query sequence (context parallelism).

A causal fused kernel (FlashAttention) skips the key blocks above the diagonal, so its work is
half the dense product (``ir.op_cost.op_flops`` counts it so). Split the queries over ``n``
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
from ..ir.errors import ContextParallelError
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
    fused kernel's own efficiency (``Cluster.attention_efficiency``, and
    ``attention_backward_slowdown`` for the backward) and the causal imbalance of its query
    split."""
    if op.kind not in ATTENTION_KINDS:
        return 1.0
    cluster = get_cluster(cluster)
    kernel = cluster.compute_efficiency / cluster.fused_attention_efficiency
    if op.kind == "attention_backward":  # the backward kernel runs below the forward's rate
        kernel *= cluster.attention_backward_slowdown
    if not op.attrs.get("causal"):
        return kernel
    balanced = bool(op.attrs.get("load_balance", True))
    return kernel * causal_imbalance(query_ranks(op, operands, mesh), balanced)


def head_tail_order(length: int, ranks: int) -> list[int]:
    """The token order the emitters run a causal query split over ``ranks`` devices in.

    The sequence is cut into ``2 * ranks`` chunks; device ``r`` (the ``r``-th contiguous
    block of the permuted order, as every sharding lays it out) holds chunks ``ranks - 1 - r``
    and ``ranks + r``. Each pair sums to ``2 * ranks - 1`` chunks of causal work, so every
    device does the average, and so does every group of consecutive devices: a coarser query
    split by a divisor of ``ranks`` is balanced by the same order. The last position stays
    last (device ``ranks - 1`` ends with chunk ``2 * ranks - 1``), which lets a loss that
    shifts its labels internally follow the order (``shifted_order``).
    """
    if ranks < 1 or length % (2 * ranks):
        raise ContextParallelError(f"{length} tokens do not cut into 2 x {ranks} equal chunks")
    chunk = length // (2 * ranks)
    order: list[int] = []
    for r in range(ranks):
        for c in (ranks - 1 - r, ranks + r):
            order.extend(range(c * chunk, (c + 1) * chunk))
    return order


def shifted_order(order: Sequence[int]) -> list[int]:
    """The order to feed labels in when the model shifts them itself (Hugging Face:
    ``labels[i + 1]`` is token ``i``'s target, the last padded with the ignore index).

    Feeding ``labels[sigma]`` makes the model's shift give token ``order[j]`` its own target:
    ``sigma[j + 1] = order[j] + 1``; ``sigma[0]`` is never read (it is ``0``, so ``sigma`` is a
    permutation). Needs ``order[-1]`` to be the last position, as ``head_tail_order`` keeps it.
    """
    if order and order[-1] != len(order) - 1:
        raise ContextParallelError("the order must keep the last position last")
    return [0] + [p + 1 for p in order[:-1]]


def balanced_query_split(
    ops: Sequence[Op], operand_shardings: dict[tuple[int, int], Sharding], mesh: Mesh
) -> tuple[int, int] | None:
    """``(sequence length, devices)`` of the causal query split the emitters must balance,
    or None when no causal attention splits its queries.

    Every causal attention op of the plan is looked at: the one token order must balance all
    of them, so their query lengths must agree and every op's number of query devices must
    divide the largest (``head_tail_order`` then balances each). Otherwise a ``ValueError``
    says why (the emitters then run contiguous chunks and report it).
    """
    splits: set[tuple[int, int]] = set()
    for i, op in enumerate(ops):
        if op.kind not in ATTENTION_KINDS or not op.attrs.get("causal"):
            continue
        q = 1 if op.kind == "attention_backward" else 0
        sharding = operand_shardings.get((i, q))
        if sharding is None or len(sharding.dims) < 3:
            continue
        splits.add((op.operands[q].type.shape[2], mesh.group_size(sharding.dims[2])))
    split = {(length, n) for length, n in splits if n > 1}
    if not split:
        return None
    lengths = {length for length, _ in splits}
    if len(lengths) > 1:
        raise ContextParallelError(
            f"attention ops with query lengths {sorted(lengths)}: one order for all"
        )
    ranks = max(n for _, n in split)
    (length,) = lengths
    if any(ranks % n for _, n in split) or length % (2 * ranks):
        raise ContextParallelError(
            f"query splits over {sorted(n for _, n in split)} devices of a {length}-token "
            f"sequence: no head-tail order balances them all"
        )
    return length, ranks
