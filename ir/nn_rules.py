"""Rules of the normalisation, activation, window and recurrent ops (a block of the registry).

Batch norm in training mode is lowered (``frontend/torch/ops_nn.py``) into statistic
reductions and channelwise elementwise ops, so a split batch leaves the per-channel sums
partial and their all-reduce is priced: the statistics are the global ones, what
``SyncBatchNorm`` computes. Every op here names the channel dim of its rank-1 operands: a
``[C]`` operand or result carries the channel factor of the big tensor (``x`` dim
``attrs["channel"]``, default 1), and a ``[C]`` result drops every other factor, which makes
them reductions (partial sums over a split batch or spatial dim).

Recurrent layers (``rnn_layer``) split their batch only: the time steps run in order on one
device, the feature and gate dims stay whole. ``attrs["batch"]`` gives, per operand then per
result, the batch dim (-1: none); ``attrs["summed"]`` the results that sum over the batch (the
weight gradients: partial over a split batch).
"""

from __future__ import annotations

from .registry import register_rule
from .rule_helpers import Attrs, Types, _broadcast_map, _letters, _make, replicated_rule
from .rules import ShardingRule
from .shape_rules import elementwise
from .types import TensorType


def channelwise(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """Big tensors share every factor; ``[C]`` tensors carry only the channel factor."""
    x = max(list(ins) + list(outs), key=lambda t: t.rank)
    channel = int(attrs.get("channel", 1))  # type: ignore[call-overload]
    letters = _letters(x.rank)
    sizes = dict(zip(letters, x.shape, strict=True))

    def dims(t: TensorType) -> list[tuple[str, ...]]:
        if t.rank == x.rank:
            return [(f,) if n == sizes[f] else () for f, n in zip(letters, t.shape, strict=True)]
        if t.shape == (x.shape[channel],):
            return [(letters[channel],)]
        return [()] * t.rank  # size-1 dims (a scalar count): nothing to split

    return _make([dims(t) for t in ins], [dims(t) for t in outs], sizes)


def group_norm(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """native_group_norm(x, w, b) -> (out, mean[N, G], rstd[N, G]) and its backward
    (g, x, mean, rstd, w) -> (gx, gw, gb): the batch passes through; channels (mixed within a
    group), spatial dims and groups stay whole; the weight gradients sum over the batch."""
    x = max(ins, key=lambda t: t.rank)
    letters = _letters(x.rank + 1)
    n, c, group = letters[0], letters[1], letters[-1]
    sizes = {**dict(zip(letters, x.shape, strict=False)), group: int(attrs["groups"])}  # type: ignore[call-overload]

    def dims(t: TensorType) -> list[tuple[str, ...]]:
        if t.shape == x.shape:
            return [(f,) for f in letters[: x.rank]]
        if t.rank == 2:  # mean, rstd [N, G]
            return [(n,), (group,)]
        return [(c,)]

    summed = tuple(k for k, t in enumerate(outs) if t.rank == 1)
    rule = _make([dims(t) for t in ins], [dims(t) for t in outs], sizes, set(letters[1:]))
    if not summed:
        return rule
    return ShardingRule(rule.operands, rule.results, rule.sizes, rule.need_replication,
                        ((n, summed),))  # fmt: skip


def rnn_layer(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """One recurrent layer (forward or backward): only the batch factor may be split."""
    batch: tuple[int, ...] = attrs["batch"]  # type: ignore[assignment]
    tensors = list(ins) + list(outs)
    sizes = {t.shape[d] for t, d in zip(tensors, batch, strict=True) if d >= 0}
    if len(sizes) != 1:
        return replicated_rule(ins, outs)
    letters = iter(_letters(1 + sum(t.rank for t in tensors)))
    b = next(letters)
    factor_sizes = {b: sizes.pop()}
    per_tensor = []
    for t, d in zip(tensors, batch, strict=True):
        dims = []
        for k, size in enumerate(t.shape):
            if k == d:
                dims.append((b,))
                continue
            f = next(letters)
            factor_sizes[f] = size
            dims.append((f,))
        per_tensor.append(dims)
    rule = _make(per_tensor[: len(ins)], per_tensor[len(ins) :], factor_sizes,
                 set(factor_sizes) - {b})  # fmt: skip
    summed: tuple[int, ...] = attrs.get("summed", ())  # type: ignore[assignment]
    if not summed:
        return rule
    return ShardingRule(rule.operands, rule.results, rule.sizes, rule.need_replication,
                        ((b, tuple(summed)),))  # fmt: skip


def window(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """unfold(x, dim, size, step) -> [..., windows, ..., size] and its backward: every dim but
    the windowed one (and the window) passes through."""
    x, out = (ins[0], outs[0]) if outs[0].rank > ins[0].rank else (outs[0], ins[0])
    dim = int(attrs["dim"]) % max(x.rank, 1)  # type: ignore[call-overload]
    letters = _letters(x.rank + 2)
    whole, windows, inner = letters[dim], letters[-2], letters[-1]
    sizes = {**dict(zip(letters, x.shape, strict=False)), windows: out.shape[dim],
             inner: out.shape[-1]}  # fmt: skip
    small = [(f,) for f in letters[: x.rank]]
    big = [(windows,) if k == dim else (f,) for k, f in enumerate(letters[: x.rank])] + [(inner,)]
    operands, results = ([small], [big]) if outs[0].rank > ins[0].rank else ([big], [small])
    return _make(operands, results, sizes, {whole, windows, inner})


def strided_view(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """as_strided(x, size, stride, offset) of a contiguous ``x``: an operand dim passes
    through to a result dim of the same size and stride when everything else the view reads
    (offset and the other result dims' extent) stays inside one slab of that dim - each slice
    along it is then read on its own; every other factor needs replication."""
    x, out = ins[0], outs[0]
    size: tuple[int, ...] = attrs["size"]  # type: ignore[assignment]
    stride: tuple[int, ...] = attrs["stride"]  # type: ignore[assignment]
    offset = int(attrs.get("offset", 0))  # type: ignore[call-overload]
    own = [1] * x.rank
    for d in range(x.rank - 2, -1, -1):
        own[d] = own[d + 1] * x.shape[d + 1]
    letters = iter(_letters(x.rank + out.rank))
    operand = [(next(letters),) for _ in range(x.rank)]
    result = [(next(letters),) for _ in range(out.rank)]
    sizes = {f[0]: n for f, n in zip(operand + result, x.shape + out.shape, strict=True)}
    passing = set()
    for d in range(x.rank):
        for i in range(out.rank):
            walks = size[i] == x.shape[d] > 1 and stride[i] == own[d]
            if walks and _slab_local(size, stride, offset, i, own[d], own[d] * x.shape[d]):
                result[i] = operand[d]
                passing.add(operand[d][0])
    return _make([operand], [result], sizes, set(sizes) - passing)


def _slab_local(size: tuple, stride: tuple, offset: int, i: int, slab: int, block: int) -> bool:
    """Result dim ``i`` walks the operand dim of stride ``slab`` (``block``: its whole extent)
    and every other result dim stays inside one slab (inner: its reach plus the offset is
    under ``slab``) or steps over whole blocks (outer: a stride that is a multiple of
    ``block``), so slice ``k`` of dim ``i`` reads slab ``k`` only."""
    inner = offset
    for j, (n, s) in enumerate(zip(size, stride, strict=True)):
        if j == i or n == 1:
            continue
        if s < slab:
            inner += (n - 1) * s
        elif s % block:
            return False
    return inner < slab


def weight_norm(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """``_weight_norm_interface(v, g) -> (w, norm)`` and its backward: each slice along
    ``attrs["channel"]`` (the kept dim) is normalised on its own, so that dim passes through;
    the norm sums over every other dim, which stay whole (need replication)."""
    rule = channelwise(ins, outs, attrs)
    x = max(list(ins) + list(outs), key=lambda t: t.rank)
    kept = _letters(x.rank)[int(attrs.get("channel", 0))]  # type: ignore[call-overload]
    whole = frozenset(f for f in _letters(x.rank) if f != kept)
    return ShardingRule(rule.operands, rule.results, rule.sizes, whole, rule.summed)


ACTIVATIONS = """hardswish hardswish_backward hardsigmoid hardsigmoid_backward softplus
softplus_backward mish mish_backward elu elu_backward leaky_relu leaky_relu_backward hardtanh
hardtanh_backward log_sigmoid log_sigmoid_backward batch_norm_stat""".split()
for _kind in ACTIVATIONS:
    register_rule(_kind, elementwise)
for _kind in ("batch_norm_apply", "batch_norm_sqsum", "batch_norm_backward_reduce",
              "batch_norm_backward_elemt"):  # fmt: skip
    register_rule(_kind, channelwise)


def pointwise_loss(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """A loss of elementwise terms (binary cross-entropy with logits): every operand broadcasts
    to the logits; a scalar result (mean or sum) makes every factor a reduction (a split batch
    leaves the loss a pending sum), a full-shape one (``reduction="none"``) passes them."""
    x = ins[0]
    letters = _letters(x.rank)
    sizes = dict(zip(letters, x.shape, strict=True))
    operands = [_broadcast_map(t, x, letters) for t in ins]
    results = [[] if t.rank == 0 else _broadcast_map(t, x, letters) for t in outs]
    return _make(operands, results, sizes)


register_rule("binary_cross_entropy_with_logits", pointwise_loss)
register_rule("group_norm", group_norm)
register_rule("weight_norm", weight_norm)
register_rule("group_norm_backward", group_norm)
register_rule("rnn_layer", rnn_layer, flops="attr")
register_rule("window", window, flops="none")
register_rule("strided_view", strided_view, flops="none")
