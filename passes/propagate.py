"""Sharding propagation through factor rules, forward and backward, to a fixed point (§4.2).

Per op, as Shardy does: project every known operand/result sharding onto the rule's factors,
merge the axes per factor, keep each mesh axis on at most one factor, then project back and
refine the values that are not pinned. Semantics (see docs in ``PropagateOptions``):

- only *refinement* is written: a dimension's axes may grow at the minor end, ``partial`` may
  grow; nothing is ever removed, so sweeps are monotone and reach a fixed point; user pins are
  never changed;
- a factor's axes come from the compatible candidates (every one a prefix of the longest); on a
  conflict the candidate of the highest-priority tensor wins: pinned first, then lower user
  priority (``p0`` before ``p1``; a pin without one counts as ``p0``, as in Shardy), then larger
  tensors, then lower position (operands before results); ``conservative`` keeps only the agreed
  prefix;
- user priorities (``Value.priority``, Shardy's ``p0``, ``p1``, ...) propagate priority by
  priority: in the round of priority ``p`` the pins of a later priority are hidden (open, as
  Shardy drops their dims), so a lower-numbered pin reaches the open tensors first; the hidden
  pins are restored after each round;
- each value written records why (``Value.sharding_origin``: the tensor it came from and the
  op), which ``shardplan plan --print-ir`` prints;
- mesh axes go to pass-through factors before reduction factors (Shardy's choice), then in the
  order of their winning tensor, then factor index; a factor whose axes another factor already
  took is truncated before the first taken axis;
- need-replication factors are never sharded; reduction factors sharded on axes make the results
  ``partial`` over those axes (Shardy's ``unreduced``); partial never propagates backward;
- a value still unknown that would come out fully replicated is left ``None`` (no hint);
- an axis that straddles two factors of a compound dimension (a reshape that splits or merges
  a dimension inside an axis) is split into Shardy's sub-axes ``"x":(pre)size``, and adjacent
  sub-axes merge back when a dimension's factors are merged (``factor_projection.py``); a
  sub-axis counts as a prefix of its axis when candidates are merged. ``conservative`` forbids
  sub-axes, as Shardy's conservative mode does.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from shardplan.ir.axes import atomize, merge_adjacent, overlaps
from shardplan.ir.errors import PassError, ShardingError
from shardplan.ir.graph import Graph, Op, Value
from shardplan.ir.mesh import Mesh
from shardplan.ir.rules import ShardingRule, TensorFactors
from shardplan.ir.sharding import Sharding

from .factor_projection import dim_axes, has_sub_axes, project_tensor
from .manager import register_pass

PERMUTATION_KINDS = frozenset(
    {"slice", "pad", "concat", "dynamic_slice", "sort", "reverse", "cumsum", "cumprod", "cummax",
     "cummin", "cumlogsumexp"}
)  # fmt: skip
"""Ops whose resized or mixed dimensions Shardy propagates through (its *permutation* factors:
the partitioner then exchanges halos or gathers), while their rules make those dims
need-replication for the planner. Propagation links such a dim across the op's operands and
result as one factor (``_permutation_view``); enumeration and pricing keep the rule."""

Direction = Literal["both", "forward", "backward"]
Priority = tuple[bool, int, int, int]
"""Sort key of a tensor in an op: (not pinned, user priority (none = 0), -elements, position);
smaller wins."""


@dataclass(frozen=True, slots=True)
class PropagateOptions:
    """Options of the ``propagate`` pass.

    ``max_iterations`` bounds the sweeps over the graph (a warning says when it was too few);
    ``direction`` picks which values an op may refine: results (forward), operands (backward)
    or both; ``conservative`` stops at conflicts instead of resolving them by priority.
    """

    max_iterations: int = 100
    direction: Direction = "both"
    conservative: bool = False

    def __post_init__(self) -> None:
        if self.max_iterations < 1:
            raise PassError(f"max_iterations must be >= 1, got {self.max_iterations}")
        if self.direction not in ("both", "forward", "backward"):
            raise PassError(
                f"direction must be 'both', 'forward' or 'backward', got {self.direction!r}"
            )


@dataclass(frozen=True, slots=True)
class PropagationStats:
    """What one propagation run did: sweeps over the graph, values refined, fixed point reached."""

    sweeps: int
    updates: int
    converged: bool


@dataclass(slots=True)
class _OpFactors:
    """Static view of one op's rule, computed once per run."""

    tensors: tuple[TensorFactors, ...]
    num_operands: int
    sizes: tuple[tuple[str, int], ...]
    size_of: dict[str, int]
    index: dict[str, int]
    reduction: frozenset[str]
    need_replication: frozenset[str]
    summed: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """``ShardingRule.summed``: factors that leave only some results partial."""

    @staticmethod
    def of(op: Op | _Tie) -> _OpFactors:
        rule = _permutation_view(op) if op.kind in PERMUTATION_KINDS else op.rule
        return _OpFactors(
            rule.operands + rule.results, len(rule.operands), rule.sizes, dict(rule.sizes),
            {f: i for i, f in enumerate(rule.factor_names)}, rule.reduction, rule.need_replication,
            rule.summed,
        )  # fmt: skip


