"""Normalisation, activation and recurrent calls on local shards (``apply`` and ``follow_plan``).

DTensor has no strategy for batch/group norm, the hard/soft activations' backwards or the
recurrent kernels (``mkldnn_rnn_layer``, GRU's in-place ``transpose_``), so these calls run on
each rank's shard, with the all-reduces their semantics need issued here:

- batch norm in training mode computes the *global* statistics of a split batch (what
  ``SyncBatchNorm`` does): per-channel sums of the local shard, all-reduced, then the mean and
  the centred sum of squares (two passes, as the kernel); backward all-reduces ``sum(g)`` and
  ``sum(g * xhat)``. The result equals the plain model's training-mode batch norm;
- group norm and activations are local to a batch row / an element;
- an LSTM/GRU/RNN runs its time steps on the rank's batch rows; the weights are whole and
  their gradients come out as pending sums over the mesh dims that split the batch.

Under ``follow_plan`` (``run_step``) each IR op of the call's lowering (``ops_nn.py``) runs
on local shards with its operands moved to their planned layouts by the follower (so the
statistic all-reduces are the plan's reshards), its results made at their planned layouts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from . import halo, pool_local

Placements = tuple[Placement, ...]

ACTIVATION_NAMES = frozenset({
    "hardswish", "hardsigmoid", "softplus", "mish", "elu", "leaky_relu", "hardtanh", "relu6",
    "logsigmoid", "selu", "celu",
})  # fmt: skip
RNN_CALLS = frozenset({torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu})
CONVS = frozenset({F.conv1d, F.conv2d, F.conv3d})


def _whole(x: DTensor) -> DTensor:
    """``x`` without pending sums (a local nonlinear op needs the summed value)."""
    if not any(isinstance(p, Partial) for p in x.placements):
        return x
    want = tuple(Replicate() if isinstance(p, Partial) else p for p in x.placements)
    return x.redistribute(placements=want)


def _wrap(local: torch.Tensor, like: DTensor, placements: Placements, shape: Sequence[int]) -> Any:
    stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
    return DTensor.from_local(local, like.device_mesh, placements, run_check=False,
                              shape=torch.Size(shape), stride=stride)  # fmt: skip


# -- apply: torch-function level ------------------------------------------------------------
def intercept(func: Any, args: tuple, kwargs: dict) -> Any:
    """The call run on local shards, or ``NotImplemented`` when it is not one of ours or no
    DTensor takes part. Autograd saves the local tensors as they are (``apply``'s saved-tensor
    hook would make them replicated DTensors)."""
    if not args or not isinstance(args[0], DTensor):
        return NotImplemented
    with torch.autograd.graph.saved_tensors_hooks(_same, _same):
        return _intercept(func, args, kwargs)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _intercept(func: Any, args: tuple, kwargs: dict) -> Any:
    if func is F.batch_norm:
        return batch_norm(*args, **kwargs)
    if func is F.group_norm:
        return group_norm(*args, **kwargs)
    if func in RNN_CALLS:
        return rnn(func, args)
    if func in CONVS:
        return conv(func, *args, **kwargs)
    if func in pool_local.POOLS:
        return pool_local.pool(func, args, kwargs)
    if getattr(func, "__name__", "") in ACTIVATION_NAMES:
        return elementwise(func, args, kwargs)
    return NotImplemented


def elementwise(func: Any, args: tuple, kwargs: dict) -> DTensor:
    """An activation on the local shard, at the input's placements."""
    x = _whole(args[0])
    kwargs = {k: v for k, v in kwargs.items() if k != "inplace"}
    rest = tuple(a for a in args[1:] if not isinstance(a, bool))  # no in-place flag
    local = func(x.to_local(), *rest, **kwargs)
    return _wrap(local, x, tuple(x.placements), tuple(x.shape))


