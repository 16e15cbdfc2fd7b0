"""Table-wise bag lookups: the owner pools and scatters the rows (``apply``, ``follow_plan``).

A table-wise table (``ir/table_wise.py``) is held as a DTensor replicated over the mesh, of
which only the owner's local copy is read: DTensor has no placement for "on one group only",
and simulated ranks need one shape on every rank (a multi-process run can free the other
copies; they are never read). The owner pools the bags of its share of the batch (every bag
along the table's axes); one ``all_to_all_single`` on the group of those axes sends each
device the slice of its own bags, the others sending nothing (``scatter``). In backward the
bags' gradient goes back to the owner the reverse way (``gather``; under ``apply`` it is the
scatter's own autograd), and the owner alone makes the table's gradient: on the other devices
it is zero, and no all-reduce over the table's axes follows (its layout is whole there).
Sum and mean pooling, without per-sample weights (``solver/table_strategies.py`` refuses the
rest).
"""

from __future__ import annotations

from typing import Any

# torch's functional collectives (the module name is private): they carry autograd and are
# what LocalTensorMode and simulate.CollectiveLog see (as in reshard.py)
import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Replicate

from ...ir import Mesh
from ...ir.table_wise import TableOwner, position
from .bags import Layout, Options, _index, _wrap, lookup, table_grad
from .plan_layouts import Placements, flattened_meshes
from .reshard import per_rank


def owners_by_table(plan: Any) -> dict[str, TableOwner]:
    """Table value name -> its owner, for the plan's table-wise tables."""
    return {o.table: o for o in getattr(plan, "table_owners", ())}


def owners_by_module(plan: Any) -> dict[str, TableOwner]:
    return {o.module: o for o in getattr(plan, "table_owners", ())}


def _group(device_mesh: Any, axes: tuple[str, ...]) -> Any:
    return device_mesh[axes[0]] if len(axes) == 1 else flattened_meshes(device_mesh)[axes]


def _owner_share(result: Placements, owner: TableOwner, mesh: Mesh) -> Placements:
    """The owner's bag split: the result's, less the table's axes (it pools all of those)."""
    return tuple(
        Replicate() if name in owner.axes else p
        for name, p in zip(mesh.axis_names, result, strict=True)
    )


def _splits(owner: TableOwner, mesh: Mesh, chunk: int, scatter: bool):  # type: ignore[no-untyped-def]
    """Per rank: output splits, input splits and the elements it sends, of the scatter (the
    owner sends ``chunk`` to each of the group) or of the gather (each sends ``chunk`` to the
    owner)."""
    n = mesh.group_size(owner.axes)

    def of(coordinate: list[int]) -> list[int]:
        mine = position(dict(zip(mesh.axis_names, coordinate, strict=True)), owner.axes, mesh)
        owns = mine == owner.owner
        to_owner = [chunk if p == owner.owner else 0 for p in range(n)]
        every = [chunk if owns else 0] * n
        if scatter:  # receive from the owner; the owner sends to every one
            return [*to_owner, *every, chunk * n if owns else 0]
        return [*every, *to_owner, chunk]  # receive all at the owner; every one sends to it

    return of


def _exchange(local: torch.Tensor, owner: TableOwner, device_mesh: Any, mesh: Mesh,
              chunk: int, scatter: bool) -> torch.Tensor:  # fmt: skip
    """One ``all_to_all_single`` of the scatter or gather; the flat received elements."""
    coordinate = device_mesh.get_coordinate()
    splits = per_rank(_splits(owner, mesh, chunk, scatter))(list(coordinate))
    n = mesh.group_size(owner.axes)
    out, inp, send = list(splits[:n]), list(splits[n : 2 * n]), splits[2 * n]
    flat = local.reshape(-1)[:send]  # the scatter: the owner's block; the others send nothing
    moved = funcol.all_to_all_single(flat, out, inp, _group(device_mesh, owner.axes))
    if isinstance(moved, funcol.AsyncCollectiveTensor):
        moved = moved.wait()
    return moved


def scatter(block: torch.Tensor, owner: TableOwner, device_mesh: Any, mesh: Mesh) -> torch.Tensor:
    """The owner's pooled ``[bags, dim]`` block, each device's slice of the bags (``[bags / n,
    dim]``) delivered to it; differentiable (its backward is the gather)."""
    n = mesh.group_size(owner.axes)
    rows = block.shape[0] // n
    moved = _exchange(block, owner, device_mesh, mesh, rows * block.shape[1], scatter=True)
    return moved.view(rows, block.shape[1])


def gather(grad: torch.Tensor, owner: TableOwner, device_mesh: Any, mesh: Mesh) -> torch.Tensor:
    """Each device's ``[bags / n, dim]`` gradient slice sent to the owner, which gets the
    ``[bags, dim]`` block; zeros of that shape on the other devices."""
    n = mesh.group_size(owner.axes)
    chunk = grad.numel()
    moved = _exchange(grad.contiguous(), owner, device_mesh, mesh, chunk, scatter=False)
    rest = grad.new_zeros(chunk * n)[moved.numel() :]  # the owner's is whole, the others empty
    return torch.cat([moved, rest]).view(grad.shape[0] * n, grad.shape[1])


