"""Grow a captured layer stack from three layers to any depth without tracing the rest.

Tracing costs time per layer (torch ``make_fx`` about 0.35 s per Llama-8B layer), while a stack
of identical layers lowers to the same ops every time. So a frontend may trace only layers
0, 1 and 2 and ask :func:`stamp_layers` for ``count`` layers: layer 1 is the *template*,
copied as layers ``2 .. count-2``, and the traced layer 2 becomes the last layer ``count-1``.

Layer 2 is what tells the copies how to connect. Lining its ops up one-to-one with layer 1's
classifies each operand of the template:

- *internal*: produced inside the layer (the copy uses its own value);
- *from the previous layer*: layer 1 reads it from layer 0 where layer 2 reads the matching
  layer-1 value (the residual stream, forward): the copy reads its predecessor's;
- *from the next layer*: layer 1 reads a layer-2 value (a gradient flowing back): the copy reads
  its successor's;
- *shared*: both read the same outside value (rotary tables, masks);
- *own input*: both read their own parameter or optimizer state (the copy gets new inputs).

Anything else (a skip connection across layers, a value read by the loss from every layer,
ops between two layers that belong to neither) returns None: the frontend then traces every
layer. Copies are placed between the template's and layer 2's runs of ops, in the order the
runs go (forward and optimizer runs ascending, backward runs descending), so the schedule the
memory model and simulator read is the one a full trace gives.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from ..ir import Graph, Origin, Value
from .repeated_layers import _layer_members

_FIRST, _TEMPLATE, _NEXT = 0, 1, 2


@dataclass(frozen=True, slots=True)
class StampedGraph:
    """The grown graph and, per new layer index, old value name -> its value's name there."""

    graph: Graph
    names: dict[int, dict[str, str]]
    """For copies ``2..count-2``: template (layer 1) names; for ``count-1``: layer 2 names."""
    stack: str
    count: int


def layer_path(text: str, stack: str, old: int, new: int) -> str:
    """``model.layers.1.mlp`` -> ``model.layers.5.mlp`` (only that stack's layer segment)."""
    return _segment(stack, old).sub(lambda m: f"{m.group(1)}{stack}.{new}", text, count=1)


@lru_cache(maxsize=64)
def _segment(stack: str, index: int) -> re.Pattern[str]:
    return re.compile(rf"(^|\.){re.escape(stack)}\.{index}(?=\.|$|#)")


def stamp_layers(graph: Graph, stack: str, count: int) -> StampedGraph | None:
    """``graph`` with layers 0..2 of ``stack`` grown to ``count`` layers, or None if unsafe."""
    if count < 3:
        return None
    layout = _Layout.of(graph, stack)
    if layout is None:
        return None
    slots = layout.classify()
    if slots is None or not layout.adjacent():
        return None
    try:
        return _Builder(graph, layout, slots, stack, count).build()
    except KeyError:  # a copy would read a value of a copy not yet written: not a plain stack
        return None


