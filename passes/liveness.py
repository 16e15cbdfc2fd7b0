"""Liveness of a training step over its captured op order (DESIGN.md §4.5).

Time is the op index. A graph input is live the whole step; an op result from its producer to
its last use (a forward activation saved for backward lives until its last backward use). Ops
are classified by structure alone — forward (ancestors of the loss), backward, update — and
grouped into layers by module path (``layers.<i>``, ``h.<i>``...), which is what activation
recomputation works on.

Example::

    live = liveness(graph)
    live.last_use[value]          # op index of the last read (``end`` for outputs)
    live.layers["layers.3"].saved["full"]   # values full recomputation of layer 3 frees
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..ir import Graph, Op, Role, Value, op_info
from ..ir.phases import Phase, op_phases
from .repeated_layers import layer_key

RECOMPUTE_MODES = ("selective", "full")
"""``full``: re-run the layer's whole forward in backward (keep only its input);
``selective``: re-run only its cheap ops (everything but weight matmuls), keep matmul outputs."""


@dataclass(frozen=True, slots=True)
class LayerLiveness:
    """One layer's forward/backward spans and what recomputing it frees.

    Invariants: ``forward_end < backward_start`` when both exist; ``saved["selective"]`` is a
    subset of ``saved["full"]``; every saved value is live across the window
    ``(forward_end, backward_start)``, which is where recomputation frees it.
    """

    name: str
    forward_ops: tuple[int, ...]
    forward_end: int
    backward_start: int
    saved: dict[str, tuple[Value, ...]]
    """Mode -> values produced in this layer's forward, read in backward, not read by any
    forward op outside the layer (the layer's outputs stay: they are the next layer's input)."""
    recompute_ops: dict[str, tuple[int, ...]]
    """Mode -> forward ops re-run in backward."""

    @property
    def window(self) -> tuple[int, int]:
        """Closed interval of op indices where recomputation frees the saved values."""
        return self.forward_end + 1, self.backward_start - 1


@dataclass(frozen=True, slots=True)
class Liveness:
    """Per-value live ranges, per-op phases and layers of one graph (an analysis result)."""

    end: int
    """Index of the last time point (``len(graph.ops) - 1``, at least 0)."""
    define: dict[Value, int]
    last_use: dict[Value, int]
    """Op index of the last read; ``end`` for non-aliased outputs; inputs are always live."""
    last_reader: dict[Value, tuple[int, int]]
    """(op index, operand index) of the last read, for values some op reads."""
    phase: list[Phase]
    layers: dict[str, LayerLiveness] = field(default_factory=dict)


def liveness(graph: Graph) -> Liveness:
    """Live ranges, phases and layers of ``graph`` (see the module docstring)."""
    end = max(len(graph.ops) - 1, 0)
    index = {op: i for i, op in enumerate(graph.ops)}
    define: dict[Value, int] = {v: 0 for v in graph.inputs}
    last_use: dict[Value, int] = {v: end for v in graph.inputs}
    last_reader: dict[Value, tuple[int, int]] = {}
    for i, op in enumerate(graph.ops):
        for r in op.results:
            define[r] = i
            last_use[r] = i
        for j, v in enumerate(op.operands):
            if v not in last_reader or last_reader[v][0] < i:
                last_reader[v] = (i, j)
            if v.producer is not None:
                last_use[v] = max(last_use[v], i)
    for j, v in enumerate(graph.outputs):
        if j not in graph.output_aliases and v.producer is not None:
            last_use[v] = end
    phase = op_phases(graph)
    layers = _layers(graph, index, phase, last_use)
    return Liveness(end, define, last_use, last_reader, phase, layers)


def _layer_of(op: Op) -> str | None:
    key = layer_key(op.origin.module)
    return None if key is None else f"{key[0]}.{key[1]}" if key[0] else str(key[1])


def _layers(graph: Graph, index: dict, phase: list[Phase], last_use: dict) -> dict:
    forward: dict[str, list[int]] = {}
    backward: dict[str, list[int]] = {}
    for i, op in enumerate(graph.ops):
        name = _layer_of(op)
        if name is None:
            continue
        if phase[i] is Phase.FORWARD:
            forward.setdefault(name, []).append(i)
        elif phase[i] is Phase.BACKWARD:
            backward.setdefault(name, []).append(i)
    # The layer's backward starts at its first backward op *after* its forward: ops traced in
    # the forward region that only feed backward (a weight's transpose) count as backward too.
    backward_start = {
        name: next((i for i in backward.get(name, ()) if i > ops[-1] + 1), -1)
        for name, ops in forward.items()
    }
    layers = {}
    for name, ops in forward.items():
        if backward_start[name] < 0:
            continue
        members = set(ops)
        saved, recompute = {}, {}
        for mode in RECOMPUTE_MODES:
            chosen = ops if mode == "full" else _selective(graph, ops, members, index, phase)
            recompute[mode] = tuple(chosen)
            saved[mode] = tuple(
                r
                for i in chosen
                for r in graph.ops[i].results
                if _saved(r, members, index, phase) and last_use[r] >= backward_start[name]
            )
        layers[name] = LayerLiveness(
            name, tuple(ops), ops[-1], backward_start[name], saved, recompute
        )
    return layers


def _selective(graph: Graph, ops: list[int], members: set[int], index: dict, phase) -> list[int]:
    """Cheap ops re-runnable from what stays: values from outside the layer, saved outputs of
    weight matmuls, and results of other re-run ops (in forward order)."""
    chosen: set[int] = set()
    for i in ops:
        op = graph.ops[i]
        if _weight_matmul(op):
            continue
        ready = True
        for v in op.operands:
            j = index.get(v.producer) if v.producer is not None else None
            if j is None or j not in members or j in chosen:
                continue
            ready &= _weight_matmul(graph.ops[j]) and _saved(v, members, index, phase)
        if ready:
            chosen.add(i)
    return sorted(chosen)


def _saved(value: Value, members: set[int], index: dict, phase: list[Phase]) -> bool:
    """Read in backward, and not read by a forward op outside the layer (a layer output)."""
    readers = [index[u.op] for u in value.uses]
    backward = any(phase[i] is not Phase.FORWARD for i in readers)
    leaves = any(phase[i] is Phase.FORWARD and i not in members for i in readers)
    return backward and not leaves


def _weight_matmul(op: Op) -> bool:
    """A contraction with a parameter (possibly through a convert/transpose/reshape chain)."""
    info = op_info(op.kind)
    if info is None or info.flops != "dot":
        return False
    return any(_from_parameter(v) for v in op.operands)


def _from_parameter(value: Value) -> bool:
    while value.producer is not None and len(value.producer.operands) == 1:
        value = value.producer.operands[0]
    return value.producer is None and value.role is Role.PARAMETER
