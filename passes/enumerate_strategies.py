"""Choice enumeration (the enumerate-strategies pass): every way an op (or a graph input) may
be laid out on the mesh, each a ``Choice`` (a hand-written plan is a ``ParallelStrategy``).

A choice of an op assigns each mesh axis to at most one factor of its rule (DESIGN.md §4.3).
From the assignment follow the layouts the op needs for its operands and the layouts of its
results (reduction factors leave the results partial over their axes). Choices that split a
factor unevenly, split a need-replication factor, or cut a compound dimension into
non-contiguous pieces are never proposed; duplicates (same operand and result layouts) are shaved.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from ..ir import Mesh, Op, Role, Sharding, ShardingRule, TensorType, Value, op_info
from ..ir.rules import TensorFactors


@dataclass(frozen=True, slots=True)
class Choice:
    """One layout choice: required operand layouts, produced result layouts, and the split."""

    operands: tuple[Sharding, ...]
    results: tuple[Sharding, ...]
    assignment: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """Factor -> mesh axes, for the sharded factors only (empty for graph inputs)."""
    split: int = 1
    """Number of devices the op's work is divided over (product of the assigned axes)."""
    reduced: tuple[Sharding, ...] = ()
    """Per result, where a runtime that reduces pending sums at the producer puts the reduced
    value (``solver.costs``); empty: each result without its partial axes."""

    def label(self) -> str:
        if not self.assignment:
            return str(self.results[0]) if self.results else "-"
        return " ".join(f"{f}:{'+'.join(axes)}" for f, axes in self.assignment)


def _mesh_axes(mesh: Mesh) -> list[str]:
    return [name for name, size in mesh.axes if size > 1]


def _dims_sharding(factors: TensorFactors, assign: dict[str, tuple[str, ...]]) -> tuple:
    """Per-dim mesh axes of a tensor: its factors' axes, major factor first."""
    get = assign.get
    return tuple(
        get(dim[0], ()) if len(dim) == 1 else tuple(a for f in dim for a in get(f, ()))
        for dim in factors
    )


def compound_ok(rule: ShardingRule, assign: dict[str, tuple[str, ...]], mesh: Mesh) -> bool:
    """A minor factor of a compound may be split only if every more-major factor is fully split."""
    size = rule.size_of
    for tensor in rule.operands + rule.results:
        for dim in tensor:
            for k, f in enumerate(dim):
                if assign.get(f) and any(
                    mesh.group_size(assign.get(g, ())) != size[g] for g in dim[:k]
                ):
                    return False
    return True


def _assignments(rule: ShardingRule, mesh: Mesh) -> Iterator[dict[str, tuple[str, ...]]]:
    size = rule.size_of
    candidates = [f for f in rule.factor_names if f not in rule.need_replication and size[f] > 1]
    axes = _mesh_axes(mesh)
    for choice in itertools.product([None, *candidates], repeat=len(axes)):
        assign: dict[str, tuple[str, ...]] = {}
        for axis, factor in zip(axes, choice, strict=True):
            if factor is not None:
                assign[factor] = (*assign.get(factor, ()), axis)
        if all(size[f] % mesh.group_size(a) == 0 for f, a in assign.items()) and compound_ok(
            rule, assign, mesh
        ):
            yield assign


def op_choices(
    op: Op, mesh: Mesh, partial_passthrough: bool = True, rule: ShardingRule | None = None
) -> list[Choice]:
    """All distinct choices of an op on the mesh.

    With ``partial_passthrough`` a linear op may also take every operand partial over free axes
    and give a partial result (DTensor does this; XLA in Auto mode reduces at the producer).
    ``rule``: the op's rule with other factor sizes to enumerate by (a pipeline's micro-batch,
    ``solver/batch.py``); the layouts are the same, only which splits are even and contiguous
    changes.
    """
    rule = rule or op.rule
    info = op_info(op.kind)
    linear = partial_passthrough and bool(info and info.linear)
    out: dict[tuple, Choice] = {}
    for assign in _assignments(rule, mesh):
        operand_dims = [_dims_sharding(t, assign) for t in rule.operands]
        result_dims = [_dims_sharding(t, assign) for t in rule.results]
        reduced = [_partial_axes(rule, k, assign) for k in range(len(result_dims))]
        used = {a for axes in assign.values() for a in axes}
        free = [a for a in _mesh_axes(mesh) if a not in used]
        extra_partials = _subsets(free) if linear and op.operands else [frozenset()]
        for pending in extra_partials:
            operands = tuple(Sharding(d, pending) for d in operand_dims)
            results = tuple(
                Sharding(d, partial | pending)
                for d, partial in zip(result_dims, reduced, strict=True)
            )
            key = (operands, results)
            if key not in out:
                split = mesh.group_size(sorted(used))
                label = tuple(sorted(assign.items(), key=lambda kv: rule.factor_names.index(kv[0])))
                out[key] = Choice(operands, results, label, split)
    return list(out.values())


def _partial_axes(rule: ShardingRule, result: int, assign: dict[str, tuple[str, ...]]) -> frozenset:
    """Mesh axes over which result ``result`` is a pending sum: those splitting a reduction
    factor or a factor summed into it (attention's dK/dV under a query split)."""
    return frozenset(a for f in rule.partial_factors(result) for a in assign.get(f, ()))


PENDING = "(pending)"
"""Coordinate of a mesh axis that carries an op's extra pending sum (partial passthrough)."""

Coords = tuple[object, ...]
"""A choice as one coordinate per non-trivial mesh axis: for an op the factor the axis splits,
``PENDING`` or None; for a graph input the dim the axis splits or None."""