def _batch_split(x: DTensor, batch_dims: Sequence[int]) -> Placements:
    """``x``'s splits of ``batch_dims`` (as ``Shard``) per mesh dim; everything else whole."""
    return tuple(
        p if isinstance(p, Shard) and p.dim in batch_dims and x.shape[p.dim] > 1 else Replicate()
        for p in x.placements
    )


def _replicated_weight(w: Any, batch: Placements) -> Any:
    """A parameter whole on every rank, as a local tensor whose gradient is a pending sum over
    the mesh dims splitting the batch (each rank's rows contribute a part)."""
    if not isinstance(w, DTensor):
        return w
    whole = w.redistribute(placements=(Replicate(),) * w.device_mesh.ndim)
    grads = tuple(Partial() if isinstance(p, Shard) else Replicate() for p in batch)
    return whole.to_local(grad_placements=grads)


def group_norm(x: DTensor, num_groups: int, weight: Any = None, bias: Any = None,
               eps: float = 1e-5) -> DTensor:  # fmt: skip
    """Group norm mixes channels and positions of one batch row: the batch split stays."""
    x = _whole(x)
    layout = _batch_split(x, (0,))
    moved = x.redistribute(placements=layout) if tuple(x.placements) != layout else x
    w, b = _replicated_weight(weight, layout), _replicated_weight(bias, layout)
    local = F.group_norm(moved.to_local(), num_groups, w, b, eps)
    return _wrap(local, moved, layout, tuple(x.shape))


class _AllReduced(torch.autograd.Function):
    """Local per-channel sums -> their all-reduced total (a replicated DTensor). Backward: the
    total's gradient, whole, is each local sum's gradient."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, like: DTensor, placements: Placements,  # type: ignore[override]
                shape: tuple) -> DTensor:  # fmt: skip
        ctx.mesh = like.device_mesh
        pending = _wrap(local, like, placements, shape)
        return pending.redistribute(placements=tuple(
            Replicate() if isinstance(p, Partial) else p for p in placements))  # fmt: skip

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple:  # type: ignore[override]
        grad = _whole(grad)
        return grad.to_local(), None, None, None


def _stat_placements(x: DTensor, channel: int) -> Placements:
    """Placements of a ``[C]`` sum over every dim but ``channel`` of ``x``'s local shard."""
    return tuple(
        (Shard(0) if p.dim == channel else Partial()) if isinstance(p, Shard) else Replicate()
        for p in x.placements
    )


def _channel_sum(x: DTensor, local: torch.Tensor) -> DTensor:
    dims = tuple(d for d in range(x.ndim) if d != 1)
    return _AllReduced.apply(local.sum(dims), x, _stat_placements(x, 1), (x.shape[1],))


def batch_norm(x: DTensor, running_mean: Any, running_var: Any, weight: Any = None,
               bias: Any = None, training: bool = False, momentum: float | None = 0.1,
               eps: float = 1e-5) -> DTensor:  # fmt: skip
    """``F.batch_norm`` with the statistics of the whole (split) batch in training mode."""
    x = _whole(x)
    shape = [1] * x.ndim
    shape[1] = x.shape[1]
    if not training:
        mean, var = _as_dtensor(running_mean, x), _as_dtensor(running_var, x)
        out = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + eps)
        return _affine(out, weight, bias, shape)
    count = x.numel() // x.shape[1]
    local = x.to_local()
    mean = _channel_sum(x, local) / count
    centred = x - _as_dtensor(mean, x).view(shape)
    var = _channel_sum(centred, centred.to_local() ** 2) / count
    _update_running(running_mean, running_var, mean, var, count, momentum)
    out = centred * torch.rsqrt(var.view(shape) + eps)
    return _affine(out, weight, bias, shape)


def _affine(out: DTensor, weight: Any, bias: Any, shape: list) -> DTensor:
    if weight is not None:
        out = out * weight.view(shape)
    if bias is not None:
        out = out + bias.view(shape)
    return out


def _as_dtensor(t: Any, like: DTensor) -> DTensor:
    if isinstance(t, DTensor):
        return t
    return DTensor.from_local(t, like.device_mesh, [Replicate()] * like.device_mesh.ndim,
                              run_check=False)  # fmt: skip