def _permutation_view(op: Op | _Tie) -> ShardingRule:
    """The op's rule with each resized or need-replication dim linked, position by position,
    across the result and the same-rank operands: one factor whose size divides them all."""
    rule = op.rule
    if len(op.results) != 1:
        return rule
    rank = op.results[0].type.rank
    tensors = [*op.operands, *op.results]
    factors = [*rule.operands, *rule.results]
    linked: dict[int, str] = {}
    sizes = dict(rule.sizes)
    replaced: set[str] = set()
    same_rank = [t for v, t in zip(tensors, factors, strict=True) if v.type.rank == rank]
    for d in range(rank):
        at_d = {t[d] for t in same_rank}
        if any(len(fs) != 1 for fs in at_d):
            continue
        if len(at_d) == 1 and next(iter(at_d))[0] not in rule.need_replication:
            continue  # a plain pass-through dim
        dim_sizes = [v.type.shape[d] for v in tensors if v.type.rank == rank]
        name = f"~{d}"
        linked[d], sizes[name] = name, math.gcd(*dim_sizes)
    if not linked:
        return rule
    new = []
    for value, tensor in zip(tensors, factors, strict=True):
        if value.type.rank != rank:
            new.append(tensor)
            continue
        dims = []
        for d, fs in enumerate(tensor):
            if d in linked:
                replaced.add(fs[0])
                dims.append((linked[d],))
            else:
                dims.append(fs)
        new.append(tuple(dims))
    used = {f for t in new for fs in t for f in fs}
    n = len(op.operands)
    return ShardingRule(
        tuple(new[:n]), tuple(new[n:]),
        tuple((f, size) for f, size in sizes.items() if f in used),
        rule.need_replication - replaced, rule.summed,
    )  # fmt: skip


@dataclass(eq=False, slots=True)
class _Tie:
    """A scan carry's next-iteration value and the carry itself must share one layout (a loop
    carry is one buffer, as in Shardy's while/scan rule): propagated as a 1-to-1 op."""

    kind: str
    rule: ShardingRule
    operands: tuple[Value, ...]
    results: tuple[Value, ...]


def _carry_ties(graph: Graph) -> list[_Tie]:
    """One tie per ``scan_loop`` op: its operand (the body's carry out) and the ``carry``
    value it hands back to (the ``scan_carry`` result read by the next iteration)."""
    by_name = {v.name: v for op in graph.ops if op.kind == "scan_carry" for v in op.results}
    ties = []
    for op in graph.ops:
        carry = by_name.get(str(op.attrs.get("carry", ""))) if op.kind == "scan_loop" else None
        if carry is not None and carry.type == op.operands[0].type:
            ties.append(_Tie("scan_tie", op.rule, (carry,), (op.operands[0],)))
    return ties


@register_pass("propagate", options=PropagateOptions)
def propagate(graph: Graph, options: PropagateOptions | None = None) -> Graph:
    """Infer shardings from user pins through factor rules, forward and backward (GSPMD mode)."""
    run_propagation(graph, options or PropagateOptions())
    return graph


