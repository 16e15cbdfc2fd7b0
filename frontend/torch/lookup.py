"""Embedding lookups into a DTensor table under ``apply``, computed here, not by DTensor.

DTensor looks rows up in a table split along its rows with a ``MaskPartial`` result, which
its redistribution cannot meet with a plain pending-sum gradient ("Redistribution from one
partial type (P(sum)) to another (MaskP(...)) is unsupported": T5's relative position bias,
rows split over ``{dp, tp}``, looked up with computed bucket ids, its gradient summed over a
batch split on ``dp``), and which allows one vocabulary split per table. ``embedding`` runs
every lookup into a DTensor table with its rows split as follows instead:

- a mesh dim that splits the rows while the ids are split too (FSDP) gathers the table there
  (DTensor's redistribution: its backward reduce-scatters the gradient);
- a mesh dim that splits the hidden dim sees whole ids (gathered: they are small);
- a mesh dim that splits the rows with whole ids looks up locally: each rank takes the ids that
  fall in its rows, zeros for the rest, and the result is a plain pending sum there; in
  backward the gradient is made whole on that dim and each rank adds the rows it owns (a
  scatter-add), so the table's gradient comes out split as the table is.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)


def embedding(ids: Any, table: DTensor, padding_idx: int | None = None, *rest: Any,
              **options: Any) -> Any:  # fmt: skip
    """``F.embedding(ids, table, padding_idx, ...)`` for a DTensor ``table`` (module
    docstring); None when the call is not a plain lookup with rows split (DTensor's then)."""
    plain = not rest and all(v in (None, False, 2.0) for v in options.values())
    if not plain or not any(_rows(p) for p in table.placements):
        return None  # max_norm / scale_grad_by_freq / sparse, or rows whole: DTensor's lookup
    if not isinstance(ids, DTensor):
        ids = DTensor.from_local(ids, table.device_mesh, [Replicate()] * table.device_mesh.ndim,
                                 run_check=False)  # fmt: skip
    table_placements, ids_placements = _lookup_layouts(table, ids)
    table = table.redistribute(placements=table_placements)
    ids = ids.redistribute(placements=ids_placements)
    if not any(_rows(p) for p in table.placements):
        return F.embedding(ids, table, padding_idx)  # rows gathered: DTensor's plain lookup
    return _MaskedLookup.apply(ids, table, padding_idx)


def _rows(p: Placement) -> bool:
    return isinstance(p, Shard) and p.dim == 0


def _lookup_layouts(table: DTensor, ids: DTensor) -> tuple[list[Placement], list[Placement]]:
    """The table's and the ids' placements the lookup computes at (module docstring)."""
    table_out: list[Placement] = []
    ids_out: list[Placement] = []
    for t, i in zip(table.placements, ids.placements, strict=True):
        i = Replicate() if isinstance(i, Partial) else i
        if _rows(t) and isinstance(i, Shard):
            table_out.append(Replicate())  # FSDP: gather the rows, keep the ids split
            ids_out.append(i)
        elif isinstance(t, Shard):
            table_out.append(t)  # rows (masked locally) or hidden dim: whole ids
            ids_out.append(Replicate())
        else:
            table_out.append(t)
            ids_out.append(i)
    return table_out, ids_out


def _first_rows(table: DTensor) -> torch.Tensor:
    """Each rank's first table row (its row block's offset), as a one-element local tensor."""
    rows = torch.arange(table.shape[0], device=table.to_local().device)
    placements = [p if _rows(p) else Replicate() for p in table.placements]
    whole = distribute_tensor(rows, table.device_mesh, placements, src_data_rank=None)
    return whole.to_local()[:1]


def masked_lookup(ids: DTensor, table: DTensor) -> tuple[DTensor, torch.Tensor, torch.Tensor]:
    """The lookup with each rank's rows (module docstring, third case): the result (a plain
    pending sum on the row-split mesh dims), the local row index and the mask of local ids."""
    local_table = table.to_local()
    index = ids.to_local() - _first_rows(table)
    hit = (index >= 0) & (index < local_table.shape[0])
    index = torch.where(hit, index, torch.zeros_like(index))
    out = F.embedding(index, local_table) * hit.unsqueeze(-1).to(local_table.dtype)
    placements = [
        Partial() if _rows(t) else Shard(ids.ndim) if isinstance(t, Shard) else i
        for t, i in zip(table.placements, ids.placements, strict=True)
    ]
    shape = (*ids.shape, table.shape[1])
    result = DTensor.from_local(out, table.device_mesh, placements, run_check=False,
                                shape=torch.Size(shape), stride=_contiguous(shape))  # fmt: skip
    return result, index, hit


def fits(table: Any, ids: Any) -> bool:
    """Whether ``aten.embedding(table, ids)`` at the layouts ``follow_plan`` moved them to is a
    masked lookup (rows split, ids whole wherever the table is split): the follower runs it
    so, as DTensor's lookup makes a ``MaskPartial`` no planned pending sum may be moved to."""
    if not (isinstance(table, DTensor) and isinstance(ids, DTensor)):
        return False
    return any(_rows(p) for p in table.placements) and not any(
        isinstance(t, Shard) and not isinstance(i, Replicate)
        for t, i in zip(table.placements, ids.placements, strict=True)
    )


class _MaskedLookup(torch.autograd.Function):
    """A lookup into a table whose rows are split, ids whole on those mesh dims."""

    @staticmethod
    def forward(ctx: Any, ids: DTensor, table: DTensor, padding_idx: int | None) -> DTensor:  # type: ignore[override]
        out, index, hit = masked_lookup(ids, table)
        if padding_idx is not None:  # no gradient for the padding row
            hit = hit & (ids.to_local() != padding_idx % table.shape[0])
        ctx.index, ctx.hit = index, hit  # plain: not through apply's saved-tensor hooks
        ctx.table, ctx.placements = table, out.placements
        return out

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple:  # type: ignore[override]
        table = ctx.table
        want = [  # whole where the result was pending; a pending sum stays where rows whole
            Replicate() if isinstance(p, Partial)
            else g if isinstance(g, Partial) and isinstance(t, Replicate) else p
            for p, g, t in zip(ctx.placements, grad.placements, table.placements, strict=True)
        ]  # fmt: skip
        local = grad.redistribute(placements=want).to_local()
        weight = torch.zeros(table.to_local().shape, dtype=local.dtype, device=local.device)
        values = (local * ctx.hit.unsqueeze(-1).to(local.dtype)).reshape(-1, local.shape[-1])
        weight.index_add_(0, ctx.index.reshape(-1), values)
        placements = [
            t if isinstance(t, Shard) else Partial() if not isinstance(g, Replicate) else t
            for t, g in zip(table.placements, want, strict=True)
        ]
        weight_grad = DTensor.from_local(weight, table.device_mesh, placements, run_check=False,
                                         shape=table.shape, stride=table.stride())  # fmt: skip
        return None, weight_grad, None


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= size
    return tuple(reversed(stride))
