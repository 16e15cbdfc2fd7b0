"""Sharding rules of pooled embedding lookups (``nn.EmbeddingBag``, recommendation tables).

A bag lookup reads, for each of ``B`` bags, the rows of its ids in a ``[V, D]`` table and
pools them (sum, mean or max) into one ``[D]`` row. Torch hands the ids either as one jagged
1-D list with the offsets of each bag (``ids[N]``, ``offsets[B]``, or ``[B + 1]`` with
``include_last_offset``), or as a 2-D ``[B, L]`` batch of fixed-length bags (torch flattens
it and makes the offsets ``arange(0, B * L, L)``; the IR then knows the bag length).

The ops and their factors (``v`` rows, ``h`` embedding dim, ``b`` bags, ``n`` ids):

* ``embedding_bag(table[v,h], ids, offsets (, per_sample_weights)) -> out[b,h]``
  (``-> out[b,h], max_indices[b,h]`` in max mode):
  - ``b`` split: data parallel, each device pools its own bags;
  - ``v`` split: row-wise, each device looks up the ids that fall in its rows and pools them
    (zeros for the others), so ``out`` is a pending sum over those axes (a reduction factor):
    the reduce-scatter or all-reduce after it is priced by the resharding machinery. Max mode
    cannot split ``v`` (a max over a device's rows is no part of a sum): ``v`` then needs
    replication;
  - ``h`` split: column-wise, each device holds and pools its columns; the result is split
    the same way;
  - nothing split: the table replicated (a data-parallel table when the bags are split).
  Jagged ids: the ids and offsets need replication (which ids belong to a device's bags is
  data; they are small) and ``b`` is a result-only factor. Fixed bags: the ids are ``[(b l)]``
  (bags major), the offsets ``[b]``, so splitting the bags splits the ids with them.
* ``embedding_bag_backward(grad[b,h], ids, offsets (, per_sample_weights)
  (, max_indices[b,h])) -> table_grad[v,h]``: ``b`` reduces (a split batch leaves the table's
  gradient pending: the data-parallel all-reduce), ``v`` is a result-only factor (a device
  makes the gradient rows it owns), ``h`` passes through.
* ``embedding_bag_psw_backward(grad[b,h], table[v,h], ids, offsets) -> psw_grad[n]``: the
  gradient of the per-sample weights, a dot of each bag's gradient with each id's row: ``b``,
  ``v`` and ``h`` all reduce.

Torch's other results of ``_embedding_bag`` (``offset2bag``, ``bag_size`` and, outside max
mode, ``max_indices``) are bookkeeping recomputed from the ids and offsets; they are no IR
values.

Attributes (read them from a captured graph: ``op.attrs``):

  ``mode``: ``"sum"``, ``"mean"`` or ``"max"``; ``rows`` (V) and ``dim`` (D) of the table;
  ``bags`` (B); ``pooling``: average ids per bag (the example's ``N / B``, or the user's
  ``sp.plan(..., pooling={"emb.0": 20})``); ``fixed_bag``: the bag length of a 2-D input
  (absent: jagged); ``include_last_offset``; ``padding_idx`` (absent, or the row never
  looked up); ``per_sample_weights`` (bool); ``scale_grad_by_freq`` (bool).

Costs: the lookup moves ``bags x pooling x dim`` rows' bytes (the rows it reads, or in
backward the gradient rows it adds), divided by the op's split (bags, rows and columns each
divide the ids a device handles), plus its ids and its result; it does not read the table.
"""

from __future__ import annotations

from .registry import register_bytes, register_rule
from .rule_helpers import Attrs, Types, _letter_stream, _make
from .rules import ShardingRule
from .types import TensorType

MODES = ("sum", "mean", "max")
"""``mode`` attribute values, in torch's numbering (0, 1, 2)."""


def _index_dims(
    t: TensorType, attrs: Attrs, letters, sizes: dict[str, int], need: set[str]
) -> tuple[list, list, str]:
    """Dims of the ids and offsets operands, and the bag factor (module docstring)."""
    bags = int(attrs["bags"])  # type: ignore[call-overload]
    b = next(letters)
    sizes[b] = bags
    fixed = attrs.get("fixed_bag")
    if fixed:
        length = next(letters)
        sizes[length] = int(fixed)  # type: ignore[call-overload]
        need.add(length)
        return [(b, length)], [(b,)], b
    n, o = next(letters), next(letters)
    sizes[n], sizes[o] = t.shape[0], bags + int(bool(attrs.get("include_last_offset")))
    need.update((n, o))
    return [(n,)], [(o,)], b


