"""Embedding bag lookups into DTensor tables, on local shards (``apply`` and ``follow_plan``).

DTensor has no strategy for ``_embedding_bag`` (the generic fallback would run it whole,
gathering the table), so every lookup runs here at the layouts of ``ir/embedding_bag.py``:

- a mesh dim that splits the table's rows (row-wise): each rank pools the ids that fall in
  its rows (zeros for the others); the result is a plain pending sum there (``Partial``),
  reduced where the plan reduces it. In backward each rank adds the gradient rows it owns;
- a mesh dim that splits the table's columns (column-wise): the rank pools its columns, the
  result is split along the dim (``Shard(1)``) and so is the gradient;
- a mesh dim that splits the bags (data parallel, the table whole there): the rank pools its
  own bags (``Shard(0)``) and the table's gradient is a pending sum there (the all-reduce).

Jagged ids (1-D ids with offsets) are read whole (their bags are data); the bags a rank
pools are picked by masks, so every rank's tensors have the same shapes (simulated ranks
need that). Fixed-length bags (a 2-D input) split with their ids. Mean mode divides by each
bag's whole count of (non-padding) ids; max mode needs the rows whole. ``max_norm`` (an
in-place renormalisation of the table) is not run here: such a call goes to DTensor.

Under ``apply`` an ``nn.EmbeddingBag`` knows its planned layouts (``install_hooks``: the
table as the lookup consumes it, the bags as its output is split); under ``follow_plan`` the
follower moves the operands and this module computes at them (``run_step``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)

from ...ir.embedding_bag import MODES

Placements = tuple[Placement, ...]
FORWARD = ("aten._embedding_bag.default", "aten._embedding_bag_forward_only.default")
BACKWARD = ("aten._embedding_bag_backward.default", "aten._embedding_bag_dense_backward.default")
PSW_BACKWARD = "aten._embedding_bag_per_sample_weights_backward.default"


@dataclass(frozen=True, slots=True)
class Options:
    """The call's options, as the aten op numbers them."""

    mode: int = 0
    include_last: bool = False
    padding_idx: int | None = None
    scale_grad_by_freq: bool = False


@dataclass
class Index:
    """Per id of the (whole or local) id list: its local bag, row and weight on this rank."""

    bag: torch.Tensor
    """Local bag of each id (clamped into range; ``keep`` says whether it is one of ours)."""
    row: torch.Tensor
    """Local table row of each id (clamped)."""
    keep: torch.Tensor
    """The id is in one of this rank's bags and rows, and not padding."""
    weight: torch.Tensor
    """Sum/mean: the factor each id's row is pooled with (0 where not kept)."""


def _first(size: int, mesh: Any, placements: Placements, device: Any) -> torch.Tensor:
    """This rank's first index of a dim of ``size`` split as ``placements`` (a one-element
    tensor; per rank under simulated ranks): made by slicing, no data moves."""
    whole = torch.arange(size, device=device)
    return distribute_tensor(whole, mesh, list(placements), src_data_rank=None).to_local()[:1]


def _only(placements: Placements, dim: int) -> Placements:
    return tuple(p if isinstance(p, Shard) and p.dim == dim else Replicate() for p in placements)


def _split(mesh: Any, placements: Placements, dim: int) -> int:
    return math.prod(mesh.size(i) for i, p in enumerate(placements) if p == Shard(dim))