def propagate_shardings(
    graph: Graph, options: PropagateOptions | None = None
) -> dict[Value, Sharding]:
    """Propagate in place and return every known sharding (pins and hints), e.g. for warm starts."""
    run_propagation(graph, options or PropagateOptions())
    return {v: v.sharding for v in graph.values() if v.sharding is not None}


def run_propagation(graph: Graph, options: PropagateOptions) -> PropagationStats:
    """Sweep the ops (alternating directions for ``both``) until no value changes, once per
    user priority of the pins (lowest number first; one round when there are none).

    Only ops next to a value that changed are revisited, so a sweep costs little once the
    shardings settle.
    """
    mesh = _checked_mesh(graph)
    ops: list[Op | _Tie] = [*graph.ops, *_carry_ties(graph)]
    if mesh is None or not ops:
        return PropagationStats(0, 0, True)
    position = {id(op): i for i, op in enumerate(ops)}
    for i, op in enumerate(ops):  # a tie is revisited when either of its values changes
        if isinstance(op, _Tie):
            for value in (*op.operands, *op.results):
                position.setdefault(id(value), i)
    infos = [_OpFactors.of(op) for op in ops]
    pins = [v for v in graph.values() if v.pinned]
    levels = sorted({user_priority(v) for v in pins}) or [0]
    sweeps = updates = 0
    converged = True
    for level in levels:
        hidden = [v for v in pins if user_priority(v) > level]
        saved = [(v, v.sharding, v.sharding_origin) for v in hidden]
        for value in hidden:  # Shardy drops a later priority's dims for this round
            value.sharding, value.pinned = None, False
        try:
            done, changed, settled = _fixed_point(ops, infos, position, mesh, options)
        finally:
            for value, sharding, why in saved:
                value.sharding, value.pinned, value.sharding_origin = sharding, True, why
        sweeps, updates, converged = sweeps + done, updates + changed, converged and settled
    if not converged:
        warnings.warn(
            f"propagate did not reach a fixed point in {options.max_iterations} sweeps over "
            f"@{graph.name}; raise max_iterations",
            RuntimeWarning,
            stacklevel=2,
        )
    return PropagationStats(sweeps, updates, converged)


def user_priority(value: Value) -> int:
    """A pin's Shardy priority; one without (``None``) counts as ``p0``, as Shardy treats a
    dimension sharding without a priority (checked by the agreement harness's ``prio-*``)."""
    return value.priority if value.priority is not None else 0


def _fixed_point(
    ops: list[Op | _Tie],
    infos: list[_OpFactors],
    position: dict[int, int],
    mesh: Mesh,
    options: PropagateOptions,
) -> tuple[int, int, bool]:
    """One propagation round to a fixed point: (sweeps, values refined, converged)."""
    dirty = [True] * len(ops)
    updates = 0
    for sweep in range(options.max_iterations):
        if not any(dirty):
            return sweep, updates, True
        for i in _sweep_order(len(ops), sweep, options.direction):
            if dirty[i]:
                dirty[i] = False
                for value in _propagate_op(ops[i], infos[i], mesh, options):
                    updates += 1
                    _mark_neighbours(value, position, dirty)
    return options.max_iterations, updates, not any(dirty)


def _checked_mesh(graph: Graph) -> Mesh | None:
    """The graph's mesh, after checking that every known sharding fits its value."""
    known = [v for v in graph.values() if v.sharding is not None]
    if graph.mesh is None:
        if known:
            raise ShardingError(f"graph @{graph.name} has shardings but no mesh; set graph.mesh")
        return None
    for value in known:
        assert value.sharding is not None
        try:
            value.sharding.check(value.type, graph.mesh)
        except ShardingError as err:
            raise ShardingError(
                f"cannot propagate from %{value.name} ({value.origin}): {err}"
            ) from err
    return graph.mesh


def _sweep_order(n: int, sweep: int, direction: Direction) -> Iterable[int]:
    backward = direction == "backward" or (direction == "both" and sweep % 2 == 1)
    return range(n - 1, -1, -1) if backward else range(n)


def _mark_neighbours(value: Value, position: dict[int, int], dirty: list[bool]) -> None:
    if id(value) in position:
        dirty[position[id(value)]] = True
    if value.producer is not None:
        dirty[position[id(value.producer)]] = True
    for use in value.uses:
        dirty[position[id(use.op)]] = True