def embedding_bag(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """The pooled lookup (module docstring)."""
    table, ids = ins[0], ins[1]
    letters = _letter_stream()
    v, h = next(letters), next(letters)
    sizes = {v: table.shape[0], h: table.shape[1]}
    need: set[str] = {v} if attrs.get("mode") == "max" else set()
    ids_dims, offsets_dims, b = _index_dims(ids, attrs, letters, sizes, need)
    operands = [[(v,), (h,)], ids_dims, offsets_dims] + [ids_dims for _ in ins[3:]]
    results = [[(b,), (h,)] for _ in outs]  # out (and max_indices in max mode)
    return _make(operands, results, sizes, need)


def embedding_bag_backward(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """The table's gradient: bags reduce, rows are made where they are owned."""
    grad, ids = ins[0], ins[1]
    letters = _letter_stream()
    v, h = next(letters), next(letters)
    sizes = {v: outs[0].shape[0], h: grad.shape[1]}
    need: set[str] = set()
    ids_dims, offsets_dims, b = _index_dims(ids, attrs, letters, sizes, need)
    rest = [[(b,), (h,)] if t.rank == 2 else ids_dims for t in ins[3:]]  # max_indices, psw
    operands = [[(b,), (h,)], ids_dims, offsets_dims, *rest]
    return _make(operands, [[(v,), (h,)]], sizes, need)


def embedding_bag_psw_backward(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """The per-sample weights' gradient: a dot over the dim, pending over bags and rows."""
    table, ids = ins[1], ins[2]
    letters = _letter_stream()
    v, h = next(letters), next(letters)
    sizes = {v: table.shape[0], h: table.shape[1]}
    need: set[str] = set()
    ids_dims, offsets_dims, b = _index_dims(ids, attrs, letters, sizes, need)
    operands = [[(b,), (h,)], [(v,), (h,)], ids_dims, offsets_dims]
    return _make(operands, [ids_dims], sizes, need)


def lookup_elements(attrs: Attrs) -> float:
    """Table elements one bag lookup reads over all devices: ``bags x pooling x dim``."""
    bags, dim = float(attrs.get("bags", 0)), float(attrs.get("dim", 0))  # type: ignore[arg-type]
    return bags * float(attrs.get("pooling", 1.0)) * dim  # type: ignore[arg-type]


def _flops(ins: Types, outs: Types, attrs: Attrs) -> float:
    """One add (or max, or multiply-add with weights) per looked-up element."""
    return lookup_elements(attrs)


def _lookup_bytes(table: int):  # type: ignore[no-untyped-def]
    """Bytes of a lookup whose operand ``table`` is the table: the rows read (module
    docstring), every other operand and the results; the table itself is not read whole."""

    def model(ins: Types, outs: Types, in_shards, out_shards, attrs: Attrs, split: int) -> float:  # type: ignore[no-untyped-def]
        itemsize = ins[table].nbytes / max(ins[table].numel, 1)
        rows = lookup_elements(attrs) * itemsize / max(split, 1)
        read = sum(t.nbytes // n for k, (t, n) in enumerate(zip(ins, in_shards, strict=True))
                   if k != table)  # fmt: skip
        return rows + read + sum(t.nbytes // n for t, n in zip(outs, out_shards, strict=True))

    return model


def _backward_bytes(ins: Types, outs: Types, in_shards, out_shards, attrs: Attrs, split: int):  # type: ignore[no-untyped-def]
    """The gradient rows read and added (twice the lookup's rows), the pooled gradient and
    ids read, and the dense table gradient written (zeroed, then added into)."""
    itemsize = outs[0].nbytes / max(outs[0].numel, 1)
    rows = 2.0 * lookup_elements(attrs) * itemsize / max(split, 1)
    read = sum(t.nbytes // n for t, n in zip(ins, in_shards, strict=True))
    return rows + read + 2.0 * (outs[0].nbytes // out_shards[0])


register_rule("embedding_bag", embedding_bag, flops=_flops)
register_rule("embedding_bag_backward", embedding_bag_backward, flops=_flops)
register_rule("embedding_bag_psw_backward", embedding_bag_psw_backward, flops=_flops)
register_bytes("embedding_bag", _lookup_bytes(0))
register_bytes("embedding_bag_backward", _backward_bytes)
register_bytes("embedding_bag_psw_backward", _lookup_bytes(1))