# -- apply ------------------------------------------------------------------------------------
def embedding_bag(table: DTensor, ids: torch.Tensor, offsets: torch.Tensor, opts: Options,
                  result: Placements, owner: TableOwner, mesh: Mesh) -> DTensor:  # fmt: skip
    """``F.embedding_bag`` of a table-wise table: the owner pools, the rows are scattered."""
    device_mesh = table.device_mesh
    layout = Layout(device_mesh, tuple(table.placements), _owner_share(result, owner, mesh),
                    split_ids=False)  # fmt: skip
    block = _Owned.apply(table, ids, offsets, opts, layout)
    moved = scatter(block, owner, device_mesh, mesh)
    shape = (offsets.shape[0] - int(opts.include_last), table.shape[1])
    stride = (shape[1], 1)
    return DTensor.from_local(moved, device_mesh, result, run_check=False,
                              shape=torch.Size(shape), stride=stride)  # fmt: skip


class _Owned(torch.autograd.Function):
    """The owner's pooling (a plain local block) and, in backward, its table gradient."""

    @staticmethod
    def forward(ctx: Any, table: DTensor, ids: torch.Tensor, offsets: torch.Tensor,  # type: ignore[override]
                opts: Options, layout: Layout) -> torch.Tensor:  # fmt: skip
        out, _, index = lookup(table.to_local(), tuple(table.shape), ids, offsets, None, opts,
                               layout)  # fmt: skip
        ctx.index, ctx.opts, ctx.layout, ctx.table = index, opts, layout, table
        ctx.freq = _freq(ids, table.shape[0], index) if opts.scale_grad_by_freq else None
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        table, layout = ctx.table, ctx.layout
        rows = layout.rows(table.shape[0], grad.device)
        weight = table_grad(grad, ctx.index, tuple(table.to_local().shape), ctx.opts.mode, None,
                            rows, ctx.freq)  # fmt: skip
        return (
            _wrap(weight, layout.mesh, layout.gradient(), tuple(table.shape)),
            None,
            None,
            None,
            None,
        )


def _freq(ids: torch.Tensor, rows: int, index: Any) -> torch.Tensor:
    counts = torch.bincount(ids, minlength=rows).to(index.weight.dtype)
    return counts[ids].clamp(min=1)


# -- follow_plan ------------------------------------------------------------------------------
def follow_forward(follower: Any, op: Any, args: tuple, opts: Options, result: Placements,
                   owner: TableOwner) -> tuple:  # fmt: skip
    """``_embedding_bag`` of a table-wise table under ``follow_plan``: the pooled rows at the
    planned layout, torch's bookkeeping results as placeholders (never read here)."""
    table, ids, offsets = args[:3]
    mesh, device_mesh = follower.plan.mesh, follower.mesh
    layout = Layout(device_mesh, tuple(table.placements), _owner_share(result, owner, mesh),
                    split_ids=False)  # fmt: skip
    block, _, _ = lookup(_plain(table), tuple(table.shape), _plain(ids), _plain(offsets), None,
                         opts, layout)  # fmt: skip
    moved = scatter(block, owner, device_mesh, mesh)
    shape = tuple(op.results[0].type.shape)
    pooled = _wrap(moved, device_mesh, result, shape)
    whole = [Replicate()] * device_mesh.ndim
    n, bags = ids.shape[0], shape[0]
    empty = [torch.zeros(k, dtype=torch.long) for k in (n, bags, bags)]
    marks = [DTensor.from_local(t, device_mesh, whole, run_check=False) for t in empty]
    return (pooled, *marks)


def follow_backward(
    follower: Any, op: Any, args: tuple, opts: Options, owner: TableOwner
) -> DTensor:
    """``_embedding_bag_backward`` of a table-wise table: the bags' gradient gathered to the
    owner, which makes the table's gradient (zeros elsewhere, whole over the table's axes)."""
    grad, ids, offsets = args[0], args[1], args[2]
    mesh, device_mesh = follower.plan.mesh, follower.mesh
    shape = tuple(op.results[0].type.shape)
    share = _owner_share(tuple(grad.placements), owner, mesh)
    whole = tuple(Replicate() for _ in share)
    layout = Layout(device_mesh, whole, share, split_ids=False)
    block = gather(grad.to_local(), owner, device_mesh, mesh)
    ids_l, offsets_l = _plain(ids), _plain(offsets)
    rows = layout.rows(shape[0], ids_l.device)
    count = offsets_l.shape[0] - int(opts.include_last)
    index = _index(ids_l, offsets_l, None, opts, rows, layout.bag_range(count, ids_l.device))
    freq = _freq(ids_l, shape[0], index) if opts.scale_grad_by_freq else None
    weight = table_grad(block, index, shape, opts.mode, None, rows, freq)
    return _wrap(weight, device_mesh, layout.gradient(), shape)


def _plain(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t
