"""Sharding rules of XLA's window ops: pooling (``reduce_window_*``) and its backward
(``select_and_scatter_add``).

A window op slides a window over its operand. A dim the window leaves alone (window 1,
stride 1, no padding, no dilation) passes through: pooling never mixes batch or channel
values. A dim the window moves along mixes neighbours. Where the operand is exactly ``stride``
times the result (``ir.halo``'s forward form: a window of ``k`` rows at stride ``s``, padded
``lo`` rows before the first, no base dilation) the result rows split with the operand rows,
as a convolution's do: the operand dim is ``(rows, stride)``, the stride part whole, and a
device needs ``halo_rows(k, window_dilation, s, lo)`` rows of its neighbours' slabs (none for
the usual non-overlapping ``k = s`` pool; ``costmodel.conv.halo_collectives`` prices the
collective-permutes, which XLA's SPMD partitioner inserts itself). Any other moved dim needs
replication in the operand (a split would need a halo exchange this rule does not describe);
the result dim gets its own factor, which may be split locally because every device holds
the whole operand (as ``resize`` does for slices).

Attributes (one entry per operand dim, as XLA's): ``window``, ``strides``, ``padding``
(``(lo, hi)`` pairs), ``base_dilation``, ``window_dilation``. Extra operands (the init values
of a generic ``reduce_window``) are scalars without dims.

* ``reduce_window_sum / _max / _min / reduce_window(x (, inits)) -> out`` (avg / max pooling);
* ``select_and_scatter_add(source, operand) -> out``: the max-pool backward; ``source`` has the
  pooled shape, ``out`` the operand's. Its rows split only when no window crosses a slab edge
  (no halo in either direction: ``k <= s``, no padding before), each device then scattering
  its own windows into its own rows; XLA's partitioner exchanges several pieces for
  overlapping windows (measured), which is not priced, so those dims need replication.
"""

from __future__ import annotations

from collections.abc import Sequence

from .halo import Halo, halo_split
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


def pool_halo(attrs: Attrs, d: int, rows: tuple[int, int]) -> Halo | None:
    """The halo split of dim ``d`` of a window op whose operand and result are ``rows`` long
    along it (``ir.halo``'s forward form, the window as the kernel); None when it may not
    split with a halo."""
    pad = _entry(attrs, "padding", d, (0, 0))
    geometry = {
        "strides": (_entry(attrs, "strides", d, 1),),
        "rhs_dilation": (_entry(attrs, "window_dilation", d, 1),),
        "lhs_dilation": (_entry(attrs, "base_dilation", d, 1),),
        "padding": (tuple(pad),),  # type: ignore[arg-type]
    }
    window = int(_entry(attrs, "window", d, 1))  # type: ignore[call-overload]
    return halo_split((rows[0], window, rows[1]), geometry, 0, window=False)


def window_halos(kind: str, ins: Types, outs: Types, attrs: Attrs) -> list[tuple[int, Halo]]:
    """``(operand dim, halo)`` of each moved dim of a window op that splits with a halo
    exchange (``reduce_window*``: the pooled operand ``ins[0]``); the max-pool backward
    splits only dims that need no halo, so it has none."""
    if kind not in POOL_KINDS:
        return []
    x, out = ins[0], outs[0]
    found = []
    for d in range(x.rank):
        moved = window_moves(attrs, d) or x.shape[d] != out.shape[d]
        halo = pool_halo(attrs, d, (x.shape[d], out.shape[d])) if moved else None
        if halo is not None and (halo.lo > 0 or halo.hi > 0):
            found.append((d, halo))
    return found


class _Letters:
    """Factor letters with their sizes and the need-replication set of one rule."""

    def __init__(self) -> None:
        self.stream = _letter_stream()
        self.sizes: dict[str, int] = {}
        self.need: set[str] = set()

    def new(self, size: int, whole: bool = False) -> str:
        f = next(self.stream)
        self.sizes[f] = size
        if whole:
            self.need.add(f)
        return f


def _split_dim(
    fs: _Letters, attrs: Attrs, d: int, rows: tuple[int, int], halo_free: bool
) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(operand factors, result factors) of moved dim ``d`` split with a halo: the result
    rows, and the operand's ``(rows, stride)``; None when the dim may not split (or, with
    ``halo_free``, would need a halo)."""
    halo = pool_halo(attrs, d, rows)
    if halo is None or (halo_free and (halo.lo > 0 or halo.hi > 0)):
        return None
    y = fs.new(rows[1])
    if halo.step == 1:
        return (y,), (y,)
    return (y, fs.new(halo.step, whole=True)), (y,)


def _window_factors(
    shapes: Sequence[tuple[int, ...]], attrs: Attrs, roles: Sequence[str], halo_free: bool
) -> tuple[list[list[tuple[str, ...]]], _Letters]:
    """Factors of same-rank tensors, each tensor the pooled ``"in"`` or the pooled ``"out"``
    shape: shared where the window stays or the dim splits with a halo; per tensor where it
    moves otherwise (need-replication for all but the last tensor, the result). Letters are
    handed out in tensor and dim order."""
    fs = _Letters()
    x, out = shapes[roles.index("in")], shapes[roles.index("out")]
    shared: dict[int, dict[str, tuple[str, ...]] | None] = {}

    def shared_dim(d: int) -> dict[str, tuple[str, ...]] | None:
        if d not in shared:
            if not (window_moves(attrs, d) or x[d] != out[d]):
                f = (fs.new(x[d]),)
                shared[d] = {"in": f, "out": f}
            else:
                split = _split_dim(fs, attrs, d, (x[d], out[d]), halo_free)
                shared[d] = None if split is None else {"in": split[0], "out": split[1]}
        return shared[d]

    tensors = []
    for k, (shape, role) in enumerate(zip(shapes, roles, strict=True)):
        dims = []
        for d, size in enumerate(shape):
            if (found := shared_dim(d)) is not None:
                dims.append(found[role])
            else:  # a moved dim kept whole: its own factor per tensor
                dims.append((fs.new(size, whole=k < len(shapes) - 1),))
        tensors.append(dims)
    return tensors, fs


def reduce_window(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """Pooling: untouched dims pass through, windowed dims split with a halo or need
    replication in the operand."""
    x, out = ins[0], outs[0]
    (operand, result), fs = _window_factors([x.shape, out.shape], attrs, ("in", "out"), False)
    return _make([operand] + [[] for _ in ins[1:]], [result], fs.sizes, fs.need)


def select_and_scatter_add(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """Max-pool backward: each source value lands on the max of its window in ``operand``."""
    source, operand, out = ins[0], ins[1], outs[0]
    shapes = [source.shape, operand.shape, out.shape]
    (src, op_, res), fs = _window_factors(shapes, attrs, ("out", "in", "in"), True)
    return _make([src, op_], [res], fs.sizes, fs.need)


POOL_KINDS = ("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window")
"""Window ops whose halo splits exchange rows (``window_halos``)."""

register_rule("reduce_window_sum", reduce_window, linear=True)
register_rule("reduce_window_max", reduce_window)
register_rule("reduce_window_min", reduce_window)
register_rule("reduce_window", reduce_window)
register_rule("select_and_scatter_add", select_and_scatter_add)
