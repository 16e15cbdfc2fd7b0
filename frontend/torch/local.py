"""Batched calls run on each rank's local shards, under ``apply``.

DTensor's own rules for attention and batched ``matmul`` fold the batch (and head) dims into
one; a split of two of them, or of one over two mesh dims, becomes a ``_StridedShard`` it then
cannot unfold or redistribute, and on a 3-D mesh its strategy search over operands split unlike
runs for minutes. Each ``(batch, head)`` pair is computed on its own, though, so the call runs
on local shards once every operand is split alike on those dims: ``shared_split_layout`` picks,
per mesh dim, the batch/head split some operand has and none contradicts; a replicated operand
is sliced to it (no collective), a broadcast (size-1) dim stays whole, anything else is moved
there by the plan's reshard.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

Placements = tuple[Placement, ...]


def shared_split_layout(operands: Sequence[DTensor], dims: Sequence[int], rank: int) -> Placements:
    """Per mesh dim, ``Shard(d)`` (``d`` in ``dims``, counted in a ``rank``-D call with the
    operands aligned to the right, as broadcasting does) when some operand is split on ``d``
    there and no other operand on another of ``dims``; else ``Replicate``. A dim that the
    chosen splits do not divide evenly in every operand is left whole."""
    mesh = operands[0].device_mesh
    out = [_split_on(operands, dims, rank, i) for i in range(mesh.ndim)]
    for d in dims:
        n = math.prod(mesh.size(i) for i, p in enumerate(out) if p == Shard(d))
        sizes = [_size(t, d, rank) for t in operands]
        if any(s != 1 and s % n for s in sizes):
            out = [Replicate() if p == Shard(d) else p for p in out]
    return tuple(out)


def _split_on(operands: Sequence[DTensor], dims: Sequence[int], rank: int, i: int) -> Placement:
    """The one call dim among ``dims`` that operands split on mesh dim ``i`` (size-1 dims of
    an operand do not count), as ``Shard``; ``Replicate`` when none or several."""
    found = set()
    for t in operands:
        p = t.placements[i]
        if type(p) is Shard:  # not _StridedShard
            d = p.dim + rank - t.ndim
            if d in dims and t.shape[p.dim] > 1:
                found.add(d)
    return Shard(found.pop()) if len(found) == 1 else Replicate()


def _size(t: DTensor, d: int, rank: int) -> int:
    """The size of call dim ``d`` in ``t`` (1 where ``t`` lacks it: broadcast)."""
    own = d - (rank - t.ndim)
    return t.shape[own] if own >= 0 else 1


def operand_placements(t: DTensor, layout: Placements, rank: int) -> Placements:
    """``layout`` as ``t`` takes it: a call dim ``t`` lacks or has size 1 stays whole."""
    out: list[Placement] = []
    for p in layout:
        own = p.dim - (rank - t.ndim) if isinstance(p, Shard) else -1
        out.append(Shard(own) if own >= 0 and t.shape[own] > 1 else Replicate())
    return tuple(out)


def as_dtensor(x: torch.Tensor, like: DTensor) -> DTensor:
    """A plain tensor (a mask made inside ``forward``) as a replicated DTensor."""
    if isinstance(x, DTensor):
        return x
    return DTensor.from_local(x, like.device_mesh, [Replicate()] * like.device_mesh.ndim,
                              run_check=False)  # fmt: skip


def run_local(
    call: Callable[..., torch.Tensor],
    operands: Sequence[DTensor],
    layout: Placements,
    rank: int,
    shape: Sequence[int],
    move: Callable[[DTensor, Placements], DTensor],
) -> DTensor:
    """``call`` on the operands' local shards at ``layout`` (moved there by ``move``); the
    result, of global ``shape``, is split as ``layout`` says. Autograd saves the local tensors
    as they are (``apply``'s saved-tensor hook would make them replicated DTensors)."""
    moved = [move(t, operand_placements(t, layout, rank)) for t in operands]
    with torch.autograd.graph.saved_tensors_hooks(_same, _same):
        local = call(*(t.to_local(grad_placements=_grad_placements(t, layout)) for t in moved))
    stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
    mesh = operands[0].device_mesh
    return DTensor.from_local(
        local, mesh, layout, run_check=False, shape=torch.Size(shape), stride=stride
    )


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _grad_placements(t: DTensor, layout: Placements) -> Placements:
    """The placements of ``t``'s local gradient: a pending sum on the mesh dims that split a
    call dim ``t`` broadcasts (lacks, or has size 1), as each rank's gradient then covers only
    its block of that dim (T5's relative position bias ``[1, h, q, k]``, an attention mask
    beside a batch split: the rank's batch rows' share); ``t``'s placements elsewhere."""
    return tuple(
        Partial() if isinstance(want, Shard) and isinstance(have, Replicate) else have
        for want, have in zip(layout, t.placements, strict=True)
    )


def attention(
    func: Any, args: tuple, kwargs: dict, move: Callable[[DTensor, Placements], DTensor]
) -> DTensor | None:
    """``scaled_dot_product_attention`` on local shards split alike on batch and heads (every
    (batch, head) pair attends on its own; under grouped-query attention a rank's block of
    query heads uses its block of key/value heads, and a single key/value head - multi-query
    attention - stays whole). A mask ``[b|1, h|1, q, k]`` is sliced to the rank's block. None:
    q, k and v are not all DTensors, or a positional mask (left to DTensor)."""
    qkv = args[:3]
    if len(qkv) < 3 or not all(isinstance(t, DTensor) for t in qkv) or len(args) > 3:
        return None
    operands = list(qkv)
    mask = kwargs.get("attn_mask")
    if isinstance(mask, torch.Tensor):
        operands.append(as_dtensor(mask, qkv[0]))
    layout = shared_split_layout(operands, (0, 1), 4)
    rest = {k: v for k, v in kwargs.items() if k != "attn_mask"}

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *mask: torch.Tensor) -> Any:
        return func(q, k, v, **rest, **({"attn_mask": mask[0]} if mask else {}))

    q, v = qkv[0], qkv[2]
    shape = (*q.shape[:-1], v.shape[-1])
    return run_local(call, operands, layout, 4, shape, move)


def matmul(func: Any, args: tuple, move: Callable[[DTensor, Placements], DTensor]) -> Any:
    """A batched ``matmul`` (both operands 3-D or more) on local shards split alike on the
    batch dims (HF GPT-J's and eager attention's ``q @ k^T`` and ``p @ v``): DTensor folds the
    batch dims into a ``_StridedShard`` it cannot unfold ("Cannot unflatten tensor with
    _StridedShard placement", GPT-J free on (2, 2, 2)), or searches for minutes. None: not
    such a call."""
    if len(args) != 2 or not all(isinstance(t, torch.Tensor) for t in args):
        return None
    a, b = args
    if a.ndim < 3 or b.ndim < 3 or not (isinstance(a, DTensor) or isinstance(b, DTensor)):
        return None
    like = a if isinstance(a, DTensor) else b
    operands = [as_dtensor(a, like), as_dtensor(b, like)]
    rank = max(a.ndim, b.ndim)
    layout = shared_split_layout(operands, tuple(range(rank - 2)), rank)
    shape = (*torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
    return run_local(func, operands, layout, rank, shape, move)