@torch.no_grad()
def _update_running(rm: Any, rv: Any, mean: DTensor, var: DTensor, count: int,
                    momentum: float | None) -> None:  # fmt: skip
    """The running statistics, as the kernel updates them (unbiased variance)."""
    if rm is None or rv is None:
        return
    m = 0.1 if momentum is None else momentum
    whole_mean = mean.full_tensor() if isinstance(mean, DTensor) else mean
    whole_var = var.full_tensor() if isinstance(var, DTensor) else var
    rm_local = rm.to_local() if isinstance(rm, DTensor) else rm
    rv_local = rv.to_local() if isinstance(rv, DTensor) else rv
    rm_local.mul_(1 - m).add_(whole_mean.to(rm_local.dtype), alpha=m)
    rv_local.mul_(1 - m).add_(whole_var.to(rv_local.dtype) * count / max(count - 1, 1), alpha=m)


def rnn(func: Any, args: tuple) -> tuple:
    """``torch.lstm``/``gru``/``rnn_*`` (padded input) on the rank's batch rows."""
    x, hx, params, *flags = args
    if not isinstance(params, (list, tuple)):  # a packed sequence: (data, batch_sizes, ...)
        return NotImplemented
    batch_first = bool(flags[-1])
    bdim = 0 if batch_first else 1
    x = _whole(x)
    layout = _batch_split(x, (bdim,))
    moved = x.redistribute(placements=layout) if tuple(x.placements) != layout else x
    state_layout = tuple(Shard(1) if isinstance(p, Shard) else p for p in layout)
    weights = [_replicated_weight(w, layout) for w in params]
    states = hx if isinstance(hx, (list, tuple)) else (hx,)
    local_states = [_state_local(h, moved, state_layout) for h in states]
    hx_local = tuple(local_states) if isinstance(hx, (list, tuple)) else local_states[0]
    out = func(moved.to_local(), hx_local, weights, *flags)
    y = out[0]
    shape = [*x.shape[:-1], y.shape[-1]]
    results = [_wrap(y, moved, layout, shape)]
    for h, like in zip(out[1:], states, strict=True):
        results.append(_wrap(h, moved, state_layout, tuple(like.shape)))
    return tuple(results)