def _index(ids: torch.Tensor, offsets: torch.Tensor, psw: Any, opts: Options, rows: tuple,
           bags: tuple) -> Index:  # fmt: skip
    """Which local bag and row each id goes to (``rows``/``bags``: (first, count) on this rank;
    first is a one-element tensor). ``ids``/``offsets``: the rank's (whole or local) lists."""
    count = offsets.shape[0] - int(opts.include_last)
    base = offsets[:1]
    starts = offsets[:count] - base
    end = offsets[count:] - base if opts.include_last else starts.new_full((1,), ids.shape[0])
    position = torch.arange(ids.shape[0], device=ids.device)
    bag = torch.searchsorted(starts, position, right=True) - 1
    valid = (bag >= 0) & (position < end)
    bag = bag.clamp(min=0)
    local = bag - bags[0]
    row = ids - rows[0]
    keep = valid & (local >= 0) & (local < bags[1]) & (row >= 0) & (row < rows[1])
    real = valid if opts.padding_idx is None else valid & (ids != opts.padding_idx)
    keep = keep & real
    weight = keep.to(torch.float32) if psw is None else psw * keep.to(psw.dtype)
    if opts.mode == 1:  # mean: over the bag's whole count of real ids
        counts = torch.zeros(count, dtype=weight.dtype, device=ids.device)
        counts = counts.index_add(0, bag, real.to(weight.dtype))
        weight = weight / counts[bag].clamp(min=1)
    return Index(local.clamp(0, bags[1] - 1), row.clamp(0, rows[1] - 1), keep, weight)


def pool(table: torch.Tensor, index: Index, bags: int, mode: int) -> tuple[torch.Tensor, Any]:
    """The rank's pooled rows ``[bags, columns]`` (and, in max mode, the id of each max)."""
    columns = table.shape[1]
    if mode != 2:
        rows = table[index.row] * index.weight.to(table.dtype).unsqueeze(1)
        out = torch.zeros(bags, columns, dtype=table.dtype, device=table.device)
        return out.index_add(0, index.bag, rows), None
    target = torch.where(index.keep, index.bag, bags).unsqueeze(1).expand(-1, columns)
    rows = table[index.row]
    out = torch.full((bags + 1, columns), -math.inf, dtype=table.dtype, device=table.device)
    out = out.scatter_reduce(0, target, rows, "amax")
    hit = (rows == out.gather(0, target)) & index.keep.unsqueeze(1)
    ids = torch.where(hit, index.row.unsqueeze(1).expand(-1, columns), table.shape[0])
    first = torch.full((bags + 1, columns), table.shape[0], device=table.device)
    argmax = first.scatter_reduce(0, target, ids, "amin")[:bags]
    empty = argmax == table.shape[0]
    return out[:bags].masked_fill(empty, 0.0), argmax.masked_fill(empty, -1)


def table_grad(grad: torch.Tensor, index: Index, shape: tuple, mode: int, argmax: Any,
               rows: tuple, freq: Any) -> torch.Tensor:  # fmt: skip
    """The rank's rows of the table's gradient ``shape`` from its bags' gradient."""
    out = torch.zeros(shape, dtype=grad.dtype, device=grad.device)
    if mode == 2:
        row = argmax - rows[0]
        ok = (argmax >= 0) & (row >= 0) & (row < shape[0])
        return out.scatter_add(0, row.clamp(0, shape[0] - 1), grad * ok.to(grad.dtype))
    weight = index.weight.to(grad.dtype) if freq is None else index.weight.to(grad.dtype) / freq
    return out.index_add(0, index.row, grad[index.bag] * weight.unsqueeze(1))


def psw_grad(grad: torch.Tensor, table: torch.Tensor, index: Index) -> torch.Tensor:
    """The per-sample weights' gradient on this rank's bags, rows and columns (a part)."""
    dots = (grad[index.bag] * table[index.row]).sum(1)
    return dots * index.keep.to(dots.dtype)