# -- one op -----------------------------------------------------------------------------------


def _propagate_op(
    op: Op | _Tie, info: _OpFactors, mesh: Mesh, options: PropagateOptions
) -> list[Value]:
    """Refine the op's operands/results from each other; returns the values that changed."""
    tensors = [*op.operands, *op.results]
    if all(v.sharding is None for v in tensors):
        return []
    candidates, subs = _candidates(tensors, info, mesh, not options.conservative)
    targets: dict[str, tuple[str, ...]] = {}
    sources: dict[str, Priority] = {}
    for factor, found in candidates.items():
        if factor in info.need_replication:
            continue
        axes, source = _merge_factor(found, options.conservative, mesh if subs else None)
        if axes and source is not None:
            targets[factor], sources[factor] = axes, source
    _keep_axes_unique(targets, sources, info, subs)
    changed = _write_back(tensors, targets, info, mesh, options.direction, subs)
    for value in changed:
        value.sharding_origin = _why(op, tensors, value, sources, info)
    return changed


def _why(
    op: Op | _Tie,
    tensors: list[Value],
    value: Value,
    sources: dict[str, Priority],
    info: _OpFactors,
) -> str:
    """``propagated from %x through dot``: the winning tensor among the factors of ``value``
    other than itself (any factor when only its pending sum grew)."""
    position = tensors.index(value)
    own = {f for dim in info.tensors[position] for f in dim}
    others = {f: key for f, key in sources.items() if key[3] != position}
    keys = [key for f, key in others.items() if f in own] or list(others.values())
    source = tensors[min(keys)[3]] if keys else value
    named = f" (%{op.results[0].name})" if op.results else ""
    where = "a scan carry" if isinstance(op, _Tie) else f"{op.kind}{named}"
    return f"propagated from %{source.name} through {where}"


def _candidates(
    tensors: list[Value], info: _OpFactors, mesh: Mesh, sub_axes: bool = True
) -> tuple[dict[str, list[tuple[Priority, tuple[str, ...]]]], bool]:
    """Per factor, the axes each known tensor puts on it, with the tensor's priority; and
    whether any of those axes is a sub-axis."""
    found: dict[str, list[tuple[Priority, tuple[str, ...]]]] = {}
    subs = False
    for position, (value, factors) in enumerate(zip(tensors, info.tensors, strict=True)):
        if value.sharding is None:
            continue
        rank = user_priority(value) if value.pinned else 0
        key = (not value.pinned, rank, -value.type.numel, position)
        projected, _overflow = project_tensor(
            value.sharding.dims, factors, info.sizes, mesh, sub_axes
        )
        subs = subs or has_sub_axes(projected)
        for factor, axes in projected:
            found.setdefault(factor, []).append((key, axes))
    return found, subs


def _merge_factor(
    found: list[tuple[Priority, tuple[str, ...]]], conservative: bool, mesh: Mesh | None = None
) -> tuple[tuple[str, ...], Priority | None]:
    """The axes one factor gets and the priority of the tensor they come from.

    Going down the tensors by priority, a candidate that extends the axes refines them and a
    prefix agrees; anything else is a conflict, which the higher-priority tensor wins. With
    ``conservative``, the axes are Shardy's compatible major axes: the longest prefix that
    every candidate either is a prefix of or extends (conflicts stop propagation).
    """
    found = sorted(found, key=lambda item: item[0])
    if mesh is not None and any(":" in a for _, axes in found for a in axes):
        atoms = atomize([axes for _, axes in found], mesh.axis_size)
        if atoms is not None:  # sub-axes: compare cut at common boundaries, merge back after
            keys = [key for key, _ in found]
            axes, key = _merge_factor(list(zip(keys, atoms, strict=True)), conservative)
            return merge_adjacent(axes, mesh.axis_size), key
    all_axes = [axes for _, axes in found]
    if conservative:
        target = _agreed_prefix(max(all_axes, key=len), all_axes)
    else:
        target = ()
        for axes in all_axes:
            if len(axes) > len(target) and axes[: len(target)] == target:
                target = axes
    for key, axes in found:
        if axes and _common_prefix(axes, target) == min(len(axes), len(target)):
            return target, key
    return (), None