def conv(func: Any, x: DTensor, weight: Any, bias: Any = None, stride: Any = 1,
         padding: Any = 0, dilation: Any = 1, groups: int = 1) -> DTensor:  # fmt: skip
    """A convolution on the rank's batch rows, its spatial slab (a halo split: the
    neighbours' rows fetched by ``halo.exchange_rows``, the padding of that dim left to them)
    and, for a depthwise one (Mamba's conv1d), its channels: each rank holds whole groups, so
    it runs with the groups it holds. DTensor's rule would treat a channel split as a spatial
    one (``tp_conv``: "expected bias ... 128 elements, got [16]") or refuse a batch split over
    two mesh dims. Other splits (input channels of a dense convolution, spatial dims without
    a halo split) are gathered first. The weight and bias gradients are pending sums over the
    mesh dims splitting the batch or the rows."""
    x = _whole(x)
    kernel = list(weight.shape[2:])
    pads = halo.conv_padding(padding, kernel, halo._per_dim(dilation, len(kernel)))
    rows = [] if pads is None else halo.conv_rows(x, kernel, stride, pads, dilation)
    layout = _conv_layout(x, weight, groups, {dim for dim, *_ in rows})
    split = math.prod(x.device_mesh.size(i) for i, p in enumerate(layout) if p == Shard(1))
    moved = x.redistribute(placements=layout) if tuple(x.placements) != layout else x
    weight_layout = tuple(Shard(0) if p == Shard(1) else Replicate() for p in layout)
    grads = tuple(Partial() if isinstance(p, Shard) and p.dim != 1 else q
                  for p, q in zip(layout, weight_layout, strict=True))  # fmt: skip
    w, b = (_local_weight(t, weight_layout, grads) for t in (weight, bias))
    local_x = moved.to_local()
    if rows:
        local_x = halo.exchange_rows(local_x, rows, x.device_mesh)
        pads = list(pads or ())
        for dim, *_ in rows:
            pads[dim - 2] = 0  # the halo rows (zeros past the ends) stand in for it
        padding = pads
    local = func(local_x, w, b, stride, padding, dilation, groups // split)
    shape = list(local.shape)
    for i, p in enumerate(layout):
        if isinstance(p, Shard):
            shape[p.dim] *= x.device_mesh.size(i)
    return _wrap(local, moved, layout, shape)


def _conv_layout(x: DTensor, weight: Any, groups: int, rows: set[int]) -> Placements:
    """The input layout a convolution runs at: the batch split, the spatial ``rows`` kept
    with a halo and, for a depthwise convolution whose channels divide evenly, the channel
    split; every other split gathered."""
    depthwise = groups > 1 and groups == x.shape[1]
    mesh = x.device_mesh

    def keep(p: Placement, channels: bool) -> bool:
        return isinstance(p, Shard) and (
            p.dim == 0 or p.dim in rows or (channels and p.dim == 1 and depthwise)
        )

    layout = tuple(p if keep(p, True) else Replicate() for p in x.placements)
    split = math.prod(mesh.size(i) for i, p in enumerate(layout) if p == Shard(1))
    if x.shape[1] % split or weight.shape[0] % split:
        layout = tuple(p if keep(p, False) else Replicate() for p in x.placements)
    return layout


def _local_weight(w: Any, layout: Placements, grads: Placements) -> Any:
    """A parameter at ``layout`` as its local shard, its gradient at ``grads``."""
    if not isinstance(w, DTensor):
        return w
    moved = w.redistribute(placements=layout) if tuple(w.placements) != layout else w
    return moved.to_local(grad_placements=grads)


def _state_local(h: Any, like: DTensor, layout: Placements) -> torch.Tensor:
    """A hidden state [layers, batch, hidden] as the rank's rows (plain: sliced, no data
    moved; a DTensor: moved to the batch split)."""
    h = _as_dtensor(h, like)
    return h.redistribute(placements=layout).to_local()


# -- follow_plan: the lowering's IR ops on local shards ---------------------------------------
NN_KINDS = frozenset({
    "batch_norm_apply", "batch_norm_sqsum", "batch_norm_stat", "batch_norm_backward_reduce",
    "batch_norm_backward_elemt", "group_norm", "group_norm_backward", "rnn_layer",
    "hardswish", "hardswish_backward", "hardsigmoid", "hardsigmoid_backward", "softplus",
    "softplus_backward", "mish", "mish_backward", "elu", "elu_backward", "leaky_relu",
    "leaky_relu_backward", "hardtanh", "hardtanh_backward", "log_sigmoid",
    "log_sigmoid_backward", "weight_norm",
})  # fmt: skip
"""Kinds whose aten call the follower runs here (``handles``)."""
_BATCH_NORM = ("batch_norm_apply", "batch_norm_backward_reduce")


def interprets(plan: Any, step: Any) -> bool:
    """True for a call run op by op (batch norm's lowering): each op moves its operands from
    the layout the plan gives the value, as the plan prices each edge, so the call's operands
    arrive at those layouts rather than at the first op's."""
    return any(plan.graph.ops[i].kind in _BATCH_NORM for i in step.ops)


def handles(kinds: Sequence[str]) -> bool:
    """True for a traced call lowered to (only) these ops: it has no DTensor strategy."""
    return bool(kinds) and any(k in NN_KINDS for k in kinds)


def run_step(follower: Any, step: Any, func: Any, args: tuple, kwargs: dict,
             moved: Sequence[Any]) -> Any:  # fmt: skip
    """One traced call under ``follow_plan``: a one-op call runs the aten kernel on the local
    shards (its rule: only pass-through and summed factors are split); batch norm runs its
    lowering op by op (``_interpret``)."""
    graph = follower.plan.graph
    ops = [graph.ops[i] for i in step.ops]
    if not interprets(follower.plan, step):
        local_args, local_kwargs = _to_local((args, kwargs))
        if ops[0].kind.startswith("group_norm"):  # N: the rank's batch rows
            n = 3 if ops[0].kind == "group_norm" else 5
            local_args = (*local_args[:n], local_args[1].shape[0] if n == 5 else
                          local_args[0].shape[0], *local_args[n + 1 :])  # fmt: skip
        if (
            step.target == RNN_BACKWARD
            and _RNN_ROWS.get(step.operands[-1]) != local_args[0].shape[1]
        ):
            local_args = _fresh_workspace(local_args)
        out = func(*local_args, **local_kwargs)
        if step.target == RNN_FORWARD:  # the rows its workspace is for
            _RNN_ROWS[step.results[-1]] = local_args[0].shape[1]
        return _wrap_results(follower, step, out)
    env = {name: t for name, t in zip(step.operands, moved, strict=True) if name is not None}
    for index in step.ops:
        _interpret(follower, step, index, env)
    mask = args[9] if "backward" in step.target else (True, True, True)
    names = iter(step.results)
    return tuple(env.get(next(names) or "") if wanted else None for wanted in mask)


RNN_FORWARD = "aten.mkldnn_rnn_layer.default"
RNN_BACKWARD = "aten.mkldnn_rnn_layer_backward.default"
_RNN_ROWS: dict[str, int] = {}
"""Workspace value of a followed recurrent layer -> the local batch rows its forward ran."""


def _fresh_workspace(a: tuple) -> tuple:
    """The backward's arguments with the workspace of a forward run on these very rows.

    The kernel's workspace depends on the batch rows a rank ran; when the plan moves the
    backward's operands to another batch split than the forward's, the saved one does not fit
    (the kernel aborts). The forward is run again on the backward's local operands, with grad
    mode on: the backward runs with it off, and the kernel then makes no workspace (the
    backward rejected the undefined one: "expected scalar type Byte")."""
    forward = torch.ops.aten.mkldnn_rnn_layer.default
    # backward: (input, w0..w3, hx, cx, out, hy, cy, g_out, g_hy, g_cy, reverse, mode,
    # hidden_size, num_layers, has_biases, train, bidirectional, batch_sizes, batch_first, ws)
    with torch.enable_grad():  # the kernel makes no workspace with grad mode off (backward)
        again = forward(*a[:7], a[13], a[20], a[14], a[15], a[16], a[17], a[19], a[21], a[18])
    return (*a[:-1], again[3])


def _to_local(tree: Any) -> Any:
    if isinstance(tree, DTensor):
        return tree.to_local()
    if isinstance(tree, tuple):
        return tuple(_to_local(x) for x in tree)
    if isinstance(tree, list):
        return [_to_local(x) for x in tree]
    if isinstance(tree, dict):
        return {k: _to_local(v) for k, v in tree.items()}
    return tree


def _wrap_results(follower: Any, step: Any, out: Any) -> Any:
    """Local results as DTensors at their planned layouts (what the rule makes them)."""
    graph = follower.plan.graph
    leaves = list(out) if isinstance(out, (tuple, list)) else [out]
    wrapped = []
    names = iter(step.results)
    for t in leaves:
        if not isinstance(t, torch.Tensor):
            wrapped.append(t)
            continue
        name = next(names, None)
        if name is None:
            wrapped.append(DTensor.from_local(t, follower.mesh, [Replicate()] * follower.mesh.ndim,
                                              run_check=False))  # fmt: skip
            continue
        placements = follower._placements(None, name)
        wrapped.append(_mesh_wrap(t, follower.mesh, placements, graph.value(name).type.shape))
    return tuple(wrapped) if isinstance(out, (tuple, list)) else wrapped[0]


def _mesh_wrap(local: torch.Tensor, mesh: Any, placements: Placements, shape: Sequence[int]) -> Any:
    stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
    return DTensor.from_local(local, mesh, placements, run_check=False,
                              shape=torch.Size(shape), stride=stride)  # fmt: skip


def _interpret(follower: Any, step: Any, index: int, env: dict) -> None:
    """IR op ``index`` on local shards: operands moved to their planned layouts, results
    made at theirs (the rule's reduction factors leave them pending sums)."""
    op = follower.plan.graph.ops[index]
    operands = []
    for j, v in enumerate(op.operands):
        want = follower._placements(follower.plan.operand_shardings.get((index, j)), v.name)
        operands.append(follower._to(env[v.name], want, step).to_local())
    local = _KERNELS[op.kind](op, *operands)
    locals_ = local if isinstance(local, tuple) else (local,)
    for r, t in zip(op.results, locals_, strict=True):
        placements = follower._placements(None, r.name)
        env[r.name] = _mesh_wrap(t, follower.mesh, placements, r.type.shape)


def _channels(t: torch.Tensor, rank: int) -> torch.Tensor:
    """A [C] shard broadcast against a rank-``rank`` tensor's channel dim 1."""
    shape = [1] * rank
    shape[1] = t.shape[0]
    return t.view(shape)


def _reduced(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(d for d in range(x.ndim) if d != 1)


def _stat(op: Any, s: torch.Tensor) -> torch.Tensor:
    count = op.attrs.get("count")
    eps = op.attrs.get("eps")
    if count is None:  # eval mode: the running variance (or a running statistic as it is)
        return torch.rsqrt(s + _eps(op)) if eps else s
    if not eps:
        return s / count
    return torch.rsqrt(s / count + _eps(op))


def _eps(op: Any) -> float:
    return float(op.attrs.get("epsilon", 1e-5))


def _apply(op: Any, x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
           *affine: torch.Tensor) -> torch.Tensor:  # fmt: skip
    out = (x - _channels(mean, x.ndim)) * _channels(invstd, x.ndim)
    if affine:
        out = out * _channels(affine[0], x.ndim)
    if len(affine) > 1:
        out = out + _channels(affine[1], x.ndim)
    return out


def _backward_reduce(op: Any, g: torch.Tensor, x: torch.Tensor, mean: torch.Tensor,
                     invstd: torch.Tensor) -> tuple:  # fmt: skip
    xhat = (x - _channels(mean, x.ndim)) * _channels(invstd, x.ndim)
    return g.sum(_reduced(g)), (g * xhat).sum(_reduced(g))


def _backward_elemt(op: Any, g: torch.Tensor, x: torch.Tensor, mean: torch.Tensor,
                    invstd: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:  # fmt: skip
    scale = _channels(invstd, x.ndim)
    weight = rest[0] if len(rest) in (1, 3) else None
    if weight is not None:
        scale = scale * _channels(weight, x.ndim)
    if len(rest) < 2:  # eval mode: the statistics are constants
        return g * scale
    sum_g, sum_gx = rest[-2], rest[-1]
    count = op.results[0].type.numel // op.results[0].type.shape[1]
    xhat = (x - _channels(mean, x.ndim)) * _channels(invstd, x.ndim)
    return scale * (g - _channels(sum_g, x.ndim) / count - xhat * _channels(sum_gx, x.ndim) / count)


def _constant(op: Any) -> torch.Tensor:
    t = op.results[0].type
    return torch.zeros(t.shape)


_KERNELS: dict[str, Callable[..., Any]] = {
    "reduce_sum": lambda op, x: x.sum(tuple(op.attrs["axes"])),
    "batch_norm_stat": _stat,
    "batch_norm_sqsum": lambda op, x, mean: ((x - _channels(mean, x.ndim)) ** 2).sum(_reduced(x)),
    "batch_norm_apply": _apply,
    "batch_norm_backward_reduce": _backward_reduce,
    "batch_norm_backward_elemt": _backward_elemt,
    "constant": _constant,
}
