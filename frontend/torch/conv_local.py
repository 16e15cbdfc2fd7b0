"""Convolutions run on each rank's local shards while ``follow_plan`` replays a step.

DTensor's convolution rule knows batch splits. The IR rule (``ir/conv.py``) also splits
output channels, input channels (a pending sum), and the groups of a grouped or depthwise
convolution; for those DTensor hands the kernel the local channels with the global
``groups`` (a wrong count). So the call runs here on the local shards of the operands at
their planned layouts: ``groups`` becomes the number of groups a rank holds, and the results
are the local shards of the planned result layouts (the rule says so for every factor it lets
split). An output-only split of the spatial rows (the input whole) is computed whole and
sliced (no collective). A row split of the input (the IR's halo split) runs with a halo
exchange (``halo.py``): the neighbours' rows are fetched, the convolution runs unpadded along
the rows on the extended slab, and the backward sends the halo rows' input gradient back. A
bias runs as the IR has it: the convolution, then a broadcast add at the add's planned
layouts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ...costmodel.conv import halo_rows
from ...ir import Sharding
from . import halo, pool_local

FORWARD = "aten.convolution.default"
BACKWARD = "aten.convolution_backward.default"
WINDOW_KINDS = frozenset(
    """max_pool max_pool_backward adaptive_max_pool adaptive_max_pool_backward
avg_pool avg_pool_backward adaptive_avg_pool adaptive_avg_pool_backward upsample
upsample_backward""".split()
)
"""IR kinds of ``ir.conv.windowed``: batch and channels split, spatial output-only splits."""


def handles(plan: Any, step: Any) -> bool:
    """Whether the aten call ``step`` runs here: a convolution, or a pooling / resampling op
    lowered to a window op (DTensor has no strategy for most of their backwards)."""
    if step.target in (FORWARD, BACKWARD):
        return True
    return bool(step.ops) and plan.graph.ops[step.ops[0]].kind in WINDOW_KINDS


def aligned(plan: Any, step: Any, args: tuple) -> Any:
    """``step`` with a ``None`` result name for each gradient a run-time
    ``convolution_backward`` makes and the traced call did not (its ``output_mask`` asks for
    more), so the results line up with the call's tensors; other steps unchanged."""
    if step.target != BACKWARD or not step.ops:
        return step
    traced = plan.graph.ops[step.ops[0]].attrs.get("output_mask")
    wanted = tuple(bool(m) for m in args[10])
    if traced is None or tuple(traced) == wanted:
        return step
    names = iter(step.results)
    results = []
    for made, asked in zip(traced, wanted, strict=True):
        name = next(names, None) if made else None
        if asked:
            results.append(name)
    return dataclasses.replace(step, results=tuple(results))


