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

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..ir import Graph, Mesh, Role, ShardingRule, Value
from ..passes.enumerate_strategies import compound_ok
from .costs import Space


def batch_inputs(graph: Graph) -> list[Value]:
    """Data inputs sharing the batch size of the largest one (tokens, labels, masks)."""
    data = [v for v in graph.inputs if v.role is Role.INPUT and v.type.rank >= 2]
    if not data:
        return []
    size = max(data, key=lambda v: v.type.numel).type.shape[0]
    return [v for v in data if v.type.shape[0] == size]


def batch_size(graph: Graph) -> int:
    """Samples in the whole batch: dim 0 of the batch inputs (1 without any)."""
    inputs = batch_inputs(graph)
    return inputs[0].type.shape[0] if inputs else 1


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


def micro_rules(graph: Graph, cap: int) -> dict[int, ShardingRule]:
    """Op index -> its rule with every batch factor sized for a micro-batch of ``cap`` samples
    (ops whose rule does not change are absent): a factor of size ``F`` carrying a batch of
    ``B`` holds ``F cap / B`` per micro-batch. Enumerating by these sizes, a merged ``(b s)``
    dimension may be split over more devices than the micro-batch has samples, and a reshape
    may split ``s`` under a ``b`` split ``cap`` ways (fully, in a micro-batch of ``cap``
    samples); with whole-batch sizes neither was ever proposed under a cap, so HF's flattened
    loss kept 2^21 x 128256 logits per 32 devices (docs/design.md, "Pipelines")."""
    batch = batch_size(graph)
    made: dict[tuple[ShardingRule, frozenset[str]], ShardingRule] = {}
    out: dict[int, ShardingRule] = {}
    for i, found in sorted(batch_marks(graph).factors.items()):
        rule = graph.ops[i].rule
        key = (rule, found)
        if key not in made:
            made[key] = _micro_rule(rule, found, cap, batch)
        if made[key] is not rule:
            out[i] = made[key]
    return out


