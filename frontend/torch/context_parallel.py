"""Fused CPU attention with its queries split along the sequence (context parallelism).

Under ``follow_plan`` the fused attention kernels run on local shards (``follow_calls.py``). A
plan that splits the query sequence (``ir.contraction_rules.attention_backward``) hands each rank
a block of query rows and every key and value (the follower all-gathers K/V to the planned
layout). Two things then differ from a batch/head split:
  - ``is_causal`` means "query i sees keys <= i" *within the block*; the rank's rows start at
    an offset, so the causal mask is given explicitly, shifted by the offset (the offset comes
    from sharding a position vector like the queries, so it is right under any nesting of
    mesh axes and under ``LocalTensorMode``);
  - the backward's dK and dV are this rank's queries' share of a sum over every query: they
    come out ``Partial`` over the query-split mesh dims (the follower then reduce-scatters them
    as the plan says).

Causal load balancing (what the cost model prices): the follower runs the whole step in the
head-tail token order of ``costmodel.context_parallel.head_tail_order``, so the contiguous
query rows each rank holds are two chunks of equal total work. The follower reorders the
data where the step first reads it (``sequence_inputs``: token ids by the order, Hugging Face
labels by ``shifted_order`` for the model's own label shift); the traced ``arange`` of the
sequence positions yields the order instead (rotary embeddings follow);
the causal mask compares the permuted positions of queries and keys. Token-wise ops and sums
over tokens do not see the order, so loss and gradients are the plain model's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ...costmodel.context_parallel import balanced_query_split, head_tail_order, shifted_order
from ...ir import Role
from ...solver.plan import Plan

QUERY_SEQUENCE_DIM = 2
"""q[b, h, s, d]: the sequence dim of the fused kernels' operands."""


def query_split_dims(q: DTensor) -> list[int]:
    """Mesh dims the queries' sequence is split over (empty: no context parallelism)."""
    return [
        dim
        for dim, p in enumerate(q.placements)
        if isinstance(p, Shard) and p.dim == QUERY_SEQUENCE_DIM
    ]


def plan_order(plan: Plan) -> list[int] | None:
    """The head-tail token order the plan's causal query split runs in (None: no split).
    A split no single order balances raises ``ValueError`` (the follower reports it)."""
    split = balanced_query_split(plan.graph.ops, plan.operand_shardings, plan.mesh)
    return None if split is None else head_tail_order(*split)


SHIFTED_INPUTS = ("labels",)
"""Inputs the model shifts itself (Hugging Face ``labels``: token ``i``'s target is
``labels[i + 1]``); they are fed in ``shifted_order``."""


def sequence_inputs(plan: Plan, order: Sequence[int]) -> dict[str, torch.Tensor]:
    """Data inputs ``[batch, seq, ...]`` of the plan -> the index to reorder their sequence by:
    the order itself, or ``shifted_order`` for the labels the model shifts itself."""
    index, shifted = torch.tensor(order), torch.tensor(shifted_order(order))
    out = {}
    for v in plan.graph.inputs:
        if v.role is Role.INPUT and v.type.rank >= 2 and v.type.shape[1] == len(order):
            label = v.name in SHIFTED_INPUTS or v.origin.path in SHIFTED_INPUTS
            out[v.name] = shifted if label else index
    return out


def reorder(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t`` (plain or replicated DTensor, ``[batch, seq, ...]``) in the balanced order."""
    return t.index_select(1, index.to(t.device))


def local_causal_mask(q: DTensor, keys: int, order: Sequence[int] | None = None) -> torch.Tensor:
    """Additive ``[s_local, keys]`` mask: row ``i`` (global position ``p``) sees keys ``<= p``.
    With ``order``, the sequence runs permuted: query ``i`` and key ``j`` are at positions
    ``order[i]`` and ``order[j]``."""
    mesh, split = q.device_mesh, set(query_split_dims(q))
    queries = q.shape[QUERY_SEQUENCE_DIM]
    local = q.to_local()
    key_positions = torch.arange(keys, device=local.device)
    query_positions = torch.arange(queries)
    if order is not None:
        key_positions = torch.tensor(order, device=local.device)
        query_positions = torch.tensor(order)
    positions = DTensor.from_local(
        query_positions, mesh, [Replicate()] * mesh.ndim, run_check=False
    )
    placements = [Shard(0) if dim in split else Replicate() for dim in range(mesh.ndim)]
    rows = positions.redistribute(mesh, placements).to_local()  # a local slice, no collective
    allowed = rows[:, None] >= key_positions[None, :]
    zero = torch.zeros((), dtype=local.dtype, device=local.device)
    return torch.where(allowed, zero, torch.finfo(local.dtype).min)


def causal_arguments(
    func: Any, args: tuple, kwargs: dict, q: DTensor, keys: int, order: Sequence[int] | None = None
) -> tuple[tuple, dict]:
    """The kernel's arguments with ``is_causal`` replaced by the rank's shifted mask."""
    names = [a.name for a in func._schema.arguments]
    values = dict(zip(names, args, strict=False)) | kwargs
    if not values.get("is_causal") or values.get("attn_mask") is not None:
        return args, kwargs
    values["is_causal"] = False
    values["attn_mask"] = local_causal_mask(q, keys, order)
    positional = tuple(values.pop(n) for n in names[: len(args)])
    return positional, values


def gradient_placements(q: DTensor, kv: DTensor) -> tuple:
    """dK/dV placements: K/V's own, with ``Partial`` on the query-split mesh dims."""
    split = set(query_split_dims(q))
    return tuple(Partial() if dim in split else p for dim, p in enumerate(kv.placements))