def _local(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


def _local_groups(groups: int, x: Any) -> int:
    """Groups held by a rank: the input channels are (group, channel in group), group major,
    so a split channel dim is a split of the groups."""
    if groups == 1 or not isinstance(x, DTensor):
        return groups
    return groups * _local(x).shape[1] // x.shape[1]


Rows = list[tuple[int, tuple[int, ...], int, int]]
"""``(tensor dim, mesh dims, lo, hi)`` of each halo split of a convolution input."""


def _halo(x: Any, w: Any, geometry: list) -> Rows:
    """The input's spatial splits with their halos (``ir.halo``; empty without one).
    ``geometry``: stride, padding, dilation, transposed, ... as the aten call has them."""
    splits = halo.split_rows(x)
    if not splits:
        return []
    stride, padding, dilation, transposed = (list(g) if isinstance(g, (list, tuple)) else g
                                             for g in geometry[:4])  # fmt: skip
    if transposed:
        raise NotImplementedError(
            f"transposed convolution input split along rows {splits}: only a plain "
            "convolution runs with a halo exchange; pin its rows whole"
        )
    found = []
    for dim, mesh_dims in splits:
        i = dim - 2
        lo, hi = halo_rows(int(w.shape[dim]), int(dilation[i]), int(stride[i]), int(padding[i]))
        found.append((dim, mesh_dims, lo, hi))
    return found


def _unpadded(padding: Any, rows: Rows) -> list[int]:
    pads = list(padding)
    for dim, *_ in rows:
        pads[dim - 2] = 0  # the halo rows (or zeros at the ends) stand in for the padding
    return pads


def _extended(x: Any, lhs: torch.Tensor, rows: Rows) -> torch.Tensor:
    """The local input with the halo rows of each split dim (one dim after the other, so a
    2-D split gets its corners from the diagonal neighbour through the first exchange)."""
    for dim, mesh_dims, lo, hi in rows:
        lhs = halo.extend(lhs, dim, lo, hi, x.device_mesh, mesh_dims)
    return lhs


def _folded(x: Any, grad: torch.Tensor, rows: Rows) -> torch.Tensor:
    for dim, mesh_dims, lo, hi in reversed(rows):
        grad = halo.fold_back(grad, dim, lo, hi, x.device_mesh, mesh_dims)
    return grad


def run(follower: Any, step: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """The aten call ``step`` on local shards; results at their planned layouts."""
    if step.target == FORWARD:
        return _forward(follower, step, args)
    if step.target == BACKWARD:
        return _backward(follower, step, args)
    return _window(follower, step, func, args, kwargs)


def _window(follower: Any, step: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """A pool / resample call on the local batch and channel shards. The backward of an
    upsample names the input's global size: its batch and channels become the local ones."""
    local_args = [_local(a) for a in args]
    if "upsample" in step.target and "backward" in step.target:
        grad = local_args[0]
        size = list(local_args[2])
        local_args[2] = [grad.shape[0], grad.shape[1], *size[2:]]
    op = follower.plan.graph.ops[step.ops[0]]
    slab = _slab(op, args)
    if slab is not None and op.kind == "max_pool_backward":  # the indices: global -> slab
        local_args[7] = pool_local.to_slab(local_args[7], *slab)
    out = func(*local_args, **{k: _local(v) for k, v in kwargs.items()})
    if slab is not None and op.kind == "max_pool":  # the indices: slab -> global
        out = (out[0], pool_local.to_global(out[1], *slab))
    results = op.results
    if isinstance(out, torch.Tensor):
        return _wrap_result(follower, out, results[0], step, 0)
    return tuple(
        _wrap_result(follower, t, v, step, k)
        for k, (t, v) in enumerate(zip(out, results, strict=False))
    )


def _slab(op: Any, args: tuple) -> tuple | None:
    """A max pool's (or its backward's) input split along its window dims (``ir.conv``'s
    disjoint windows): the local and whole spatial shapes and the slab's offsets; None when
    its indices need no conversion (the input's window dims whole)."""
    if op.kind not in ("max_pool", "max_pool_backward"):
        return None
    x = args[int(op.kind == "max_pool_backward")]
    spatial = len(op.attrs.get("window_dims", ()))
    if not pool_local.split_window_dims(x, spatial):
        return None
    local, whole = _local(x).shape[-spatial:], x.shape[-spatial:]
    return tuple(local), tuple(whole), pool_local.slab_offsets(x, spatial)


def _strategy_result(plan: Any, index: int, k: int) -> Sharding | None:
    """Result ``k``'s layout under op ``index``'s chosen strategy (its factors' axes, partial
    over the ones summed into it), which may differ from the value's planned layout (a pinned
    value: a channel-split pool feeding row-split convolutions); None without an assignment."""
    op = plan.graph.ops[index]
    if index not in plan.assignments or op.rule is None:
        return None
    assigned = dict(plan.assignments[index])
    dims = tuple(tuple(a for f in dim for a in assigned.get(f, ())) for dim in op.rule.results[k])
    partial = {a for f in op.rule.partial_factors(k) for a in assigned.get(f, ())}
    return Sharding(dims, frozenset(partial))


def _wrap_result(follower: Any, local: torch.Tensor, value: Any, step: Any, k: int) -> DTensor:
    """Result ``k`` of the call (this rank's) at the layout the kernel computed it in, moved
    to the value's planned layout; a split the local result does not have (output rows
    computed whole from a whole input) goes through ``_wrap_planned``'s slicing."""
    made = _strategy_result(follower.plan, step.ops[0], k)
    shape = value.type.shape
    if made is None or any(a and local.shape[d] == shape[d] for d, a in enumerate(made.dims)):
        return _wrap_planned(follower, local, value, step)
    out = follower._wrap(local, tuple(follower._placements(made, value.name)))
    return follower._to(out, tuple(follower._placements(None, value.name)), step)


def _forward(follower: Any, step: Any, args: tuple) -> DTensor:
    x, w, bias = args[:3]
    geometry = list(args[3:9])
    geometry[5] = _local_groups(int(args[8]), x)
    rows = _halo(x, w, geometry)
    lhs = _extended(x, _local(x), rows)
    if rows:
        geometry[1] = _unpadded(geometry[1], rows)
    y = torch.ops.aten.convolution.default(lhs, _local(w), None, *geometry)
    value = follower.plan.graph.ops[step.ops[0]].results[0]
    name = value.name
    out = _wrap_result(follower, y, value, step, 0)
    if bias is None:
        return out
    return _add_bias(follower, step, out, name, bias)


def _add_bias(follower: Any, step: Any, out: DTensor, name: str, bias: Any) -> DTensor:
    """The IR's bias add: the convolution's result and the bias (reshaped to broadcast over
    the spatial dims) each at the add's planned operand layout. An FSDP-sharded bias is
    gathered there, as the plan prices it, not by DTensor's choice at the add."""
    add = step.ops[-1]
    operands = follower.plan.graph.ops[add].operands
    out = follower._to(out, follower._placements(
        follower.plan.operand_shardings.get((add, 0)), name), step)  # fmt: skip
    shaped = bias.reshape(bias.shape[0], *([1] * (out.ndim - 2)))
    if len(operands) > 1:
        shaped = follower._to(shaped, follower._placements(
            follower.plan.operand_shardings.get((add, 1)), operands[1].name), step)  # fmt: skip
    return out + shaped


def _backward(follower: Any, step: Any, args: tuple) -> tuple:
    grad, x, w = args[:3]
    rest = list(args[3:])
    rest[0] = [_local(grad).shape[1]] if rest[0] is not None else None  # bias_sizes
    rest[6] = _local_groups(int(args[9]), x)
    rows = _halo(x, w, rest[1:5])
    lhs = _extended(x, _local(x), rows)
    if rows:
        rest[2] = _unpadded(rest[2], rows)
    outs = list(torch.ops.aten.convolution_backward.default(_local(grad), lhs, _local(w), *rest))
    if rows and outs[0] is not None:
        outs[0] = _folded(x, outs[0], rows)
    op = follower.plan.graph.ops[step.ops[0]]
    traced = op.attrs.get("output_mask") or (True,) * len(outs)
    values = iter(enumerate(op.results))
    wrapped = []
    for k, t in enumerate(outs):
        value = next(values) if traced[k] else None
        if t is None:
            wrapped.append(None)
        elif value is not None:
            wrapped.append(_wrap_result(follower, t, value[1], step, value[0]))
        else:
            wrapped.append(_untraced_input_gradient(follower, step, k, t, (grad, x, w)))
    return tuple(wrapped)


def _untraced_input_gradient(follower: Any, step: Any, k: int, local: torch.Tensor,
                             operands: tuple) -> DTensor:  # fmt: skip
    """An input gradient the run asks for and the trace did not (HF Wav2Vec2's feature encoder
    sets ``requires_grad`` on its input at run time only): no later op reads it, so it is
    left where the kernel made it - the rank's batch rows, a pending sum over the mesh dims
    that split the output channels (each rank sums over its own), whole channels of a grouped
    convolution split as groups - and reported in ``deviations``."""
    if k != 0:
        raise NotImplementedError(
            f"{step.target}: a weight or bias gradient the trace did not make (output {k})"
        )
    grad, x, w = operands
    placements = []
    for i, p in enumerate(x.placements):
        g = grad.placements[i]
        if isinstance(p, Shard) and p.dim in (0, 1):
            placements.append(p)  # batch rows, or channels held as whole groups
        elif (isinstance(g, Shard) and g.dim == 1) or isinstance(w.placements[i], Shard):
            placements.append(Partial())
        else:
            placements.append(Replicate())
    follower.deviations.append(f"{step.target}: input gradient the trace did not make")
    return follower._wrap(local, tuple(placements))


def _wrap_planned(follower: Any, local: torch.Tensor, value: Any, step: Any) -> DTensor:
    """``local`` (this rank's result) as a DTensor at the planned layout of IR ``value``. A
    planned spatial split the local result does not have (the rows were computed whole) is
    made by slicing."""
    want = tuple(follower._placements(None, value.name))
    shape = value.type.shape
    have = tuple(
        Replicate() if isinstance(p, Shard) and p.dim >= 2 and local.shape[p.dim] == shape[p.dim]
        else p
        for p in want
    )  # fmt: skip
    out = follower._wrap(local, have)
    return out if have == want else follower._to(out, want, step)
