"""Halo exchanges of a convolution whose rows the plan splits (GSPMD's windowed split).

Each rank holds a slab of input rows; output row ``o`` reads input rows around
``o * stride``, so a rank needs ``lo`` rows from the end of the previous rank's slab and ``hi``
from the start of the next one's (``ir.halo.halo_rows``). Each block moves with one
``all_to_all_single`` over the mesh dims splitting the rows (a flattened group when there are
several: the slabs are in their major-to-minor order) in which every rank sends to one
neighbour: the collective-permute the cost model prices (``costmodel.conv.halo_collectives``).
The shift is cyclic (every rank sends the same amount); the first and last ranks zero what
they receive from across the ends, where the convolution's own padding would be. The
backward sends the input gradient of the halo rows back the other way and adds it to the
owner's rows (``fold_back``; ``exchange`` is ``extend`` with that backward, for autograd).

Private: ``reshard.per_rank`` (rank-dependent split sizes under the simulated world).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ...ir.halo import halo_split
from .reshard import per_rank

MeshDims = int | tuple[int, ...]


def _dims(mesh_dims: MeshDims) -> tuple[int, ...]:
    return (mesh_dims,) if isinstance(mesh_dims, int) else tuple(mesh_dims)


def _group(mesh: Any, dims: tuple[int, ...]) -> Any:
    """The process group over mesh dims ``dims`` (ascending): one mesh dim, or the flattened
    mesh of several (``emit.flattened_meshes``: ranks in major-to-minor order)."""
    if mesh.ndim == 1:
        return mesh
    names = tuple(mesh.mesh_dim_names[d] for d in dims)
    if len(dims) == 1:
        return mesh[names[0]]
    from .emit import flattened_meshes

    return flattened_meshes(mesh)[names]


def _shift(block: torch.Tensor, step: int, mesh: Any, dims: tuple[int, ...]) -> torch.Tensor:
    """``block`` of every rank sent to the rank ``step`` further along mesh dims ``dims``
    (their flattened order, cyclic)."""
    sizes = [mesh.size(d) for d in dims]
    n = math.prod(sizes)
    numel = block.numel()

    def splits(coordinate: list[int]) -> list[int]:
        r = 0
        for d, size in zip(dims, sizes, strict=True):
            r = r * size + coordinate[d]
        out, inp = [0] * n, [0] * n
        inp[(r + step) % n] = numel
        out[(r - step) % n] = numel
        return out + inp

    split = per_rank(splits)(list(mesh.get_coordinate()))
    moved = funcol.all_to_all_single(block.reshape(-1), split[:n], split[n:], _group(mesh, dims))
    if isinstance(moved, funcol.AsyncCollectiveTensor):
        moved = moved.wait()
    return moved.view(block.shape)


def _valid(mesh: Any, dims: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Per rank: 1 where a previous / next rank exists along mesh dims ``dims``, else 0 (no
    data moves: every rank slices its own position out of the same ``arange``)."""
    n = math.prod(mesh.size(d) for d in dims)
    placements: list[Any] = [Replicate()] * mesh.ndim
    for d in dims:
        placements[d] = Shard(0)
    positions = torch.arange(n, dtype=dtype)
    rank = distribute_tensor(positions, mesh, placements, src_data_rank=None).to_local()
    return (rank > 0).to(dtype), (rank < n - 1).to(dtype)


def _check_rows(rows: int, lo: int, hi: int) -> None:
    if max(lo, hi) > rows:
        raise NotImplementedError(
            f"a halo of {lo} + {hi} rows from slabs of {rows} rows: the window reaches past "
            "the neighbouring shard; split the rows over fewer devices (or not at all)"
        )


def extend(x: torch.Tensor, dim: int, lo: int, hi: int, mesh: Any, mesh_dims: MeshDims):  # type: ignore[no-untyped-def]
    """Local rows ``x`` (along ``dim``) with ``lo`` rows of the previous rank before them and
    ``hi`` of the next after them (zeros past the ends; a negative count moves nothing)."""
    dims = _dims(mesh_dims)
    rows = x.movedim(dim, 0).contiguous()
    _check_rows(rows.shape[0], lo, hi)
    first, last = _valid(mesh, dims, x.dtype)
    parts = []
    if lo > 0:
        parts.append(_shift(rows[-lo:].contiguous(), 1, mesh, dims) * first)
    parts.append(rows)
    if hi > 0:
        parts.append(_shift(rows[:hi].contiguous(), -1, mesh, dims) * last)
    return torch.cat(parts).movedim(0, dim)