@dataclass
class _Layout:
    """Node positions of layers 0, 1 (template) and 2 (next), aligned one-to-one."""

    graph: Graph
    stack: str
    inputs: tuple[list[int], list[int]]
    """Input indices of the template and of the next layer, aligned."""
    ops: tuple[list[int], list[int]]
    first_values: set[Value]

    @classmethod
    def of(cls, graph: Graph, stack: str) -> _Layout | None:
        members = _layer_members(graph)
        indices = sorted(i for s, i in members if s == stack)
        if indices != [_FIRST, _TEMPLATE, _NEXT]:
            return None
        base = len(graph.inputs)
        split = []
        for index in (_TEMPLATE, _NEXT):
            nodes = members[(stack, index)]
            split.append(([n for n in nodes if n < base], [n - base for n in nodes if n >= base]))
        (a_in, a_ops), (b_in, b_ops) = split
        if len(a_in) != len(b_in) or len(a_ops) != len(b_ops):
            return None
        first_nodes = members[(stack, _FIRST)]
        first = {graph.inputs[n] for n in first_nodes if n < base}
        first |= {r for n in first_nodes if n >= base for r in graph.ops[n - base].results}
        layout = cls(graph, stack, (a_in, b_in), (a_ops, b_ops), first)
        return layout if layout.same_shape() else None

    def same_shape(self) -> bool:
        g = self.graph
        for a, b in zip(*self.inputs, strict=True):
            x, y = g.inputs[a], g.inputs[b]
            renamed = layer_path(x.origin.path, self.stack, _TEMPLATE, _NEXT)
            if x.origin.path == renamed:  # a traced constant, placed by where it is read
                renamed, y_path = (
                    layer_path(x.origin.module, self.stack, _TEMPLATE, _NEXT),
                    y.origin.module,
                )
            else:
                y_path = y.origin.path
            if (x.type, x.role, renamed) != (y.type, y.role, y_path):
                return False
        for a, b in zip(*self.ops, strict=True):
            x, y = g.ops[a], g.ops[b]
            if (x.kind, x.rule, x.attrs, [v.type for v in x.operands]) != (
                y.kind, y.rule, y.attrs, [v.type for v in y.operands]
            ) or [r.type for r in x.results] != [r.type for r in y.results]:  # fmt: skip
                return False
        return True

    def pairs(self) -> dict[Value, Value]:
        """Template value -> the next layer's matching value."""
        g = self.graph
        pairs = {g.inputs[a]: g.inputs[b] for a, b in zip(*self.inputs, strict=True)}
        for a, b in zip(*self.ops, strict=True):
            pairs.update(zip(g.ops[a].results, g.ops[b].results, strict=True))
        return pairs

    def classify(self) -> list[list[tuple[str, Value]]] | None:
        """Per template op and operand: (kind, template value it maps through), or None."""
        g, pairs = self.graph, self.pairs()
        back = {n: t for t, n in pairs.items()}
        next_values = set(back)
        slots: list[list[tuple[str, Value]]] = []
        for a, b in zip(*self.ops, strict=True):
            row = []
            for x, y in zip(g.ops[a].operands, g.ops[b].operands, strict=True):
                if x in pairs:
                    kind = "own" if pairs[x] is y else ""
                elif y in pairs and x in self.first_values:
                    kind, x = "prev", y  # the copy reads its predecessor's version of y
                elif x in back and y not in self.first_values and y not in pairs:
                    kind, x = "next", back[x]
                elif x is y and x not in self.first_values and x not in next_values:
                    kind = "shared"
                else:
                    kind = ""
                if not kind:
                    return None
                row.append((kind, x))
            slots.append(row)
        return slots if self._consumers_ok(pairs) else None

    def _consumers_ok(self, pairs: dict[Value, Value]) -> bool:
        """Template values feed only layer 0, the next layer or outputs; next-layer values feed
        the template or ops outside the stack (the tail)."""
        g = self.graph
        template_ops = {id(g.ops[a]) for a in self.ops[0]}
        next_ops = {id(g.ops[b]) for b in self.ops[1]}
        first_ops = {id(v.producer) for v in self.first_values if v.producer is not None}
        for x, y in pairs.items():
            for use in x.uses:
                if id(use.op) not in template_ops | next_ops | first_ops:
                    return False
            for use in y.uses:
                if id(use.op) in first_ops:
                    return False
        return True

    def adjacent(self) -> bool:
        """Each run of template nodes meets its next-layer run with nothing in between."""
        for a_nodes, b_nodes in (self.inputs, self.ops):
            for (a_lo, a_hi), (b_lo, b_hi) in zip(_runs(a_nodes), _runs(b_nodes), strict=False):
                if (a_hi - a_lo) != (b_hi - b_lo) or not (a_hi == b_lo or b_hi == a_lo):
                    return False
            if len(_runs(a_nodes)) != len(_runs(b_nodes)):
                return False
        return True


def _runs(nodes: list[int]) -> list[tuple[int, int]]:
    """Maximal ranges [lo, hi) of consecutive indices."""
    runs: list[tuple[int, int]] = []
    for n in nodes:
        if runs and runs[-1][1] == n:
            runs[-1] = (runs[-1][0], n + 1)
        else:
            runs.append((n, n + 1))
    return runs


