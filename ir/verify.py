"""The IR verifier: checks the Graph invariants every pass may assume (DESIGN.md §3).

Each failure raises IRVerifyError saying what failed, where (the op and its origin), the values
involved and a hint, e.g.::

    %0 = dot(%x, %w): result 0 sharding [{"dp"}, {"dp"}] does not fit bf16[64,1024] ...
      at layers.0.mlp (mlp.py:12)
      hint: ...
"""

from __future__ import annotations

import math
from collections import Counter

from .errors import IRVerifyError, ShardingError
from .graph import Graph, Op, Origin, Use, Value
from .rules import TensorFactors
from .types import TensorType


def verify(graph: Graph) -> None:
    """Raise IRVerifyError on the first broken invariant; return None for a valid graph.

    Checked: unique names, topological order (every operand is an input or an earlier result),
    use lists matching operands, rule arity/ranks/sizes against the types, shardings fitting
    the types on the graph mesh, outputs defined, output aliases in range with equal types.
    """
    _check_names(graph)
    _check_order(graph)
    _check_uses(graph)
    for op in graph.ops:
        _check_rule(op)
    for value in graph.values():
        _check_sharding(graph, value)
    _check_outputs(graph)


def _fail(where: str, problem: str, origin: Origin | None, hint: str) -> IRVerifyError:
    lines = [f"{where}: {problem}"]
    if origin is not None and str(origin):
        lines.append(f"  at {origin}")
    lines.append(f"  hint: {hint}")
    return IRVerifyError("\n".join(lines))


def _where(value: Value) -> tuple[str, Origin]:
    """The printed producer op (or the graph input) of ``value`` and its origin."""
    if value.producer is not None:
        return repr(value.producer), value.producer.origin
    return f"input %{value.name}", value.origin


def _check_names(graph: Graph) -> None:
    seen: dict[str, Value] = {}
    for value in graph.values():
        if value.name in seen:
            where, origin = _where(value)
            raise _fail(
                where,
                f"value name %{value.name} is defined twice",
                origin,
                "give each value a unique name (Graph.fresh_name does this)",
            )
        seen[value.name] = value


def _check_order(graph: Graph) -> None:
    defined: set[int] = set()
    for value in graph.inputs:
        if value.producer is not None:
            raise _fail(
                f"input %{value.name}",
                f"is a graph input but has producer {value.producer!r}",
                value.origin,
                "graph inputs are made by Graph.add_input and have no producer",
            )
        defined.add(id(value))
    for op in graph.ops:
        for i, operand in enumerate(op.operands):
            if id(operand) not in defined:
                raise _fail(
                    repr(op),
                    f"operand {i} %{operand.name} is not defined before its use",
                    op.origin,
                    "ops must be in topological order, operands must be graph "
                    "inputs or results of earlier ops in this graph",
                )
        for value in op.results:
            if value.producer is not op or id(value) in defined:
                raise _fail(
                    repr(op),
                    f"result %{value.name} does not belong to this op",
                    op.origin,
                    "results are created by Graph.add_op; do not share Values between ops",
                )
            defined.add(id(value))


def _check_uses(graph: Graph) -> None:
    expected: dict[int, Counter[tuple[int, int]]] = {id(v): Counter() for v in graph.values()}
    for op in graph.ops:
        for i, operand in enumerate(op.operands):
            expected[id(operand)][(id(op), i)] += 1
    for value in graph.values():
        actual = Counter((id(use.op), use.index) for use in value.uses)
        if actual != expected[id(value)]:
            ops = {id(op) for op in graph.ops}
            stale = [u for u in value.uses if id(u.op) not in ops or not _is_use(u, value)]
            detail = f"stale use by {stale[0].op!r} (operand {stale[0].index})" if stale else ""
            where, origin = _where(value)
            raise _fail(
                where,
                f"the use list of %{value.name} does not match the operands "
                f"({len(value.uses)} uses recorded, {expected[id(value)].total()} expected"
                f"{'; ' + detail if detail else ''})",
                origin,
                "change operands only through Graph.set_operand / replace_all_uses_with / erase",
            )