def fold_back(grad: torch.Tensor, dim: int, lo: int, hi: int, mesh: Any, mesh_dims: MeshDims):  # type: ignore[no-untyped-def]
    """The inverse of ``extend`` for gradients: the halo rows' gradients go back to the ranks
    that own those rows and are added there; the local rows come out."""
    dims = _dims(mesh_dims)
    lo, hi = max(lo, 0), max(hi, 0)
    rows = grad.movedim(dim, 0)
    first, last = _valid(mesh, dims, grad.dtype)
    local = rows[lo : rows.shape[0] - hi].clone()
    if lo:  # my leading halo rows are the previous rank's last rows
        local[-lo:] += _shift(rows[:lo].contiguous(), -1, mesh, dims) * last
    if hi:  # my trailing halo rows are the next rank's first rows
        local[:hi] += _shift(rows[rows.shape[0] - hi :].contiguous(), 1, mesh, dims) * first
    return local.movedim(0, dim).contiguous()


class _Exchange(torch.autograd.Function):
    """``extend`` forward, ``fold_back`` backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, lo: int, hi: int, mesh: Any,  # type: ignore[override]
                dims: tuple[int, ...]) -> torch.Tensor:  # fmt: skip
        ctx.geometry = (dim, lo, hi, mesh, dims)
        return extend(x, dim, lo, hi, mesh, dims)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        return (fold_back(grad, *ctx.geometry), None, None, None, None, None)


def exchange(x: torch.Tensor, dim: int, lo: int, hi: int, mesh: Any, mesh_dims: MeshDims):  # type: ignore[no-untyped-def]
    """``extend`` as an autograd op: its gradient is ``fold_back`` (``plan.apply``'s
    convolutions, whose backward autograd derives)."""
    return _Exchange.apply(x, dim, lo, hi, mesh, _dims(mesh_dims))


def split_rows(x: Any) -> list[tuple[int, tuple[int, ...]]]:
    """``(tensor dim, mesh dims)`` of each spatial split of a DTensor convolution input (its
    batch and channel dims are 0 and 1), in tensor-dim order."""
    if not isinstance(x, DTensor):
        return []
    by_dim: dict[int, list[int]] = {}
    for i, p in enumerate(x.placements):
        if isinstance(p, Shard) and p.dim >= 2:
            by_dim.setdefault(p.dim, []).append(i)
    return [(d, tuple(by_dim[d])) for d in sorted(by_dim)]


# -- plan.apply: F.conv*d on a row-split DTensor ------------------------------------------------
Rows = list[tuple[int, tuple[int, ...], int, int]]
"""``(tensor dim, mesh dims, lo, hi)`` of each halo split of a convolution input."""


def _per_dim(value: Any, nd: int) -> list[int]:
    return [int(value)] * nd if isinstance(value, int) else [int(v) for v in value]


def conv_padding(padding: Any, kernel: list[int], dilation: list[int]) -> list[int] | None:
    """``F.conv*d``'s padding as per-dim ints; None for a ``"same"`` padding that is not
    symmetric (an even window: torch pads one row more at the end)."""
    if padding == "valid":
        return [0] * len(kernel)
    if padding == "same":
        totals = [d * (k - 1) for k, d in zip(kernel, dilation, strict=True)]
        return None if any(t % 2 for t in totals) else [t // 2 for t in totals]
    return _per_dim(padding, len(kernel))


def conv_rows(
    x: DTensor, kernel: list[int], stride: Any, padding: list[int], dilation: Any
) -> Rows:
    """The spatial splits of ``x`` a convolution keeps (a halo split of ``ir.halo``'s forward
    form whose rows and output rows divide evenly over the splitting mesh dims), with their
    halos. Other spatial splits are gathered by the caller."""
    nd = len(kernel)
    strides, dilations = _per_dim(stride, nd), _per_dim(dilation, nd)
    attrs = {"strides": strides, "rhs_dilation": dilations, "padding": [(p, p) for p in padding]}
    kept: Rows = []
    for dim, mesh_dims in split_rows(x):
        i, rows = dim - 2, x.shape[dim]
        out = (rows + 2 * padding[i] - dilations[i] * (kernel[i] - 1) - 1) // strides[i] + 1
        found = halo_split((rows, kernel[i], out), attrs, i, window=False)
        n = math.prod(x.device_mesh.size(d) for d in mesh_dims)
        if found is not None and rows % n == 0 and out % n == 0:
            kept.append((dim, mesh_dims, found.lo, found.hi))
    return kept


def exchange_rows(local: torch.Tensor, rows: Rows, mesh: Any) -> torch.Tensor:
    """``local`` extended by the halo of each split (one dim after the other: a 2-D split
    gets its corners from the diagonal neighbour through the first exchange)."""
    for dim, mesh_dims, lo, hi in rows:
        local = exchange(local, dim, lo, hi, mesh, mesh_dims)
    return local