class _Builder:
    """Writes the grown graph: originals in order, copies at the template/next boundaries."""

    def __init__(self, graph, layout, slots, stack, count) -> None:  # type: ignore[no-untyped-def]
        self.old, self.layout, self.slots = graph, layout, slots
        self.stack, self.count = stack, count
        self.new = Graph(graph.name)
        self.new.mesh = graph.mesh
        self.map: dict[Value, Value] = {}  # original value -> its new value
        self.copy: dict[int, dict[Value, Value]] = {j: {} for j in range(_NEXT, count - 1)}
        self.last = count - 1
        self.position = {n: k for k, n in enumerate(layout.ops[0])}
        self.next_inputs = set(layout.inputs[1])
        self.next_ops = set(layout.ops[1])
        self.pairs = layout.pairs()
        self.template_ids = {id(graph.ops[a]) for a in layout.ops[0]}
        self.template_inputs = {graph.inputs[n] for n in layout.inputs[0]}

    def build(self) -> StampedGraph:
        self._inputs()
        self._ops()
        self._outputs()
        names = {j: {v.name: c.name for v, c in m.items()} for j, m in self.copy.items()}
        names[self.last] = {y.name: self.map[y].name for y in self.pairs.values()}
        return StampedGraph(self.new, names, self.stack, self.count)

    # -- inputs ------------------------------------------------------------------------------
    def _inputs(self) -> None:
        a_nodes = self.layout.inputs[0]
        ends = {hi - 1: (lo, hi) for lo, hi in _runs(a_nodes)}
        for n, value in enumerate(self.old.inputs):
            renamed = n in self.next_inputs
            self.map[value] = self._input(value, self.last if renamed else None)
            if n in ends:
                lo, hi = ends[n]
                for j in self.copy:
                    for m in range(lo, hi):
                        template = self.old.inputs[m]
                        self.copy[j][template] = self._input(template, j)

    def _input(self, value: Value, layer: int | None) -> Value:
        if layer is None:
            path, module, hint = value.origin.path, value.origin.module, value.name
        else:
            src = _NEXT if layer == self.last else _TEMPLATE
            path = layer_path(value.origin.path, self.stack, src, layer)
            module = layer_path(value.origin.module, self.stack, src, layer)
            hint = path.replace("#", "_") if path else value.name
        origin = Origin(path, module, value.origin.source)
        new = self.new.add_input(hint, value.type, value.role, origin, value.sharding, value.pinned)
        new.priority, new.sharding_origin = value.priority, value.sharding_origin
        return new

    # -- ops -----------------------------------------------------------------------------------
    def _ops(self) -> None:
        a_ops = self.layout.ops[0]
        a_runs, b_runs = _runs(a_ops), _runs(self.layout.ops[1])
        before: dict[int, tuple[int, int]] = {}  # first op of a template run -> run (backward)
        after: dict[int, tuple[int, int]] = {}  # last op of a template run -> run (forward)
        for (lo, hi), (b_lo, _) in zip(a_runs, b_runs, strict=True):
            (after if b_lo >= hi else before)[(hi - 1) if b_lo >= hi else lo] = (lo, hi)
        for i, op in enumerate(self.old.ops):
            if i in before:
                lo, hi = before[i]
                for j in sorted(self.copy, reverse=True):
                    self._copy_run(lo, hi, j)
            self._original(op, i)
            if i in after:
                lo, hi = after[i]
                for j in sorted(self.copy):
                    self._copy_run(lo, hi, j)

    def _original(self, op, i: int) -> None:  # type: ignore[no-untyped-def]
        operands = []
        for k, v in enumerate(op.operands):
            operands.append(self._carried(i, k, v))
        module = op.origin.module
        if i in self.next_ops:
            module = layer_path(module, self.stack, _NEXT, self.last)
        origin = Origin(op.origin.path, module, op.origin.source)
        self._emit(op, operands, origin, self.map, [r.name for r in op.results])

    def _carried(self, i: int, k: int, v: Value) -> Value:
        """An original op's operand, re-pointed where the copies now sit in between."""
        if i in self.position:  # template op reading from the next layer: the first copy's
            kind, template = self.slots[self.position[i]][k]
            if kind == "next" and self.copy:
                return self.copy[min(self.copy)][template]
        elif i in self.next_ops:  # next layer reading from the template: the last copy's
            from_template = v in self.template_inputs or (
                v.producer is not None and id(v.producer) in self.template_ids
            )
            if self.copy and from_template:
                return self.copy[max(self.copy)][v]
        return self.map[v]

    def _copy_run(self, lo: int, hi: int, j: int) -> None:
        mine = self.copy[j]
        for i in range(lo, hi):
            op = self.old.ops[i]
            operands = []
            for kind, template in self.slots[self.position[i]]:
                if kind == "own":
                    operands.append(mine[template])
                elif kind == "prev":
                    operands.append(self.copy[j - 1][template] if j - 1 in self.copy
                                    else self.map[template])  # fmt: skip
                elif kind == "next":
                    operands.append(self.copy[j + 1][template] if j + 1 in self.copy
                                    else self.map[self.pairs[template]])  # fmt: skip
                else:
                    operands.append(self.map[template])
            module = layer_path(op.origin.module, self.stack, _TEMPLATE, j)
            origin = Origin(op.origin.path, module, op.origin.source)
            self._emit(op, operands, origin, mine, [f"{r.name}_l{j}" for r in op.results])

    def _emit(self, op, operands, origin, into, names) -> None:  # type: ignore[no-untyped-def]
        new = self.new.add_op(
            op.kind, operands, [r.type for r in op.results], rule=op.rule, attrs=op.attrs,
            origin=origin, names=names,
        )  # fmt: skip
        for old, value in zip(op.results, new.results, strict=True):
            value.sharding, value.pinned = old.sharding, old.pinned
            value.priority, value.sharding_origin = old.priority, old.sharding_origin
            into[old] = value

    # -- outputs -------------------------------------------------------------------------------
    def _outputs(self) -> None:
        """Outputs in order; each run of template outputs is followed by the copies' ones."""
        old = self.old
        new_index = {v: n for n, v in enumerate(self.new.inputs)}
        template_values = {v for m in self.copy.values() for v in m}
        values: list[Value] = []
        aliases: dict[int, int] = {}
        pending: list[tuple[Value, int | None]] = []

        def flush() -> None:
            for j in sorted(self.copy):
                for v, alias in pending:
                    aliases_to = None if alias is None else self.copy[j][old.inputs[alias]]
                    if aliases_to is not None:
                        aliases[len(values)] = new_index[aliases_to]
                    values.append(self.copy[j][v])
            pending.clear()

        for n, v in enumerate(old.outputs):
            alias = old.output_aliases.get(n)
            if v in template_values:
                pending.append((v, alias))
            else:
                flush()
            if alias is not None:
                aliases[len(values)] = new_index[self.map[old.inputs[alias]]]
            values.append(self.map[v])
        flush()
        self.new.set_outputs(values, aliases)