def _refines(current: tuple[str, ...], new: tuple[str, ...], mesh: Mesh) -> bool:
    """Whether ``new`` splits a dimension further than ``current`` and starts with it (a
    sub-axis is a prefix of its axis: ``x:(1)2`` is refined by ``x``)."""
    if new == current or not new:
        return False
    if any(":" in a for a in (*current, *new)):
        atoms = atomize([current, new], mesh.axis_size)
        if atoms is not None:
            old, grown = atoms
            return len(grown) > len(old) and grown[: len(old)] == old
    return len(new) > len(current) and new[: len(current)] == current


def _common_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _agreed_prefix(target: tuple[str, ...], all_axes: list[tuple[str, ...]]) -> tuple[str, ...]:
    """Shardy's compatible major axes: each candidate is a prefix of the target or extends it."""
    for axes in all_axes:
        n = _common_prefix(target, axes)
        if n < min(len(target), len(axes)):
            target = target[:n]
    return target


def _keep_axes_unique(
    targets: dict[str, tuple[str, ...]],
    sources: dict[str, Priority],
    info: _OpFactors,
    subs: bool = False,
) -> None:
    """Give each mesh axis to one factor: pass-through factors before reduction factors (as
    Shardy does: the result stays sharded rather than becoming a pending sum), then by winning
    tensor's priority, then factor index. With ``subs`` (some axis is a sub-axis) an axis is
    taken when it overlaps one already given."""
    used: set[str] = set()
    order = sorted(targets, key=lambda f: (f in info.reduction, sources[f], info.index[f]))
    for factor in order:
        kept: list[str] = []
        for axis in targets[factor]:
            if axis in used or (subs and any(overlaps(axis, u) for u in used)):
                break
            kept.append(axis)
        targets[factor] = tuple(kept)
        used.update(kept)


def _write_back(
    tensors: list[Value],
    targets: dict[str, tuple[str, ...]],
    info: _OpFactors,
    mesh: Mesh,
    direction: Direction,
    subs: bool = False,
) -> list[Value]:
    partial = frozenset(axis for f in info.reduction for axis in targets.get(f, ()))
    sizes = mesh.axis_size if subs else mesh.shape  # a plain table on the hot path
    first = info.num_operands if direction == "forward" else 0
    last = info.num_operands if direction == "backward" else len(tensors)
    changed = []
    for position in range(first, last):
        value = tensors[position]
        if value.pinned:
            continue
        grown = frozenset()
        if position >= info.num_operands:
            k = position - info.num_operands
            summed = (f for f, indices in info.summed if k in indices)
            grown = partial | {axis for f in summed for axis in targets.get(f, ())}
        new = _refined(value, info.tensors[position], targets, info, mesh, sizes, grown, subs)
        if new is not None:
            value.sharding = new
            changed.append(value)
    return changed


def _refined(
    value: Value,
    factors: TensorFactors,
    targets: dict[str, tuple[str, ...]],
    info: _OpFactors,
    mesh: Mesh,
    sizes: Callable[[str], int] | dict[str, int],
    partial: frozenset[str],
    subs: bool = False,
) -> Sharding | None:
    """The value's sharding grown by the factor targets, or None when nothing changes.

    A dimension whose current axes are not a prefix of the projected ones keeps its axes (the
    conflict is left for resharding); a refinement that would use an axis twice is dropped.
    Divisibility needs no check: each factor's axes divide it, and only a fully split factor
    is followed by more axes.
    """
    old = value.sharding
    old_dims = old.dims if old is not None else ((),) * len(factors)
    old_partial = old.partial if old is not None else frozenset()
    dims = []
    for current, dim_factors in zip(old_dims, factors, strict=True):
        new = dim_axes(dim_factors, targets, info.size_of, sizes, subs)
        if not subs:
            refines = len(new) > len(current) and new[: len(current)] == current
        else:
            refines = _refines(current, new, mesh)
        dims.append(new if refines else current)
    dims_tuple = tuple(dims)
    if dims_tuple == old_dims and partial <= old_partial:
        return None
    try:
        return Sharding(dims_tuple, partial | old_partial)
    except ShardingError:
        return None
