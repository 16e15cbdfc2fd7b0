"""Batch factors: which factor of each op carries the batch, and capping how far it is split.

A pipeline runs its stages on micro-batches of ``B / m`` samples, so no op of a stage may split
the batch over more devices than a micro-batch has samples. The whole-batch graph cannot say
that by itself (slicing the batch is free), so the pipeline planner caps the batch split of
every op: a strategy survives only if its batch factor's device count divides the cap.

A value's dimension carries the batch when its major factor is a batch factor of the op that
makes or reads it (a reshape ``(b s) h`` keeps the batch major); the marks start at the batch
inputs' dim 0 and spread forward and backward through the rules until nothing changes (the
loss gradient's broadcast is reached from its consumers).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..ir import Graph, Mesh, Role, Value
from .costs import Space


def batch_inputs(graph: Graph) -> list[Value]:
    """Data inputs sharing the batch size of the largest one (tokens, labels, masks)."""
    data = [v for v in graph.inputs if v.role is Role.INPUT and v.type.rank >= 2]
    if not data:
        return []
    size = max(data, key=lambda v: v.type.numel).type.shape[0]
    return [v for v in data if v.type.shape[0] == size]


@dataclass(frozen=True, slots=True)
class BatchMarks:
    factors: dict[int, frozenset[str]]
    """Op index -> the factors of its rule that carry the batch (ops without any are absent)."""
    dims: dict[Value, set[int]]
    """Value -> its dimensions whose major factor is the batch."""


_REMEMBERED: dict[int, tuple[Graph, BatchMarks | None]] = {}
"""Graph id -> (the graph, its marks once computed), inside ``remembered``."""


@contextmanager
def remembered(graph: Graph) -> Iterator[None]:
    """Compute ``graph``'s marks at most once inside: a pipeline caps the batch split of every
    space it solves on the same graph (each batch cap, each axis-search step), and the
    fixpoint took 0.5-0.9 s per space on the 6,817-op Llama-3-70B step. Scoped, so no graph
    outlives its planning call."""
    outer = id(graph) in _REMEMBERED
    if not outer:
        _REMEMBERED[id(graph)] = (graph, None)
    try:
        yield
    finally:
        if not outer:
            del _REMEMBERED[id(graph)]


def batch_marks(graph: Graph) -> BatchMarks:
    """Spread the batch from the batch inputs' dim 0 through every op, both ways, to a fixpoint
    (once per graph inside ``remembered``: its ops and rules do not change while planned)."""
    found = _REMEMBERED.get(id(graph))
    if found is None or found[0] is not graph:
        return _batch_marks(graph)
    if found[1] is None:
        _REMEMBERED[id(graph)] = (graph, _batch_marks(graph))
    return _REMEMBERED[id(graph)][1]  # type: ignore[return-value]


def _batch_marks(graph: Graph) -> BatchMarks:
    dims: dict[Value, set[int]] = {v: {0} for v in batch_inputs(graph)}
    factors: dict[int, frozenset[str]] = {}
    changed = True
    while changed:
        changed = False
        for order in (range(len(graph.ops)), reversed(range(len(graph.ops)))):
            for i in order:
                changed |= _visit(graph, i, dims, factors)
    return BatchMarks(factors, dims)


def _visit(graph: Graph, i: int, dims: dict[Value, set[int]], factors: dict) -> bool:
    """Mark op ``i``'s batch factors from its tensors' marks, then its tensors from them."""
    op = graph.ops[i]
    rule = op.rule
    tensors = list(zip(op.operands, rule.operands, strict=True))
    tensors += zip(op.results, rule.results, strict=True)
    found = set(factors.get(i, ()))
    for value, tf in tensors:
        found |= {tf[d][0] for d in dims.get(value, ()) if d < len(tf) and tf[d]}
    changed = found != set(factors.get(i, ()))
    if found:
        factors[i] = frozenset(found)
    for value, tf in tensors:
        marked = {d for d, dim in enumerate(tf) if dim and dim[0] in found}
        if value.producer is None and value.role is not Role.INPUT:
            continue  # parameters and optimizer state never carry the batch
        if not marked <= dims.get(value, set()):
            dims.setdefault(value, set()).update(marked)
            changed = True
    return changed


def cap_batch_split(space: Space, cap: int) -> None:
    """Keep only strategies whose batch split divides ``cap`` (shared lists stay shared)."""
    graph, mesh = space.graph, space.mesh
    filtered: dict[tuple[int, frozenset[str]], list] = {}
    for i, found in sorted(batch_marks(graph).factors.items()):
        node = space.op_node(i)
        key = (id(space.strategies[node]), found)
        if key not in filtered:
            kept = [s for s in space.strategies[node] if _op_split(s, found, mesh) <= cap]
            kept = [s for s in kept if cap % _op_split(s, found, mesh) == 0]
            filtered[key] = kept or space.strategies[node]
        space.strategies[node] = filtered[key]
    for value in batch_inputs(graph):
        node = graph.inputs.index(value)
        kept = [
            s for s in space.strategies[node] if cap % mesh.group_size(s.results[0].dims[0]) == 0
        ]
        space.strategies[node] = kept or space.strategies[node]


def _op_split(strategy, found: frozenset[str], mesh: Mesh) -> int:
    """Devices the batch is divided over by a strategy (the largest over its batch factors)."""
    sizes = [mesh.group_size(axes) for f, axes in strategy.assignment if f in found]
    return max(sizes, default=1)


def plan_batch_split(plan) -> int:
    """The most devices any op of a solved plan splits the batch over (as its operands show)."""
    graph, mesh = plan.graph, plan.mesh
    dims = batch_marks(graph).dims
    inputs = batch_inputs(graph)
    batch = inputs[0].type.shape[0] if inputs else 1
    out = 1
    for i, op in enumerate(graph.ops):
        for j, value in enumerate(op.operands):
            for d in dims.get(value, ()):
                axes = plan.operand_shardings[(i, j)].dims[d]
                out = max(out, min(mesh.group_size(axes), batch))
    return out


__all__ = ["BatchMarks", "batch_inputs", "batch_marks", "cap_batch_split", "plan_batch_split"]
