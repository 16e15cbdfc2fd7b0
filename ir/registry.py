"""The rule registry: canonical op kind -> sharding rule builder (and a FLOP estimate).

Adding an op is one line::

    register_rule("gelu", elementwise)              # shape-generic builder
    register_rule("dot", "ik,kj->ij", flops="dot")  # fixed factor spec

A builder gets the operand and result types and the op attributes and returns a ShardingRule.
An unknown kind gets the safe rule (every factor need-replication) and an UnsupportedOpWarning.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .errors import IRVerifyError, UnsupportedOpWarning
from .rules import FACTOR_LETTERS, ShardingRule
from .types import TensorType

Types = Sequence[TensorType]
Attrs = Mapping[str, object]
RuleBuilder = Callable[[Types, Types, Attrs], ShardingRule]
FlopModel = (
    str  # "dot": 2 x product of factor sizes; "elementwise": result elements; "attention"; "none";
    # "attr": attrs["flops"]
    | Callable[[Types, Types, Attrs], float]  # a function of the shapes (convolution)
)


@dataclass(frozen=True, slots=True)
class OpInfo:
    build: RuleBuilder
    flops: FlopModel = "elementwise"
    linear: bool = False
    """f(sum of partials) == sum of f(partials) with *every* operand partial (add, reshape,
    convert, reduce_sum...), so pending sums may flow through unchanged. Bilinear ops (dot) are
    not linear in this sense."""


_REGISTRY: dict[str, OpInfo] = {}
_BUILT: dict[tuple, ShardingRule] = {}
"""Rules already built, by (kind, operand types, result types, attrs): a layer stack lowers the
same ops over and over, and rules are immutable. Cleared whenever a rule is registered."""


def register_rule(
    kind: str,
    rule: str | RuleBuilder,
    need_replication: str = "",
    flops: FlopModel = "elementwise",
    linear: bool = False,
) -> None:
    """Register a canonical op: a fixed spec like ``"ik,kj->ij"`` or a builder function."""
    _BUILT.clear()
    if isinstance(rule, str):
        spec = rule

        def build(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
            return ShardingRule.from_spec(
                spec, [t.shape for t in ins], [t.shape for t in outs], need_replication
            )

        _REGISTRY[kind] = OpInfo(build, flops, linear)
    else:
        _REGISTRY[kind] = OpInfo(rule, flops, linear)


BytesModel = Callable[..., float]
"""``(ins, outs, in_shards, out_shards, attrs, split) -> bytes`` one device moves for an op
whose HBM traffic is not its operands and results (a lookup reads rows, not the table)."""
_BYTES: dict[str, BytesModel] = {}


def register_bytes(kind: str, model: BytesModel) -> None:
    """Give ``kind`` its own HBM-bytes model (``op_bytes`` uses it instead of the sizes)."""
    _BYTES[kind] = model


def known_kinds() -> list[str]:
    return sorted(_REGISTRY)


def op_info(kind: str) -> OpInfo | None:
    return _REGISTRY.get(kind)


def rule_for(kind: str, ins: Types, outs: Types, attrs: Attrs, origin: object = "") -> ShardingRule:
    """The rule for one op; unknown kinds get the safe rule and a warning naming op and origin."""
    info = _REGISTRY.get(kind)
    if info is None:
        where = f" at {origin}" if str(origin) else ""
        warnings.warn(
            f"no sharding rule for op {kind!r}{where}; it will run replicated "
            "(register one with shardplan.ir.register_rule to let it shard)",
            UnsupportedOpWarning,
            stacklevel=3,
        )
        return replicated_rule(ins, outs)
    try:
        key = (kind, tuple(ins), tuple(outs), tuple(sorted(attrs.items())))
        hash(key)
    except TypeError:  # an unhashable attribute: build it every time
        return info.build(ins, outs, attrs)
    if key not in _BUILT:
        _BUILT[key] = info.build(ins, outs, attrs)
    return _BUILT[key]


VIEW_KINDS: frozenset[str] = frozenset(
    {"reshape", "transpose", "broadcast_in_dim", "broadcast", "scan_carry", "scan_loop"}
)
"""Layout-only ops: no kernel reads or writes HBM for them. PyTorch runs ``view``, ``t``,
``transpose``, ``permute`` and ``expand`` as stride changes (a copy is traced as its own
``clone``/``copy``), cuBLAS reads a transposed operand through its ``op(A)`` flag, and XLA turns
reshapes and transposes into bitcasts or fuses them into their consumer. A loop's carry stays in
its buffer from one iteration to the next (``scan_carry``, ``scan_loop``)."""


IN_PLACE_WRITES: dict[str, int] = {"index_copy": -1, "dynamic_update_slice": 1}
"""Ops that write a slice of their first operand's buffer in place -> the operand index of the
written rows. A KV-cache write is one: torch's ``index_copy_`` mutates the buffer, and XLA runs
a ``dynamic-update-slice`` in place in its operand's buffer (always for a donated or loop-carried
buffer), so only the update is read and written."""


def op_bytes(  # type: ignore[no-untyped-def]
    kind: str,
    ins: Types,
    outs: Types,
    in_shards,
    out_shards,
    on_chip_ins: Sequence[bool] = (),
    on_chip_outs: Sequence[bool] = (),
    attrs: Attrs | None = None,
    split: int = 1,
) -> float:
    """HBM bytes one device moves for an op: its local operands and results; 0 for views.

    ``in_shards``/``out_shards``: the number of shards of each operand/result (layouts).
    ``on_chip_ins``/``on_chip_outs``: operands read and results kept on chip by a fused kernel
    (``costmodel.fusion``); they move no HBM bytes. Empty: none.
    ``attrs``/``split``: the op's attributes and its strategy's split (the product of the axes
    its factors use), for a kind with its own model (``register_bytes``)."""
    if kind in _BYTES:
        return float(_BYTES[kind](ins, outs, in_shards, out_shards, attrs or {}, split))
    if kind in VIEW_KINDS:
        return 0.0
    if kind in IN_PLACE_WRITES:  # reads the new rows and writes them, not the buffer
        k = IN_PLACE_WRITES[kind]
        return 2.0 * (ins[k].nbytes // in_shards[k])
    if kind in ("scan_index", "scan_stack"):  # slices read and written: scan_index runs once
        return 2.0 * (ins[0].nbytes // in_shards[0])  # for all of them, scan_stack per iteration
    skip_in = on_chip_ins or (False,) * len(ins)
    skip_out = on_chip_outs or (False,) * len(outs)
    total = sum(t.nbytes // n for t, n, s in zip(ins, in_shards, skip_in, strict=True) if not s)
    return total + sum(
        t.nbytes // n for t, n, s in zip(outs, out_shards, skip_out, strict=True) if not s
    )


def op_flops(
    kind: str, rule: ShardingRule, ins: Types, outs: Types, attrs: Attrs | None = None
) -> float:
    """Global FLOPs of one op, from its factor sizes (sharding divides them evenly).

    A causal fused attention (``attrs["causal"]``) does half the dense work: the kernel skips
    the key blocks above the diagonal (FlashAttention's count)."""
    info = _REGISTRY.get(kind)
    model = info.flops if info else "elementwise"
    if callable(model):
        return float(model(ins, outs, attrs or {}))
    if model == "dot":
        return 2.0 * math.prod(rule.size_of.values())
    if model in ("attention", "attention_backward"):
        backward = model == "attention_backward"
        causal = 0.5 if attrs and attrs.get("causal") else 1.0
        return _attention_flops(ins, backward) * (2.5 if backward else 1.0) * causal
    if model == "none":
        return 0.0
    if model == "attr":  # counted at capture (a shard_map body: ``ir/regions.py``)
        return float((attrs or {}).get("flops", 0.0))  # type: ignore[arg-type]
    return float(sum(t.numel for t in outs))


def _attention_flops(ins: Types, backward: bool) -> float:
    """QK^T and PV: 2*b*h*s*t*(d+e) from q[b,h,s,d], k[b,h,t,d], v[b,h,t,e].

    The backward of an attention op lists grad_out first; its q/k/v follow (see
    attention_backward), so the shapes are found by rank-4 operands in order.
    """
    four = [t.shape for t in ins if t.rank == 4][int(backward) :]
    if len(four) < 3:
        return float(sum(t.numel for t in ins))
    q, k, v = four[:3]
    b, h, s, d = q
    return 2.0 * b * h * s * k[2] * (d + v[3])


# -- rule builders ---------------------------------------------------------------------------


def _letters(n: int) -> list[str]:
    if n > len(FACTOR_LETTERS):
        raise IRVerifyError(
            f"an op with {n} factors exceeds the {len(FACTOR_LETTERS)} rule letters"
        )
    return list(FACTOR_LETTERS[:n])


def _letter_stream():
    """Factor letters in order; a clear error (not StopIteration) if an op needs more."""
    yield from FACTOR_LETTERS
    raise IRVerifyError(
        f"an op needs more than {len(FACTOR_LETTERS)} factors; split it (e.g. concat in groups)"
    )


def _make(
    operands: list[list[tuple[str, ...]]],
    results: list[list[tuple[str, ...]]],
    sizes: dict[str, int],
    need_replication: set[str] | frozenset[str] = frozenset(),
    summed: tuple[tuple[str, tuple[int, ...]], ...] = (),
) -> ShardingRule:
    order: list[str] = []
    for t in operands + results:
        for dim in t:
            order.extend(f for f in dim if f not in order)
    return ShardingRule(
        tuple(tuple(t) for t in operands),
        tuple(tuple(t) for t in results),
        tuple((f, sizes[f]) for f in order),
        frozenset(need_replication) & frozenset(order),
        summed,
    )


def replicated_rule(ins: Types, outs: Types) -> ShardingRule:
    """Safe rule: every dimension its own need-replication factor."""
    letters = iter(_letters(sum(t.rank for t in list(ins) + list(outs))))
    sizes: dict[str, int] = {}
    tensors = []
    for t in list(ins) + list(outs):
        dims = []
        for size in t.shape:
            f = next(letters)
            sizes[f] = size
            dims.append((f,))
        tensors.append(dims)
    return _make(tensors[: len(ins)], tensors[len(ins) :], sizes, set(sizes))


def _broadcast_map(t: TensorType, result: TensorType, letters: list[str]) -> list[tuple[str, ...]]:
    """Right-aligned (numpy) broadcasting of ``t`` against the result's factor letters."""
    offset = result.rank - t.rank
    if offset < 0:
        raise IRVerifyError(f"operand {t} has higher rank than the elementwise result {result}")
    dims: list[tuple[str, ...]] = []
    for i, size in enumerate(t.shape):
        full = result.shape[offset + i]
        if size == full:
            dims.append((letters[offset + i],))
        elif size == 1:
            dims.append(())
        else:
            raise IRVerifyError(f"operand {t} does not broadcast to {result}")
    return dims


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


def dot_general(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """XLA dot_general: batch pairs, lhs free, rhs free -> result; contracting pairs reduce.

    Attributes: ``lhs_contracting``, ``rhs_contracting``, ``lhs_batch``, ``rhs_batch`` (tuples).
    """
    lhs, rhs = ins[0], ins[1]
    lc, rc = (
        list(attrs.get("lhs_contracting", (lhs.rank - 1,))),
        list(attrs.get("rhs_contracting", (0,))),
    )  # type: ignore[arg-type]
    lb, rb = list(attrs.get("lhs_batch", ())), list(attrs.get("rhs_batch", ()))  # type: ignore[arg-type]
    letters = _letter_stream()
    lhs_f: list[str] = [""] * lhs.rank
    rhs_f: list[str] = [""] * rhs.rank
    sizes: dict[str, int] = {}
    out: list[str] = []
    for dl, dr in zip(lb, rb, strict=True):
        f = next(letters)
        lhs_f[dl], rhs_f[dr], sizes[f] = f, f, lhs.shape[dl]
        out.append(f)
    for dl, dr in zip(lc, rc, strict=True):
        f = next(letters)
        lhs_f[dl], rhs_f[dr], sizes[f] = f, f, lhs.shape[dl]
    for factors, t in ((lhs_f, lhs), (rhs_f, rhs)):
        for d in range(t.rank):
            if not factors[d]:
                f = next(letters)
                factors[d], sizes[f] = f, t.shape[d]
                out.append(f)
    result = [(f,) if sizes[f] == s else () for f, s in zip(out, outs[0].shape, strict=True)]
    return _make([[(f,) for f in lhs_f], [(f,) for f in rhs_f]], [result], sizes)


def matmul(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """numpy/torch matmul ``[...,m,k] @ [...,k,n]`` with broadcast batch dims (incl. 1-D cases)."""
    lhs, rhs, out = ins[0], ins[1], outs[0]
    letters = _letters(out.rank + 1)
    k = letters[-1]
    sizes = dict(zip(letters, out.shape, strict=False))
    sizes[k] = lhs.shape[-1]
    lhs_dims = _broadcast_map(
        TensorType(lhs.shape[:-1] + (1,) * (rhs.rank > 1), lhs.dtype), out, letters
    )
    if rhs.rank == 1:
        rhs_dims: list[tuple[str, ...]] = [(k,)]
        lhs_dims = [*_broadcast_map(TensorType(lhs.shape[:-1], lhs.dtype), out, letters), (k,)]
    else:
        # a 1-D lhs drops the m dim from the result, so rhs's k dim has no result dim to face
        rows = (1,) if lhs.rank > 1 else ()
        rhs_dims = _broadcast_map(
            TensorType((*rhs.shape[:-2], *rows, rhs.shape[-1]), rhs.dtype), out, letters
        )
        rhs_dims[-2:-1] = [(k,)]
    if lhs.rank == 1:
        lhs_dims = [(k,)]
    else:
        lhs_dims[-1] = (k,)
        if rhs.rank > 1:
            lhs_dims[-2] = (letters[out.rank - 2],) if lhs.shape[-2] == out.shape[-2] else ()
    return _make([lhs_dims, rhs_dims], [[(f,) for f in letters[: out.rank]]], sizes)


def einsum(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """``equation`` attribute in einsum notation, e.g. ``"bsh,hf->bsf"``."""
    equation = str(attrs["equation"]).replace(" ", "")
    return ShardingRule.from_spec(equation, [t.shape for t in ins], [t.shape for t in outs])


def broadcast_in_dim(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """Operand dim i becomes result dim ``dims[i]``; an expanded size-1 dim is unmapped."""
    x, out = ins[0], outs[0]
    dims = list(attrs.get("dims", range(out.rank - x.rank, out.rank)))  # type: ignore[arg-type]
    letters = _letters(out.rank)
    sizes = dict(zip(letters, out.shape, strict=True))
    operand = [(letters[d],) if x.shape[i] == out.shape[d] else () for i, d in enumerate(dims)]
    operands = [operand] + [[] for _ in ins[1:]]
    return _make(operands, [[(f,) for f in letters]], sizes)


def index_copy(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """``index_copy(buffer, index, rows)`` along ``dim`` (a KV-cache write): every other dim of
    the buffer, the rows and the result is one factor; ``dim`` itself may not be split (which
    slots are written is data), nor the index."""
    buf, index, rows = ins
    dim = int(attrs.get("dim", 0)) % buf.rank  # type: ignore[call-overload]
    letters = _letters(buf.rank + 2)
    sizes = {letters[d]: buf.shape[d] for d in range(buf.rank)}
    new, idx = letters[buf.rank], letters[buf.rank + 1]
    sizes[new], sizes[idx] = rows.shape[dim], index.shape[0] if index.rank else 1
    full = [(letters[d],) for d in range(buf.rank)]
    row_dims = [(new,) if d == dim else (letters[d],) for d in range(buf.rank)]
    index_dims = [(idx,)] if index.rank else []
    need = {letters[dim], new, idx}
    return _make([full, index_dims, row_dims], [full], sizes, need)


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


def embedding(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """table[v,h] indexed by ids[...] -> out[...,h]; a vocab split leaves partial sums."""
    table, ids = ins[0], ins[1]
    letters = _letters(ids.rank + 2)
    v, h, batch = letters[0], letters[1], letters[2:]
    sizes = {v: table.shape[0], h: table.shape[1], **dict(zip(batch, ids.shape, strict=True))}
    result = [(f,) for f in batch] + [(h,)]
    return _make([[(v,), (h,)], [(f,) for f in batch]], [result], sizes)


def embedding_backward(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """grad[...,h], ids[...] -> table_grad[v,h]: tokens reduce; a device may own a vocab slice."""
    ids, out = ins[1], outs[0]
    letters = _letters(ids.rank + 2)
    v, h, batch = letters[0], letters[1], letters[2:]
    sizes = {v: out.shape[0], h: out.shape[1], **dict(zip(batch, ids.shape, strict=True))}
    grad_dims = [(f,) for f in batch] + [(h,)]
    return _make([grad_dims, [(f,) for f in batch]], [[(v,), (h,)]], sizes)


def _heads(q_heads: int, kv_heads: int) -> tuple[dict[str, int], tuple[str, ...]]:
    """Factor sizes and the query head dim for (grouped-query) attention.

    Query head ``i`` reads key/value head ``i // r`` (``r = q_heads / kv_heads``, PyTorch's
    ``enable_gqa`` and JAX's grouped layout), so the query head dim is the compound ``(h, r)``:
    splitting ``h`` keeps every group with its key/value head. ``r`` needs replication.
    """
    if q_heads == kv_heads or kv_heads <= 0 or q_heads % kv_heads:
        return {"h": q_heads}, ("h",)
    return {"h": kv_heads, "r": q_heads // kv_heads}, ("h", "r")


def attention(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """Fused attention q[b,h,s,d], k[b,h,t,d], v[b,h,t,e] -> o[b,h,s,e] (+ lse[b,h,s]).

    Batch, heads and queries split freely; keys (softmax axis) and the contracted head dim d need
    replication; the value head dim e passes through. A causal mask needs no extra factor.
    Grouped-query attention (fewer key/value heads) splits heads by key/value group.
    """
    q, k, v = ins[0], ins[1], ins[2]
    heads, qh = _heads(q.shape[1], k.shape[1])
    sizes = dict(b=q.shape[0], s=q.shape[2], d=q.shape[3], t=k.shape[2], e=v.shape[3], **heads)
    operands = [[("b",), qh, ("s",), ("d",)], [("b",), ("h",), ("t",), ("d",)]]
    operands.append([("b",), ("h",), ("t",), ("e",)])
    operands += [[("b",), qh, ("s",), ("t",)][: t.rank] for t in ins[3:]]  # mask
    results = [[("b",), qh, ("s",), ("e",)]] + [[("b",), qh, ("s",)] for _ in outs[1:]]
    return _make(operands, results, sizes, {"d", "t", "r"})


def attention_backward(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """(grad_o, q, k, v, o, lse) -> (grad_q, grad_k, grad_v).

    Batch and heads split freely. The query sequence ``s`` may split too (context
    parallelism): each device takes its queries' rows with every key and value (``t`` needs
    replication, so K/V arrive all-gathered), its dQ rows are final, and its dK/dV are its
    queries' share of a sum over all queries: ``s`` is *summed* into results 1 and 2, which
    come out partial over its axes (a reduce-scatter or all-reduce follows).
    """
    g, q, k = ins[0], ins[1], ins[2]
    heads, qh = _heads(q.shape[1], k.shape[1])
    sizes = dict(b=q.shape[0], s=q.shape[2], d=q.shape[3], t=k.shape[2], e=g.shape[3], **heads)
    by_name = {
        "g": [("b",), qh, ("s",), ("e",)], "q": [("b",), qh, ("s",), ("d",)],
        "k": [("b",), ("h",), ("t",), ("d",)], "v": [("b",), ("h",), ("t",), ("e",)],
        "o": [("b",), qh, ("s",), ("e",)], "lse": [("b",), qh, ("s",)],
    }  # fmt: skip
    order = ["g", "q", "k", "v", "o", "lse"]
    operands = [by_name[order[i]] if i < len(order) else [] for i in range(len(ins))]
    results = [by_name["q"], by_name["k"], by_name["v"]][: len(outs)]
    summed = (("s", tuple(range(1, len(results)))),) if len(results) > 1 else ()
    need = {"d", "t", "e", "r"} | (set() if summed else {"s"})
    return _make(operands, results, sizes, need, summed)


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


def gather_rows(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """General gather/index fallback: data dims need replication, index dims pass through."""
    return replicated_rule(ins, outs)


# -- the canonical op set ---------------------------------------------------------------------

ELEMENTWISE_LINEAR = "add sub neg convert copy sum_n".split()
ELEMENTWISE = """mul div max min pow exp log tanh logistic sigmoid rsqrt sqrt erf relu gelu silu
abs sign floor ceil round where select eq ne lt le gt ge and or not xor integer_pow square
reciprocal expm1 log1p sin cos clamp stop_gradient dropout relu_backward gelu_backward
silu_backward tanh_backward sigmoid_backward threshold_backward fill isfinite rem""".split()

for _kind in ELEMENTWISE_LINEAR:
    register_rule(_kind, elementwise, linear=True)
for _kind in ELEMENTWISE:
    register_rule(_kind, elementwise)
for _kind in ("reduce_sum", "sum", "mean", "reduce_mean"):
    register_rule(_kind, reduce, linear=True)
for _kind in ("reduce_max", "reduce_min", "max_reduce", "amax", "amin"):
    register_rule(_kind, reduce)
for _kind in ("argmax", "argmin"):
    register_rule(_kind, argreduce)
for _kind in ("layer_norm", "rms_norm"):
    register_rule(_kind, norm)
for _kind in """softmax log_softmax softmax_backward log_softmax_backward cross_entropy
cross_entropy_backward nll_loss nll_loss_backward cumsum sort""".split():
    register_rule(_kind, rowwise)
for _kind in ("layer_norm_backward", "rms_norm_backward"):
    register_rule(_kind, norm_backward)
register_rule("topk", lambda ins, outs, attrs: _topk(ins, outs, attrs))
register_rule("reshape", reshape, flops="none", linear=True)
register_rule("transpose", transpose, flops="none", linear=True)
register_rule("broadcast_in_dim", broadcast_in_dim, flops="none", linear=True)
register_rule("broadcast", broadcast_in_dim, flops="none", linear=True)
register_rule("dot", "ik,kj->ij", flops="dot")
register_rule("dot_general", dot_general, flops="dot")
register_rule("matmul", matmul, flops="dot")
register_rule("einsum", einsum, flops="dot")
register_rule("slice", resize, flops="none", linear=True)
register_rule("dynamic_slice", resize, flops="none")
register_rule("pad", resize, flops="none")
register_rule("concat", resize, flops="none", linear=True)
register_rule("embedding", embedding, flops="none")
register_rule("embedding_backward", embedding_backward)
register_rule("attention", attention, flops="attention")
register_rule("attention_backward", attention_backward, flops="attention_backward")
register_rule("iota", iota, flops="none")
register_rule("constant", iota, flops="none")
register_rule("gather", gather_rows, flops="none")
register_rule("index_copy", index_copy, flops="none")
register_rule("scan_carry", elementwise, flops="none")  # a loop's carry on entry
register_rule("scan_loop", elementwise, flops="none")  # carried to the next iteration
register_rule("scan_index", scan_slice, flops="none")
register_rule("scan_stack", scan_slice, flops="none")

CORE_KINDS: frozenset[str] = frozenset(_REGISTRY)
"""The canonical kinds the core registers (frontends may add their own afterwards)."""


def core_kinds() -> list[str]:
    return sorted(CORE_KINDS)


from . import embedding_bag, nn_rules  # noqa: E402, F401  (rule blocks: bag lookups, norms...)