def _micro_rule(rule: ShardingRule, found: frozenset[str], cap: int, batch: int) -> ShardingRule:
    """``rule`` with each batch factor whose size is a multiple of the batch resized to one
    micro-batch of ``cap`` samples (others keep their size: ``_limits`` bounds their split)."""
    sizes = tuple(
        (f, n // batch * cap if f in found and n % batch == 0 else n) for f, n in rule.sizes
    )
    return rule if sizes == rule.sizes else dataclasses.replace(rule, sizes=sizes)


def _limits(rule: ShardingRule, found: frozenset[str], size: int, batch: int) -> dict[str, int]:
    """Per batch factor of ``rule`` (whole-batch sizes), what its split must divide on a
    micro-batch of ``size`` samples: its micro-batch size, or for a factor that is no multiple
    of the batch, ``gcd(F, size)`` (the whole-batch rule: a split dividing both)."""
    return {
        f: n // batch * size if n % batch == 0 else math.gcd(n, size)
        for f, n in rule.sizes
        if f in found
    }


def cap_batch_split(space: Space, cap: int, micro: bool = True) -> None:
    """Keep only strategies valid on a micro-batch of ``cap`` samples: each batch factor split
    over a device count dividing its micro-batch size, compound dims contiguous at those sizes
    (shared lists stay shared); a space enumerated by ``micro_rules`` loses none. ``micro``
    False: the whole-batch cap, every batch factor's split dividing ``cap`` (a merged ``(b s)``
    too) and compounds at whole-batch sizes: the space before micro-batch sizes."""
    graph, mesh = space.graph, space.mesh
    batch = batch_size(graph)
    rules = micro_rules(graph, cap) if micro else {}
    filtered: dict[tuple[int, frozenset[str]], list] = {}
    for i, found in sorted(batch_marks(graph).factors.items()):
        node = space.op_node(i)
        key = (id(space.strategies[node]), found)
        if key not in filtered:
            whole = graph.ops[i].rule
            limits = (
                _limits(whole, found, cap, batch)
                if micro
                else {f: math.gcd(n, cap) for f, n in whole.sizes if f in found}
            )
            rule = rules.get(i, whole)
            kept = [s for s in space.strategies[node] if _fits(s, rule, limits, mesh)]
            filtered[key] = kept or space.strategies[node]
        space.strategies[node] = filtered[key]
    for value in batch_inputs(graph):
        node = graph.inputs.index(value)
        kept = [
            s for s in space.strategies[node] if cap % mesh.group_size(s.results[0].dims[0]) == 0
        ]
        space.strategies[node] = kept or space.strategies[node]


def _fits(strategy, micro: ShardingRule, limits: dict[str, int], mesh: Mesh) -> bool:  # type: ignore[no-untyped-def]
    """Whether a strategy's batch splits divide their limits and its compounds are contiguous
    at micro-batch sizes."""
    assign = dict(strategy.assignment)
    if any(n % mesh.group_size(assign.get(f, ())) for f, n in limits.items()):
        return False
    return compound_ok(micro, assign, mesh)


def plan_batch_split(plan) -> int:
    """The most devices any op of a solved plan splits the batch over (as its operands show,
    up to the batch size: a merged ``(b s)`` dim split wider counts as the whole batch). What
    micro-batches a plan runs on is ``microbatch_fits``'s question."""
    graph, mesh = plan.graph, plan.mesh
    dims = batch_marks(graph).dims
    batch = batch_size(graph)
    out = 1
    for i, op in enumerate(graph.ops):
        for j, value in enumerate(op.operands):
            for d in dims.get(value, ()):
                axes = plan.operand_shardings[(i, j)].dims[d]
                out = max(out, min(mesh.group_size(axes), batch))
    return out


def microbatch_fits(plan, size: int) -> bool:  # type: ignore[no-untyped-def]
    """Whether a solved plan runs as it is on micro-batches of ``size`` samples: every batch
    factor's split divides its micro-batch size (``_limits``) and every compound dim whose
    minor factors are split has its more-major factors fully split at micro-batch sizes. A
    plan that splits ``s`` under a ``b`` split ``c`` ways (a merged ``(b s)`` split over more
    devices than it has samples) runs only on micro-batches of exactly ``c`` samples. The
    factor splits are read back from the plan's layouts (``_factor_axes``)."""
    graph, mesh = plan.graph, plan.mesh
    batch = batch_size(graph)
    if size < 1 or batch % size:
        return False
    for value in batch_inputs(graph):
        if size % mesh.group_size(plan.sharding_of(value.name).dims[0]):
            return False
    seen: dict[tuple, bool] = {}
    for i, found in sorted(batch_marks(graph).factors.items()):
        op = graph.ops[i]
        chosen = plan.assignments.get(i)
        if chosen is None:  # a loaded plan: read the splits back from the layouts
            layouts = tuple(plan.operand_shardings[(i, j)] for j in range(len(op.operands)))
            layouts += tuple(plan.sharding_of(v.name) for v in op.results)
            chosen = tuple(s.dims for s in layouts)
        key = (op.rule, found, chosen)
        if key not in seen:
            seen[key] = _op_fits(op.rule, found, chosen, size, batch, mesh)
        if not seen[key]:
            return False
    return True


def _op_fits(rule: ShardingRule, found, chosen, size: int, batch: int, mesh: Mesh) -> bool:  # type: ignore[no-untyped-def]
    """``microbatch_fits`` for one op: ``chosen`` is its strategy's assignment (factor, axes)
    pairs, or its operands' then results' dim layouts."""
    limits = _limits(rule, found, size, batch)
    micro = _micro_rule(rule, found, size, batch)
    full = micro.size_of
    if _is_assignment(chosen):
        axes: dict | None = {f: tuple(a) for f, a in chosen}
    else:
        axes = _factor_axes(rule, chosen, full, mesh)
    if axes is None:
        return False  # layouts no assignment explains: never claim they fit
    if any(n % mesh.group_size(axes.get(f, ())) for f, n in limits.items()):
        return False
    return compound_ok(micro, axes, mesh)


def _is_assignment(chosen: tuple) -> bool:
    """(factor, axes) pairs, as opposed to per-tensor dim layouts."""
    return all(isinstance(item, tuple) and item and isinstance(item[0], str) for item in chosen)


def _factor_axes(rule: ShardingRule, dims, full: dict[str, int], mesh: Mesh) -> dict | None:  # type: ignore[no-untyped-def]
    """The mesh axes of each factor, from the layouts: a factor alone in a dim has that dim's
    axes; a factor seen only inside compounds takes, in its dim, what the factors around it
    leave (the prefix that splits it fully, ``full``, when more factors follow). None when
    a compound's axes are not its factors' axes in order."""
    tensors = rule.operands + rule.results
    axes: dict[str, tuple] = {}
    for tensor, placed in zip(tensors, dims, strict=True):
        for dim, group in zip(tensor, placed, strict=True):
            if len(dim) == 1:
                axes.setdefault(dim[0], tuple(group))
    for tensor, placed in zip(tensors, dims, strict=True):
        for dim, group in zip(tensor, placed, strict=True):
            if len(dim) > 1 and not _split_compound(dim, tuple(group), axes, full, mesh):
                return None
    return axes


def _split_compound(dim: tuple, group: tuple, axes: dict, full: dict[str, int], mesh: Mesh) -> bool:
    """Give the unknown factors of one compound dim their share of ``group`` (in ``axes``);
    False when the known factors' axes do not make up ``group`` in order."""
    pos = 0
    for k, f in enumerate(dim):
        rest = group[pos:]
        if f not in axes:
            later = [axes.get(g) for g in dim[k + 1 :]]
            if all(a is not None for a in later):
                tail = sum(len(a) for a in later)  # type: ignore[arg-type]
                axes[f] = rest[: len(rest) - tail]
            else:
                axes[f] = _full_prefix(rest, full[f], mesh)
        if tuple(rest[: len(axes[f])]) != tuple(axes[f]):
            return False
        pos += len(axes[f])
    return pos == len(group)


def _full_prefix(axes: tuple, size: int, mesh: Mesh) -> tuple:
    """The shortest prefix of ``axes`` whose devices number ``size``, else all of them."""
    for n in range(len(axes) + 1):
        if mesh.group_size(axes[:n]) == size:
            return axes[:n]
    return axes


__all__ = [
    "BatchMarks",
    "batch_inputs",
    "batch_marks",
    "batch_size",
    "cap_batch_split",
    "micro_rules",
    "microbatch_fits",
    "plan_batch_split",
]
