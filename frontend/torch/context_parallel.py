"""Fused CPU attention with its queries split along the sequence (context parallelism).

Under ``follow_plan`` the fused attention kernels run on local shards (``follow.py``). A plan
that splits the query sequence (``ir.registry.attention_backward``) hands each rank a block of
query rows and every key and value (the follower all-gathers K/V to the planned layout). Two
things then differ from a batch/head split:
  - ``is_causal`` means "query i sees keys <= i" *within the block*; the rank's rows start at
    an offset, so the causal mask is given explicitly, shifted by the offset (the offset comes
    from sharding a position vector like the queries, so it is right under any nesting of
    mesh axes and under ``LocalTensorMode``);
  - the backward's dK and dV are this rank's queries' share of a sum over every query: they
    come out ``Partial`` over the query-split mesh dims (the follower then reduce-scatters them
    as the plan says).
The rows are contiguous chunks, so this runs numerically exact but without causal load
balancing (the cost model's default prices head-tail balanced chunks; docs/design.md).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

QUERY_SEQUENCE_DIM = 2
"""q[b, h, s, d]: the sequence dim of the fused kernels' operands."""


def query_split_dims(q: DTensor) -> list[int]:
    """Mesh dims the queries' sequence is split over (empty: no context parallelism)."""
    return [
        dim
        for dim, p in enumerate(q.placements)
        if isinstance(p, Shard) and p.dim == QUERY_SEQUENCE_DIM
    ]


def local_causal_mask(q: DTensor, keys: int) -> torch.Tensor:
    """Additive ``[s_local, keys]`` mask: row ``i`` (global position ``p``) sees keys ``<= p``."""
    mesh, split = q.device_mesh, set(query_split_dims(q))
    queries = q.shape[QUERY_SEQUENCE_DIM]
    positions = DTensor.from_local(
        torch.arange(queries), mesh, [Replicate()] * mesh.ndim, run_check=False
    )
    placements = [Shard(0) if dim in split else Replicate() for dim in range(mesh.ndim)]
    rows = positions.redistribute(mesh, placements).to_local()  # a local slice, no collective
    local = q.to_local()
    allowed = rows[:, None] >= torch.arange(keys, device=local.device)[None, :]
    zero = torch.zeros((), dtype=local.dtype, device=local.device)
    return torch.where(allowed, zero, torch.finfo(local.dtype).min)


def causal_arguments(
    func: Any, args: tuple, kwargs: dict, q: DTensor, keys: int
) -> tuple[tuple, dict]:
    """The kernel's arguments with ``is_causal`` replaced by the rank's shifted mask."""
    names = [a.name for a in func._schema.arguments]
    values = dict(zip(names, args, strict=False)) | kwargs
    if not values.get("is_causal") or values.get("attn_mask") is not None:
        return args, kwargs
    values["is_causal"] = False
    values["attn_mask"] = local_causal_mask(q, keys)
    positional = tuple(values.pop(n) for n in names[: len(args)])
    return positional, values


def gradient_placements(q: DTensor, kv: DTensor) -> tuple:
    """dK/dV placements: K/V's own, with ``Partial`` on the query-split mesh dims."""
    split = set(query_split_dims(q))
    return tuple(Partial() if dim in split else p for dim, p in enumerate(kv.placements))
