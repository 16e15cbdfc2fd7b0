"""Halo exchanges of a convolution whose rows the plan splits (GSPMD's windowed split).

Each rank holds a slab of input rows; output row ``o`` reads input rows around
``o * stride``, so a rank needs ``lo`` rows from the end of the previous rank's slab and ``hi``
from the start of the next one's (``costmodel.conv.halo_rows``). Each block moves with one
``all_to_all_single`` on the splitting mesh dim in which every rank sends to one neighbour: the
collective-permute the cost model prices. The shift is cyclic (every rank sends the same
amount); the first and last ranks zero what they receive from across the ends, where the
convolution's own padding would be. The backward sends the input gradient of the halo rows
back the other way and adds it to the owner's rows.

Private: ``reshard.per_rank`` (rank-dependent split sizes under the simulated world).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from .reshard import per_rank


def _shift(block: torch.Tensor, step: int, mesh: Any, mesh_dim: int) -> torch.Tensor:
    """``block`` of every rank sent to the rank ``step`` further along ``mesh_dim`` (cyclic)."""
    n = mesh.size(mesh_dim)
    numel = block.numel()

    def splits(coordinate: list[int]) -> list[int]:
        r = coordinate[mesh_dim]
        out, inp = [0] * n, [0] * n
        inp[(r + step) % n] = numel
        out[(r - step) % n] = numel
        return out + inp

    sizes = per_rank(splits)(list(mesh.get_coordinate()))
    group = mesh[mesh.mesh_dim_names[mesh_dim]] if mesh.ndim > 1 else mesh
    moved = funcol.all_to_all_single(block.reshape(-1), sizes[:n], sizes[n:], group)
    if isinstance(moved, funcol.AsyncCollectiveTensor):
        moved = moved.wait()
    return moved.view(block.shape)


def _valid(mesh: Any, mesh_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per rank: 1 where a previous / next rank exists along ``mesh_dim``, else 0."""
    n = mesh.size(mesh_dim)
    placements = [Replicate()] * mesh.ndim
    placements[mesh_dim] = Shard(0)
    rank = distribute_tensor(torch.arange(n, dtype=dtype), mesh, placements).to_local()
    return (rank > 0).to(dtype), (rank < n - 1).to(dtype)


def extend(x: torch.Tensor, dim: int, lo: int, hi: int, mesh: Any, mesh_dim: int) -> torch.Tensor:
    """Local rows ``x`` (along ``dim``) with ``lo`` rows of the previous rank before them and
    ``hi`` of the next after them (zeros past the ends)."""
    rows = x.movedim(dim, 0).contiguous()
    first, last = _valid(mesh, mesh_dim, x.dtype)
    parts = []
    if lo:
        parts.append(_shift(rows[-lo:].contiguous(), 1, mesh, mesh_dim) * first)
    parts.append(rows)
    if hi:
        parts.append(_shift(rows[:hi].contiguous(), -1, mesh, mesh_dim) * last)
    return torch.cat(parts).movedim(0, dim)


def fold_back(grad: torch.Tensor, dim: int, lo: int, hi: int, mesh: Any, mesh_dim: int):  # type: ignore[no-untyped-def]
    """The inverse of ``extend`` for gradients: the halo rows' gradients go back to the ranks
    that own those rows and are added there; the local rows come out."""
    rows = grad.movedim(dim, 0)
    first, last = _valid(mesh, mesh_dim, grad.dtype)
    local = rows[lo : rows.shape[0] - hi].clone()
    if lo:  # my leading halo rows are the previous rank's last rows
        local[-lo:] += _shift(rows[:lo].contiguous(), -1, mesh, mesh_dim) * last
    if hi:  # my trailing halo rows are the next rank's first rows
        local[:hi] += _shift(rows[rows.shape[0] - hi :].contiguous(), 1, mesh, mesh_dim) * first
    return local.movedim(0, dim).contiguous()


def split_rows(x: Any) -> list[tuple[int, int]]:
    """``(tensor dim, mesh dim)`` of each spatial row split of a DTensor convolution input."""
    if not isinstance(x, DTensor):
        return []
    return [(p.dim, i) for i, p in enumerate(x.placements) if isinstance(p, Shard) and p.dim >= 2]
