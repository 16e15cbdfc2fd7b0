"""Factor rules for XLA ops the core registry does not cover: general gather and scatter-add,
built from their dimension numbers (kept as op attributes); ``dynamic_update_slice`` is the
core's (``ir/writes.py``).

Following Shardy's registry: batch dims shared by operand, indices and result pass through;
indexed (gathered / scattered) operand dims need replication; index dims of a scatter-add that
are not tied to the operand are reductions (many updates summed into one row).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ...ir import ShardingRule, TensorType
from ...ir.rules import FACTOR_LETTERS


class _Factors:
    """Hands out factor letters and remembers sizes in order of first appearance."""

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}
        self.need: set[str] = set()

    def new(self, size: int, need_replication: bool = False) -> str:
        name = FACTOR_LETTERS[len(self.sizes)]
        self.sizes[name] = size
        if need_replication:
            self.need.add(name)
        return name

    def rule(self, operands: Sequence[list[str]], results: Sequence[list[str]]) -> ShardingRule:
        def dims(t: list[str]) -> tuple[tuple[str, ...], ...]:
            return tuple((f,) for f in t)

        order: list[str] = []
        for t in list(operands) + list(results):
            order.extend(f for f in t if f not in order)
        return ShardingRule(
            tuple(dims(t) for t in operands),
            tuple(dims(t) for t in results),
            tuple((f, self.sizes[f]) for f in order),
            frozenset(self.need & set(order)),
        )


def _tuple(attrs: Mapping[str, object], key: str) -> tuple[int, ...]:
    return tuple(attrs.get(key, ()))  # type: ignore[arg-type]


def gather_rule(
    ins: Sequence[TensorType], outs: Sequence[TensorType], attrs: Mapping[str, object]
) -> ShardingRule:
    """XLA gather: indices batch dims -> result batch dims; window dims pass through when whole."""
    operand, indices, out = ins[0], ins[1], outs[0]
    fs = _Factors()
    offset = _tuple(attrs, "offset_dims")
    out_f = [""] * out.rank
    idx_f = [fs.new(size) for size in indices.shape[:-1]] + [fs.new(indices.shape[-1], True)]
    for pos, factor in zip([d for d in range(out.rank) if d not in offset], idx_f, strict=False):
        out_f[pos] = factor
    collapsed, indexed = _tuple(attrs, "collapsed_slice_dims"), _tuple(attrs, "start_index_map")
    op_batch = _tuple(attrs, "operand_batching_dims")
    idx_batch = _tuple(attrs, "start_indices_batching_dims")
    sizes = _tuple(attrs, "slice_sizes")
    windows = iter(offset)
    op_f = []
    for d, size in enumerate(operand.shape):
        if d in op_batch:
            op_f.append(idx_f[idx_batch[op_batch.index(d)]])
        elif d in collapsed:
            op_f.append(fs.new(size, True))
        else:
            pos = next(windows)
            whole = sizes[d] == size and d not in indexed
            op_f.append(fs.new(size, not whole))
            out_f[pos] = op_f[-1] if whole else fs.new(out.shape[pos])
    return fs.rule([op_f, idx_f], [out_f])


def scatter_add_rule(
    ins: Sequence[TensorType], outs: Sequence[TensorType], attrs: Mapping[str, object]
) -> ShardingRule:
    """XLA scatter-add: result dims follow the operand; free index dims are reductions."""
    operand, indices, updates = ins[0], ins[1], ins[2]
    fs = _Factors()
    window_dims = _tuple(attrs, "update_window_dims")
    idx_f = [fs.new(size) for size in indices.shape[:-1]] + [fs.new(indices.shape[-1], True)]
    upd_f = [""] * updates.rank
    scatter_dims = [d for d in range(updates.rank) if d not in window_dims]
    for pos, factor in zip(scatter_dims, idx_f, strict=False):
        upd_f[pos] = factor
    inserted = _tuple(attrs, "inserted_window_dims")
    indexed = _tuple(attrs, "scatter_dims_to_operand_dims")
    op_batch = _tuple(attrs, "operand_batching_dims")
    idx_batch = _tuple(attrs, "scatter_indices_batching_dims")
    windows = iter(window_dims)
    op_f = []
    for d, size in enumerate(operand.shape):
        if d in op_batch:
            op_f.append(idx_f[idx_batch[op_batch.index(d)]])
        elif d in inserted:
            op_f.append(fs.new(size, True))
        else:
            pos = next(windows)
            whole = updates.shape[pos] == size and d not in indexed
            op_f.append(fs.new(size, not whole))
            upd_f[pos] = op_f[-1] if whole else fs.new(updates.shape[pos], True)
    return fs.rule([op_f, idx_f, upd_f], [list(op_f)])


def reverse_rule(
    ins: Sequence[TensorType], outs: Sequence[TensorType], attrs: Mapping[str, object]
) -> ShardingRule:
    """``rev``: reversed dims need replication (a split one would swap shards between
    devices); the others pass through."""
    fs = _Factors()
    reversed_dims = set(_tuple(attrs, "dims"))
    dims = [fs.new(size, d in reversed_dims) for d, size in enumerate(ins[0].shape)]
    return fs.rule([dims], [list(dims)])