def _is_use(use: Use, value: Value) -> bool:
    return use.index < len(use.op.operands) and use.op.operands[use.index] is value


def _check_rule(op: Op) -> None:
    rule = op.rule
    if len(rule.operands) != len(op.operands) or len(rule.results) != len(op.results):
        raise _fail(
            repr(op),
            f"rule {rule.spec!r} has {len(rule.operands)} operands and "
            f"{len(rule.results)} results, but the op has {len(op.operands)} and "
            f"{len(op.results)}",
            op.origin,
            "rebuild the rule with ir.rule_for(kind, ...) after changing operands",
        )
    sizes = rule.size_of
    tensors = [
        ("operand", i, f, v)
        for i, (f, v) in enumerate(zip(rule.operands, op.operands, strict=True))
    ]
    tensors += [
        ("result", i, f, v) for i, (f, v) in enumerate(zip(rule.results, op.results, strict=True))
    ]
    for role, index, factors, value in tensors:
        problem = _factor_mismatch(factors, value.type, sizes)
        if problem:
            raise _fail(
                repr(op),
                f"{role} {index} %{value.name}: {value.type} {problem} in rule {rule}",
                op.origin,
                "the rule must be built for these types; rebuild it with ir.rule_for",
            )


def _factor_mismatch(factors: TensorFactors, type_: TensorType, sizes: dict[str, int]) -> str:
    if len(factors) != type_.rank:
        return f"has rank {type_.rank} but the rule gives it {len(factors)} dims"
    for d, (dim, size) in enumerate(zip(factors, type_.shape, strict=True)):
        product = math.prod(sizes[f] for f in dim)
        if product != size:
            names = "".join(dim) or "1"
            return f"dim {d} has size {size} but its factors ({names}) multiply to {product}"
    return ""


def _check_sharding(graph: Graph, value: Value) -> None:
    where, origin = _where(value)
    if value.pinned and value.sharding is None:
        raise _fail(
            where,
            f"%{value.name} is pinned but has no sharding",
            origin,
            "pin a value only together with a sharding (or clear `pinned`)",
        )
    if value.sharding is None:
        return
    if graph.mesh is None:
        raise _fail(
            where,
            f"%{value.name} has sharding {value.sharding} but the graph has no mesh",
            origin,
            "set graph.mesh before annotating shardings",
        )
    try:
        value.sharding.check(value.type, graph.mesh)
    except ShardingError as exc:
        raise _fail(
            where,
            f"%{value.name}: {value.type} sharding {value.sharding} does not fit the mesh "
            f"{graph.mesh}: {exc}",
            origin,
            "use only mesh axes, once each, on dimensions they divide evenly",
        ) from None


def _check_outputs(graph: Graph) -> None:
    defined = {id(v) for v in graph.values()}
    for i, value in enumerate(graph.outputs):
        if id(value) not in defined:
            raise _fail(
                f"return of @{graph.name}",
                f"output {i} %{value.name} is not a value of the graph",
                value.origin,
                "return inputs or results of ops in this graph",
            )
    aliased: dict[int, int] = {}
    for out, inp in sorted(graph.output_aliases.items()):
        where = f"return of @{graph.name}"
        if not (0 <= out < len(graph.outputs) and 0 <= inp < len(graph.inputs)):
            raise _fail(
                where,
                f"output alias {out} -> {inp} is out of range ({len(graph.outputs)} "
                f"outputs, {len(graph.inputs)} inputs)",
                None,
                "aliases map an output index to the input index it replaces",
            )
        if inp in aliased:
            raise _fail(
                where,
                f"outputs {aliased[inp]} and {out} both alias input {inp}",
                None,
                "each input is replaced by at most one output",
            )
        aliased[inp] = out
        source, target = graph.outputs[out], graph.inputs[inp]
        if source.type != target.type:
            raise _fail(
                where,
                f"output {out} %{source.name}: {source.type} aliases input {inp} "
                f"%{target.name}: {target.type} of another type",
                source.origin,
                "an updated parameter or state must keep its input's shape and dtype",
            )
