"""Sharding rules of XLA's window ops: pooling (``reduce_window_*``) and its backward
(``select_and_scatter_add``).

A window op slides a window over its operand. A dim the window leaves alone (window 1,
stride 1, no padding, no dilation) passes through: pooling never mixes batch or channel
values. A dim the window moves along mixes neighbours, so it needs replication in the operand
(a split would need a halo exchange); the result dim gets its own factor, which may be split
locally because every device holds the whole operand (as ``resize`` does for slices).

Attributes (one entry per operand dim, as XLA's): ``window``, ``strides``, ``padding``
(``(lo, hi)`` pairs), ``base_dilation``, ``window_dilation``. Extra operands (the init values
of a generic ``reduce_window``) are scalars without dims.

* ``reduce_window_sum / _max / _min / reduce_window(x (, inits)) -> out`` (avg / max pooling);
* ``select_and_scatter_add(source, operand) -> out``: the max-pool backward; ``source`` has the
  pooled shape, ``out`` the operand's; a moved dim needs replication in both operands.
"""

from __future__ import annotations

from collections.abc import Sequence

from .registry import register_rule
from .rule_helpers import Attrs, Types, _letter_stream, _make
from .rules import ShardingRule


def _entry(attrs: Attrs, key: str, d: int, default: object) -> object:
    values = attrs.get(key)
    return values[d] if values else default  # type: ignore[index]


def window_moves(attrs: Attrs, d: int) -> bool:
    """Whether the window slides along dim ``d`` (so the dim mixes neighbours)."""
    return (
        _entry(attrs, "window", d, 1) != 1
        or _entry(attrs, "strides", d, 1) != 1
        or tuple(_entry(attrs, "padding", d, (0, 0))) != (0, 0)  # type: ignore[arg-type]
        or _entry(attrs, "base_dilation", d, 1) != 1
        or _entry(attrs, "window_dilation", d, 1) != 1
    )


def _dims(
    shapes: Sequence[tuple[int, ...]], moved: Sequence[bool], sizes: dict[str, int], need: set[str]
) -> list[list[tuple[str, ...]]]:
    """Factors of same-rank tensors: shared where the window stays, per tensor where it moves
    (need-replication for all but the last tensor, the result)."""
    letters = _letter_stream()
    shared: dict[int, str] = {}
    tensors = []
    for k, shape in enumerate(shapes):
        dims = []
        for d, size in enumerate(shape):
            if moved[d]:
                f = next(letters)
            else:
                f = shared[d] = shared.get(d) or next(letters)
            if moved[d] and k < len(shapes) - 1:
                need.add(f)
            sizes[f] = size
            dims.append((f,))
        tensors.append(dims)
    return tensors


def reduce_window(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """Pooling: untouched dims pass through, windowed dims need replication in the operand."""
    x, out = ins[0], outs[0]
    moved = [window_moves(attrs, d) or x.shape[d] != out.shape[d] for d in range(x.rank)]
    sizes: dict[str, int] = {}
    need: set[str] = set()
    operand, result = _dims([x.shape, out.shape], moved, sizes, need)
    return _make([operand] + [[] for _ in ins[1:]], [result], sizes, need)


def select_and_scatter_add(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """Max-pool backward: each source value lands on the max of its window in ``operand``."""
    source, operand, out = ins[0], ins[1], outs[0]
    moved = [window_moves(attrs, d) or source.shape[d] != operand.shape[d] for d in range(out.rank)]
    sizes: dict[str, int] = {}
    need: set[str] = set()
    src, op_, res = _dims([source.shape, operand.shape, out.shape], moved, sizes, need)
    return _make([src, op_], [res], sizes, need)


register_rule("reduce_window_sum", reduce_window, linear=True)
register_rule("reduce_window_max", reduce_window)
register_rule("reduce_window_min", reduce_window)
register_rule("reduce_window", reduce_window)
register_rule("select_and_scatter_add", select_and_scatter_add)