def op_coords(choice: Choice, mesh: Mesh) -> Coords:
    """The per-axis coordinates of an op choice."""
    factor_of = {a: f for f, axes in choice.assignment for a in axes}
    pending = choice.operands[0].partial if choice.operands else frozenset()
    return tuple(PENDING if a in pending else factor_of.get(a) for a in _mesh_axes(mesh))


def layout_coords(layout: Sharding, mesh: Mesh) -> Coords:
    """The per-axis coordinates of a graph input's layout (the dim each axis splits)."""
    dim_of = {a: d for d, axes in enumerate(layout.dims) for a in axes}
    return tuple(dim_of.get(a) for a in _mesh_axes(mesh))


def _near(center: Coords, options: list[object]) -> Iterator[Coords]:
    """``center`` and every coordinate tuple that differs from it on exactly one axis."""
    yield center
    for a, current in enumerate(center):
        for option in options:
            if option != current:
                yield (*center[:a], option, *center[a + 1 :])


def op_choices_near(
    op: Op,
    mesh: Mesh,
    center: Coords,
    partial_passthrough: bool = True,
    rule: ShardingRule | None = None,
) -> list[Choice]:
    """The choices of an op that differ from ``center`` on at most one mesh axis
    (``rule``: as ``op_choices``').

    Their number grows linearly with the mesh rank (``op_choices`` grows exponentially);
    the axis search (``solver/axis_search.py``) solves exactly over this neighbourhood."""
    rule = rule or op.rule
    info = op_info(op.kind)
    linear = partial_passthrough and bool(info and info.linear) and bool(op.operands)
    size = rule.size_of
    factors = [f for f in rule.factor_names if f not in rule.need_replication and size[f] > 1]
    options: list[object] = [None, *factors] + ([PENDING] if linear else [])
    axes = _mesh_axes(mesh)
    out: dict[tuple, Choice] = {}
    for coords in _near(center, options):
        if any(c not in options for c in coords):
            continue  # a coordinate this op cannot take (another op's factor)
        assign: dict[str, tuple[str, ...]] = {}
        for axis, c in zip(axes, coords, strict=True):
            if c is not None and c != PENDING:
                assign[str(c)] = (*assign.get(str(c), ()), axis)
        if not all(size[f] % mesh.group_size(a) == 0 for f, a in assign.items()):
            continue
        if not compound_ok(rule, assign, mesh):
            continue
        pending = frozenset(a for a, c in zip(axes, coords, strict=True) if c == PENDING)
        operands = tuple(Sharding(_dims_sharding(t, assign), pending) for t in rule.operands)
        results = tuple(
            Sharding(_dims_sharding(t, assign), _partial_axes(rule, k, assign) | pending)
            for k, t in enumerate(rule.results)
        )
        if (operands, results) not in out:
            used = sorted(a for group in assign.values() for a in group)
            label = tuple(sorted(assign.items(), key=lambda kv: rule.factor_names.index(kv[0])))
            out[(operands, results)] = Choice(operands, results, label, mesh.group_size(used))
    return list(out.values())


def input_choices_near(value: Value, mesh: Mesh, center: Coords) -> list[Choice]:
    """Layouts of a graph input that differ from ``center`` on at most one mesh axis."""
    if (value.pinned and value.sharding is not None) or (
        value.role is Role.CONSTANT and value.type.numel <= 1
    ):
        return input_choices(value, mesh)
    type_ = value.type
    axes = _mesh_axes(mesh)
    out: dict[Sharding, Choice] = {}
    for coords in _near(center, [None, *range(type_.rank)]):
        if any(c is not None and not 0 <= int(c) < type_.rank for c in coords):  # type: ignore[call-overload]
            continue
        dims: list[tuple[str, ...]] = [() for _ in range(type_.rank)]
        for axis, d in zip(axes, coords, strict=True):
            if d is not None:
                dims[int(d)] = (*dims[int(d)], axis)  # type: ignore[call-overload]
        if all(n % mesh.group_size(a) == 0 for n, a in zip(type_.shape, dims, strict=True)):
            layout = Sharding(tuple(dims))
            out.setdefault(layout, Choice((), (layout,)))
    return list(out.values())


def _subsets(axes: list[str]) -> list[frozenset[str]]:
    return [frozenset(c) for r in range(len(axes) + 1) for c in itertools.combinations(axes, r)]


def value_layouts(type_: TensorType, mesh: Mesh) -> list[Sharding]:
    """Every even, non-partial layout of a tensor: each mesh axis splits one dim or none."""
    axes = _mesh_axes(mesh)
    layouts: list[Sharding] = []
    for choice in itertools.product([None, *range(type_.rank)], repeat=len(axes)):
        dims: list[tuple[str, ...]] = [() for _ in range(type_.rank)]
        for axis, d in zip(axes, choice, strict=True):
            if d is not None:
                dims[d] = (*dims[d], axis)
        if all(size % mesh.group_size(a) == 0 for size, a in zip(type_.shape, dims, strict=True)):
            layouts.append(Sharding(tuple(dims)))
    return layouts


def input_choices(value: Value, mesh: Mesh) -> list[Choice]:
    """Layouts a graph input may be given; a pinned input has exactly its pin."""
    if value.pinned and value.sharding is not None:
        return [Choice((), (value.sharding,))]
    if value.role is Role.CONSTANT and value.type.numel <= 1:
        return [Choice((), (Sharding.replicated(value.type.rank),))]
    layouts = value_layouts(value.type, mesh)
    return [Choice((), (s,)) for s in layouts]
