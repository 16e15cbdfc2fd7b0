"""Rule builders of ops that keep, drop, reorder or regroup dims: elementwise, reductions,
row-mixing ops (softmax, norms, losses, topk), transposes, reshapes, broadcasts, resizes and
slices of a loop."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .errors import IRVerifyError
from .rule_helpers import Attrs, Types, _broadcast_map, _letter_stream, _letters, _make
from .rules import ShardingRule
from .types import TensorType


def elementwise(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """n-ary elementwise with numpy broadcasting; every result has the same shape."""
    out = max(outs, key=lambda t: t.rank) if outs else max(ins, key=lambda t: t.rank)
    letters = _letters(out.rank)
    sizes = dict(zip(letters, out.shape, strict=True))
    operands = [_broadcast_map(t, out, letters) for t in ins]
    results = [_broadcast_map(t, out, letters) for t in outs]
    return _make(operands, results, sizes)


def _axes(attrs: Attrs, key: str, rank: int, default: Sequence[int]) -> list[int]:
    value = attrs.get(key, tuple(default))
    axes = [value] if isinstance(value, int) else list(value)  # type: ignore[arg-type]
    return sorted(a % rank if rank else 0 for a in axes)


def reduce(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """Reduce over ``axes`` (sum/mean/max): reduced factors are reduction factors.

    Extra operands of rank 0 (init values) get no dims; results either drop the reduced dims or
    keep them as size 1 (keepdims).
    """
    x = ins[0]
    axes = set(_axes(attrs, "axes", x.rank, range(x.rank)))
    letters = _letters(x.rank)
    sizes = dict(zip(letters, x.shape, strict=True))
    operands = [[(letters[d],) for d in range(x.rank)]] + [[] for _ in ins[1:]]
    results = [_reduced_dims(t, x, axes, letters) for t in outs]
    need = set(letters[a] for a in axes) if attrs.get("need_replication") else set()
    return _make(operands, results, sizes, need)


def _reduced_dims(t: TensorType, x: TensorType, axes: set[int], letters: list[str]) -> list:
    if t.rank == x.rank:  # keepdims
        return [() if d in axes else (letters[d],) for d in range(x.rank)]
    kept = [d for d in range(x.rank) if d not in axes]
    if len(kept) != t.rank:
        raise IRVerifyError(f"reduction of {x} over axes {sorted(axes)} cannot give {t}")
    return [(letters[d],) for d in kept]


def argreduce(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """argmax/argmin: the reduced dim cannot be split (indices are not partial sums)."""
    return reduce(ins, outs, {**attrs, "need_replication": True})


def rowwise(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """Ops that mix values along ``axis`` (softmax, norms, cross-entropy, cumsum, sort).

    The mixed axes need replication; every other dim passes through. Lower-rank tensors align
    to the leading dims when the missing dims are mixed ones (mean, rstd, labels), else to the
    trailing dims (norm weights). Batch dims missing from a result are reductions (mean loss).
    """
    x = max(ins, key=lambda t: t.rank)
    mixed = set(_axes(attrs, "axis", x.rank, [x.rank - 1]))
    letters = _letters(x.rank)
    sizes = dict(zip(letters, x.shape, strict=True))
    weights = bool(attrs.get("_trailing_weights"))  # set by `norm`: operands 1.. are weights
    operands = [_align(t, x, mixed, letters, weights and i > 0) for i, t in enumerate(ins)]
    results = [_align(t, x, mixed, letters) for t in outs]
    return _make(operands, results, sizes, {letters[a] for a in mixed})


def _align(
    t: TensorType, x: TensorType, mixed: set[int], letters: list[str], trailing: bool = False
) -> list:
    if t.rank == x.rank:
        return [(letters[d],) if t.shape[d] == x.shape[d] else () for d in range(x.rank)]
    kept = [d for d in range(x.rank) if d not in mixed]  # x's dims but the mixed ones
    if not trailing and t.rank == len(kept) and t.shape == tuple(x.shape[d] for d in kept):
        positions: Sequence[int] = kept  # labels of a loss over a middle class axis (N, C, H, W)
    else:
        leading = (
            not trailing and set(range(t.rank, x.rank)) <= mixed and t.shape == x.shape[: t.rank]
        )
        positions = range(t.rank) if leading else range(x.rank - t.rank, x.rank)
    return [
        (letters[d],) if size == x.shape[d] else ()
        for d, size in zip(positions, t.shape, strict=True)
    ]


def norm(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """layer_norm / rms_norm: weights align to the trailing dims even when x is square."""
    return rowwise(ins, outs, {**attrs, "_trailing_weights": True})


def norm_backward(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """layer_norm / rms_norm backward: the input gradient passes every row dim through; the
    weight and bias gradients sum over the rows, so a split row dim leaves them partial
    (*summed* into those results; DTensor makes them ``Partial`` too)."""
    rule = rowwise(ins, outs, attrs)
    rows = {f for dim in rule.results[0] for f in dim} - rule.need_replication
    summed = tuple(
        (f, tuple(k for k, r in enumerate(rule.results) if not any(f in d for d in r)))
        for f in sorted(rows)
    )
    summed = tuple((f, ks) for f, ks in summed if ks)
    return ShardingRule(rule.operands, rule.results, rule.sizes, rule.need_replication, summed)


def _topk(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """topk along ``axis``: values and indices share the k factor; the input axis is whole."""
    x, out = ins[0], outs[0]
    axis = _axes(attrs, "axis", x.rank, [x.rank - 1])[0]
    letters = _letters(x.rank + 1)
    k = letters[-1]
    sizes = {**dict(zip(letters, x.shape, strict=False)), k: out.shape[axis]}
    result = [(k,) if d == axis else (letters[d],) for d in range(x.rank)]
    operand = [(letters[d],) for d in range(x.rank)]
    return _make([operand], [result] * len(outs), sizes, {letters[axis]})


def transpose(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """Result dim j is operand dim ``perm[j]``."""
    x = ins[0]
    perm = list(attrs.get("perm", tuple(reversed(range(x.rank)))))  # type: ignore[arg-type]
    letters = _letters(x.rank)
    sizes = dict(zip(letters, x.shape, strict=True))
    return _make([[(f,) for f in letters]], [[(letters[p],) for p in perm]], sizes)


def reshape(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """Shardy's GCD factorisation: ``(8,4)->(2,16)`` is ``(ij)k->i(jk)`` with i=2, j=4, k=4.

    Walking both shapes, while the consumed products agree the next shared factor is the gcd of
    the remaining dim sizes; when they disagree, whole dims become input-only (need-replication)
    or output-only factors until the products meet again.
    """
    a, b = ins[0].shape, outs[0].shape
    in_f: list[list[str]] = [[] for _ in a]
    out_f: list[list[str]] = [[] for _ in b]
    sizes: dict[str, int] = {}
    need: set[str] = set()
    names = _letter_stream()
    i = j = 0
    ra, rb = (a[0] if a else 1), (b[0] if b else 1)
    done_in = done_out = 1
    while True:
        while i < len(a) and a[i] == 1:
            i += 1
            ra = a[i] if i < len(a) else 1
        while j < len(b) and b[j] == 1:
            j += 1
            rb = b[j] if j < len(b) else 1
        if i >= len(a) and j >= len(b):
            break
        f = next(names)
        g = math.gcd(ra, rb) if done_in == done_out and i < len(a) and j < len(b) else 1
        if g > 1:
            sizes[f] = g
            in_f[i].append(f)
            out_f[j].append(f)
            ra, rb, done_in, done_out = ra // g, rb // g, done_in * g, done_out * g
        elif j >= len(b) or (i < len(a) and done_in <= done_out):
            sizes[f], need = ra, need | {f}
            in_f[i].append(f)
            done_in, ra = done_in * ra, 1
        else:
            sizes[f] = rb
            out_f[j].append(f)
            done_out, rb = done_out * rb, 1
        if ra == 1 and i < len(a):
            i += 1
            ra = a[i] if i < len(a) else 1
        if rb == 1 and j < len(b):
            j += 1
            rb = b[j] if j < len(b) else 1
    return _make([[tuple(d) for d in in_f]], [[tuple(d) for d in out_f]], sizes, need)


def broadcast_in_dim(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """Operand dim i becomes result dim ``dims[i]``; an expanded size-1 dim is unmapped."""
    x, out = ins[0], outs[0]
    dims = list(attrs.get("dims", range(out.rank - x.rank, out.rank)))  # type: ignore[arg-type]
    letters = _letters(out.rank)
    sizes = dict(zip(letters, out.shape, strict=True))
    operand = [(letters[d],) if x.shape[i] == out.shape[d] else () for i, d in enumerate(dims)]
    operands = [operand] + [[] for _ in ins[1:]]
    return _make(operands, [[(f,) for f in letters]], sizes)


def resize(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """slice / pad / dynamic_slice / concat: dims that change size cannot be split in the input.

    Unchanged dims pass through. A changed dim gets an input-only need-replication factor per
    operand and an output-only factor (splitting the output of a replicated input is local).
    Extra scalar operands (start indices) get no dims.
    """
    out = outs[0]
    letters = _letter_stream()
    shared = {}
    sizes: dict[str, int] = {}
    need: set[str] = set()
    operands = []
    for t in ins:
        if t.rank != out.rank:  # index operands: their own unsplittable factors
            dims = [(next(letters),) for _ in t.shape]
            for (f,), size in zip(dims, t.shape, strict=True):
                sizes[f] = size
                need.add(f)
            operands.append(dims)
            continue
        dims = []
        for d, size in enumerate(t.shape):
            if size == out.shape[d]:
                f = shared.setdefault(d, next(letters))
            else:
                f = next(letters)
                need.add(f)
            sizes[f] = size
            dims.append((f,))
        operands.append(dims)
    result = []
    for d, size in enumerate(out.shape):
        f = shared.get(d) or next(letters)
        sizes[f] = size
        result.append((f,))
    return _make(operands, [result], sizes, need)


def iota(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """Results made from nothing (iota, zeros, full): every dim is an output-only factor."""
    return elementwise([], outs, attrs)


def scan_slice(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """``scan_index`` ([n, *d] -> [*d]) and ``scan_stack`` ([*d] -> [n, *d]): the iteration dim
    is never split (every iteration needs its whole slice); the other dims map one to one."""
    x, out = ins[0], outs[0]
    stacked = x if x.rank == out.rank + 1 else out
    letters = _letters(stacked.rank)
    sizes = dict(zip(letters, stacked.shape, strict=True))
    full, piece = [(f,) for f in letters], [(f,) for f in letters[1:]]
    operands, results = ([full], [piece]) if stacked is x else ([piece], [full])
    return _make(operands, results, sizes, {letters[0]})