# -- layouts --------------------------------------------------------------------------------
@dataclass
class Layout:
    """Where one lookup's work is split (per mesh dim) and this rank's share of it."""

    mesh: Any
    table: Placements
    """The table's placements (rows ``Shard(0)``, columns ``Shard(1)``)."""
    bags: Placements
    """The pooled result's bag split (``Shard(0)`` where the bags are split, else Replicate)."""
    split_ids: bool
    """Fixed-length bags split with their ids: the rank holds only its bags' ids."""

    def rows(self, size: int, device: Any) -> tuple:
        if not any(p == Shard(0) for p in self.table):
            return (torch.zeros(1, dtype=torch.long, device=device), size)
        first = _first(size, self.mesh, _only(self.table, 0), device)
        return (first, size // _split(self.mesh, self.table, 0))

    def bag_range(self, count: int, device: Any) -> tuple:
        """This rank's (first, count) among the ``count`` bags of its id list."""
        if self.split_ids or not any(p == Shard(0) for p in self.bags):
            return (torch.zeros(1, dtype=torch.long, device=device), count)
        first = _first(count, self.mesh, self.bags, device)
        return (first, count // _split(self.mesh, self.bags, 0))

    def result(self) -> Placements:
        """The pooled result's placements: pending over rows, split over columns and bags."""
        return tuple(
            Partial() if t == Shard(0) else Shard(1) if t == Shard(1) else b
            for t, b in zip(self.table, self.bags, strict=True)
        )

    def gradient(self) -> Placements:
        """The table gradient's placements: split as the table, pending over split bags."""
        return tuple(
            t if isinstance(t, Shard) else Partial() if b == Shard(0) else Replicate()
            for t, b in zip(self.table, self.bags, strict=True)
        )


def _whole(t: Any, mesh: Any, keep_bags: Placements | None = None) -> torch.Tensor:
    """A plain local tensor of ``t``: whole (gathered), or split over the bags as given."""
    if not isinstance(t, DTensor):
        return t
    want = keep_bags or (Replicate(),) * mesh.ndim
    if tuple(t.placements) != want:
        t = t.redistribute(placements=want)
    return t.to_local()


def _wrap(local: torch.Tensor, mesh: Any, placements: Placements, shape: tuple) -> DTensor:
    stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
    return DTensor.from_local(local, mesh, placements, run_check=False,
                              shape=torch.Size(shape), stride=stride)  # fmt: skip


# -- apply: F.embedding_bag on a DTensor table -------------------------------------------------
_PLANNED: list[tuple[Placements | None, Placements | None, Any]] = []
"""(table, result) placements of the ``nn.EmbeddingBag`` running now (``install_hooks``), and
its ``TableOwner`` with the plan's mesh when it is table-wise (``bags_owned``), else None."""


def install_hooks(plan: Any, context: Any, model: nn.Module) -> None:
    """Each ``nn.EmbeddingBag`` of the plan tells its lookup the planned layouts: the table as
    the lookup consumes it, the result's split of the bags."""
    from .bags_owned import owners_by_table
    from .emit import consumed_layout, placements_of

    owners = owners_by_table(plan)
    for path, module in model.named_modules():
        value = context.module_outputs.get(path)
        weight = context.param_values.get(f"{path}.weight" if path else "weight")
        if not isinstance(module, nn.EmbeddingBag) or value is None or weight is None:
            continue
        table = placements_of(consumed_layout(plan, weight, path), plan.mesh, weight)
        result = placements_of(plan.shardings[value], plan.mesh, value)
        owner = owners.get(weight)
        placed = None if owner is None else (owner, plan.mesh)
        planned = (tuple(Replicate() if isinstance(p, Partial) else p for p in table), result,
                   placed)  # fmt: skip
        module.register_forward_pre_hook(lambda m, a, planned=planned: _PLANNED.append(planned))
        module.register_forward_hook(lambda m, a, o: _PLANNED.pop() and None, always_call=True)


def embedding_bag(
    input: Any, weight: DTensor, offsets: Any = None, max_norm: Any = None,
    norm_type: float = 2.0, scale_grad_by_freq: bool = False, mode: str = "mean",
    sparse: bool = False, per_sample_weights: Any = None, include_last_offset: bool = False,
    padding_idx: int | None = None,
) -> Any:  # fmt: skip
    """``F.embedding_bag`` with a DTensor table, at the planned layouts (module docstring);
    ``NotImplemented`` for a ``max_norm`` call (DTensor's then)."""
    if max_norm is not None:
        return NotImplemented
    mesh = weight.device_mesh
    planned_table, planned_result, placed = _PLANNED[-1] if _PLANNED else (None, None, None)
    table = weight
    if planned_table is not None and tuple(weight.placements) != planned_table:
        table = weight.redistribute(placements=planned_table)
    bags = tuple(Shard(0) if p == Shard(0) else Replicate() for p in planned_result or ())
    bags = bags or (Replicate(),) * mesh.ndim
    if any(t == Shard(0) and b == Shard(0) for t, b in zip(table.placements, bags, strict=True)):
        table = table.redistribute(placements=tuple(  # rows and bags on one dim: gather rows
            Replicate() if b == Shard(0) else t for t, b in zip(table.placements, bags,
                                                                strict=True)))  # fmt: skip
    ids = input
    if ids.dim() == 2:  # fixed-length bags: torch's flattening, done here on whole ids
        length = ids.shape[1]
        ids = _whole(ids, mesh).reshape(-1)
        offsets = torch.arange(0, ids.shape[0], length, device=ids.device)
        psw = per_sample_weights
        per_sample_weights = None if psw is None else _whole(psw, mesh).reshape(-1)
    opts = Options(MODES.index(mode), include_last_offset,
                   None if padding_idx is None else padding_idx % weight.shape[0],
                   scale_grad_by_freq)  # fmt: skip
    if placed is not None and planned_result is not None:  # table-wise: the owner pools
        from . import bags_owned

        owner, plan_mesh = placed
        return bags_owned.embedding_bag(table, _whole(ids, mesh), _whole(offsets, mesh), opts,
                                        planned_result, owner, plan_mesh)  # fmt: skip
    layout = Layout(mesh, tuple(table.placements), bags, split_ids=False)
    return _Bag.apply(table, _whole(ids, mesh), _whole(offsets, mesh), per_sample_weights,
                      opts, layout)  # fmt: skip


class _Bag(torch.autograd.Function):
    """The lookup and its backward on local shards (``apply``)."""

    @staticmethod
    def forward(ctx: Any, table: DTensor, ids: torch.Tensor, offsets: torch.Tensor, psw: Any,  # type: ignore[override]
                opts: Options, layout: Layout) -> DTensor:  # fmt: skip
        psw_local = _whole(psw, layout.mesh)
        out, argmax, index = lookup(table.to_local(), tuple(table.shape), ids, offsets,
                                    psw_local, opts, layout)  # fmt: skip
        ctx.index, ctx.argmax, ctx.opts, ctx.layout = index, argmax, opts, layout
        ctx.table, ctx.psw = table, psw
        ctx.freq = _freq(ids, table.shape[0], index) if opts.scale_grad_by_freq else None
        shape = (offsets.shape[0] - int(opts.include_last), table.shape[1])
        return _wrap(out, layout.mesh, layout.result(), shape)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple:  # type: ignore[override]
        layout, table = ctx.layout, ctx.table
        want = tuple(Replicate() if isinstance(p, Partial) else p for p in layout.result())
        local = grad.redistribute(placements=want).to_local()
        rows = layout.rows(table.shape[0], local.device)
        shape = tuple(table.to_local().shape)
        weight = table_grad(local, ctx.index, shape, ctx.opts.mode, ctx.argmax, rows, ctx.freq)
        weight_grad = _wrap(weight, layout.mesh, layout.gradient(), tuple(table.shape))
        psw = None
        if isinstance(ctx.psw, torch.Tensor) and ctx.psw.requires_grad:
            part = psw_grad(local, table.to_local(), ctx.index)
            psw = _psw_result(part, ctx.psw, layout)
        return weight_grad, None, None, psw, None, None


def _psw_result(part: torch.Tensor, psw: Any, layout: Layout) -> Any:
    """The per-sample weights' gradient: a pending sum over every split dim of the lookup."""
    if not isinstance(psw, DTensor):
        summed = _wrap(part, layout.mesh, (Partial(),) * layout.mesh.ndim, tuple(part.shape))
        return summed.full_tensor()
    pending = tuple(
        Partial() if isinstance(t, Shard) or b == Shard(0) else Replicate()
        for t, b in zip(layout.table, layout.bags, strict=True)
    )
    return _wrap(part, layout.mesh, pending, tuple(part.shape)).redistribute(
        placements=tuple(psw.placements)
    )


def _freq(ids: torch.Tensor, rows: int, index: Index) -> torch.Tensor:
    """Each id's count in the whole batch (``scale_grad_by_freq``)."""
    counts = torch.bincount(ids, minlength=rows).to(index.weight.dtype)
    return counts[ids].clamp(min=1)


def lookup(table: torch.Tensor, shape: tuple, ids: torch.Tensor, offsets: torch.Tensor,
           psw: Any, opts: Options, layout: Layout) -> tuple:  # fmt: skip
    """The rank's pooled rows, max ids and id index for its share (``layout``)."""
    count = offsets.shape[0] - int(opts.include_last)
    rows = layout.rows(shape[0], ids.device)
    bags = layout.bag_range(count, ids.device)
    index = _index(ids, offsets, psw, opts, rows, bags)
    out, argmax = pool(table, index, bags[1], opts.mode)
    if argmax is not None:
        argmax = argmax + rows[0]  # global row ids, as torch's max_indices
    return out, argmax, index


# -- follow_plan: the traced aten calls at their planned layouts --------------------------------
def handles(target: str) -> bool:
    return target in FORWARD or target in BACKWARD or target == PSW_BACKWARD


def _options(attrs: dict) -> Options:
    mode = MODES.index(str(attrs.get("mode", "sum")))
    padding = attrs.get("padding_idx")
    return Options(mode, bool(attrs.get("include_last_offset")),
                   None if padding is None else int(padding),  # type: ignore[call-overload]
                   bool(attrs.get("scale_grad_by_freq")))  # fmt: skip


def _local(t: Any) -> Any:
    """A plain local tensor; pending sums (not planned for these operands) reduced first."""
    if not isinstance(t, DTensor):
        return t
    if any(isinstance(p, Partial) for p in t.placements):
        t = t.redistribute(placements=tuple(
            Replicate() if isinstance(p, Partial) else p for p in t.placements))  # fmt: skip
    return t.to_local()


def _bag_dims(placements: Placements) -> Placements:
    return tuple(Shard(0) if p == Shard(0) else Replicate() for p in placements)


def _split_ids(op: Any, ids: Any) -> bool:
    return (
        bool(op.attrs.get("fixed_bag"))
        and isinstance(ids, DTensor)
        and any(p == Shard(0) for p in ids.placements)
    )


def _replicated(t: torch.Tensor, mesh: Any) -> DTensor:
    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)


def run_step(follower: Any, step: Any, args: tuple) -> Any:
    """One traced bag call under ``follow_plan`` (operands already at their planned layouts)."""
    from . import bags_owned

    op = follower.plan.graph.ops[step.ops[0]]
    if step.target in FORWARD:
        owner = bags_owned.owners_by_table(follower.plan).get(op.operands[0].name)
        if owner is not None:  # table-wise: the owner pools, the rows are scattered
            planned = follower._placements(None, step.results[0])
            return bags_owned.follow_forward(follower, op, args, _options(op.attrs), planned,
                                             owner)  # fmt: skip
        return _follow_forward(follower, step, op, args)
    if step.target in BACKWARD:
        owner = bags_owned.owners_by_module(follower.plan).get(op.origin.module)
        if owner is not None:
            return bags_owned.follow_backward(follower, op, args, _options(op.attrs), owner)
        return _follow_backward(follower, step, op, args)
    return _follow_psw(follower, step, op, args)


def _follow_forward(follower: Any, step: Any, op: Any, args: tuple) -> tuple:
    """``_embedding_bag``: the pooled rows at the planned result layout; torch's bookkeeping
    results (no IR values; this module's backward does not read them) as placeholders."""
    table, ids, offsets = args[:3]
    psw = args[6] if len(args) > 6 else None
    mesh, opts = follower.mesh, _options(op.attrs)
    layout = Layout(mesh, tuple(table.placements), _pooled_bags(follower, step),
                    _split_ids(op, ids))  # fmt: skip
    out, argmax, _ = lookup(_local(table), tuple(table.shape), _local(ids), _local(offsets),
                            _local(psw), opts, layout)  # fmt: skip
    shape = tuple(op.results[0].type.shape)
    pooled = _wrap(out, mesh, layout.result(), shape)
    planned = follower._placements(None, step.results[0])
    if layout.bags != _bag_dims(planned):  # max ids whole, pooled rows split: a local slice
        pooled = pooled.redistribute(placements=planned)
    n, bags = ids.shape[0], shape[0]
    offset2bag = _replicated(torch.zeros(n, dtype=torch.long), mesh)
    bag_size = _replicated(torch.zeros(bags, dtype=torch.long), mesh)
    if argmax is None:
        return pooled, offset2bag, bag_size, _replicated(torch.zeros(bags, dtype=torch.long), mesh)
    return pooled, offset2bag, bag_size, _wrap(argmax, mesh, layout.result(), shape)


def _pooled_bags(follower: Any, step: Any) -> Placements:
    """The bag split the lookup pools at: its pooled result's, and in max mode only where the
    max ids are split too (a pin may slice the pooled rows at the producer, for free, and
    leave the max ids whole: pooling only this rank's bags would make them split)."""
    bags = _bag_dims(follower._placements(None, step.results[0]))
    if len(step.results) > 3 and step.results[3] is not None:  # max mode: max_indices
        ids = _bag_dims(follower._placements(None, step.results[3]))
        bags = tuple(b if b == i else Replicate() for b, i in zip(bags, ids, strict=True))
    return bags


def _follow_backward(follower: Any, step: Any, op: Any, args: tuple) -> DTensor:
    """``_embedding_bag_backward``: the table's gradient at its planned layout."""
    grad, ids, offsets, max_indices = args[0], args[1], args[2], args[5]
    psw = args[10] if len(args) > 10 else None
    mesh, opts = follower.mesh, _options(op.attrs)
    planned = follower._placements(None, step.results[0])
    table = tuple(p if isinstance(p, Shard) else Replicate() for p in planned)
    layout = Layout(mesh, table, _bag_dims(tuple(grad.placements)), _split_ids(op, ids))
    ids_l, offsets_l = _local(ids), _local(offsets)
    shape = tuple(op.results[0].type.shape)
    rows = layout.rows(shape[0], ids_l.device)
    count = offsets_l.shape[0] - int(opts.include_last)
    index = _index(ids_l, offsets_l, _local(psw), opts, rows, layout.bag_range(count, ids_l.device))
    local_shape = (rows[1], shape[1] // _split(mesh, table, 1))
    freq = _freq(ids_l, shape[0], index) if opts.scale_grad_by_freq else None
    argmax = _local(max_indices) if opts.mode == 2 else None
    weight = table_grad(_local(grad), index, local_shape, opts.mode, argmax, rows, freq)
    return _wrap(weight, mesh, layout.gradient(), shape)


def _follow_psw(follower: Any, step: Any, op: Any, args: tuple) -> DTensor:
    """``_embedding_bag_per_sample_weights_backward``: each id's dot with its bag's gradient,
    a pending sum over the dims that split the lookup (split with fixed bags' ids)."""
    grad, table, ids, offsets = args[:4]
    mesh, opts = follower.mesh, _options(op.attrs)
    split_ids = _split_ids(op, ids)
    layout = Layout(mesh, tuple(table.placements), _bag_dims(tuple(grad.placements)), split_ids)
    ids_l, offsets_l = _local(ids), _local(offsets)
    count = offsets_l.shape[0] - int(opts.include_last)
    rows = layout.rows(table.shape[0], ids_l.device)
    index = _index(ids_l, offsets_l, None, opts, rows, layout.bag_range(count, ids_l.device))
    part = psw_grad(_local(grad), _local(table), index)
    placements = tuple(
        Shard(0) if split_ids and b == Shard(0)
        else Partial() if isinstance(t, Shard) or b == Shard(0) else Replicate()
        for t, b in zip(layout.table, layout.bags, strict=True)
    )  # fmt: skip
    return _wrap(part, mesh, placements, tuple(op.results[0].type.shape))
