"""Find repeated layers so their copies share one set of solver variables (DESIGN.md §4.4).

A layer is recognised by a module path like ``model.layers.7`` (torch FQNs; also ``h.7``,
``blocks.7``, ``layer.7``) on an op's origin or, for graph inputs, in the parameter path.
Optimizer ops carry no module; they inherit the layer of the state they update. Every copy
whose ops and inputs match the first layer one-to-one (kind, rule, types, in order) is mapped
onto it: the solver then prices 32 layers with the variables of one.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field

from ..ir import Graph, Role, Value
from .manager import NoOptions, register_pass

LAYER_PATTERN = re.compile(
    r"(?:^|\.|\[')(?P<stack>layers|h|blocks|block|layer)(?:\.|'\]\[)(?P<index>\d+)(?:\.|\]|$)"
)
"""``model.layers.7.mlp`` (torch FQNs) or ``params['layers'][7]['wq']`` (JAX pytree paths)."""


@dataclass(frozen=True, slots=True)
class RepeatedLayers:
    """Analysis result: node -> representative node (nodes: graph inputs first, then ops)."""

    representative: dict[int, int] = field(default_factory=dict)
    layers: dict[str, list[int]] = field(default_factory=dict)
    """Stack name -> the layer indices found that share variables with the first one."""

    @property
    def num_shared(self) -> int:
        return len(self.representative)


def layer_key(text: str) -> tuple[str, int] | None:
    """``("model.layers", 7)`` for ``model.layers.7.mlp``; None outside a layer stack."""
    match = LAYER_PATTERN.search(text)
    if match is None:
        return None
    return text[: match.start("index")].rstrip("."), int(match.group("index"))


INHERITING_MODULES = ("", "optimizer")
"""Ops with these module paths belong to the layer whose state they use (optimizer updates)."""


def _layer_members(graph: Graph) -> dict[tuple[str, int], list[int]]:
    """Layer key -> node indices (inputs then ops, in graph order).

    An op gets the layer of its own module path. An optimizer op inherits the one layer of its
    keyed operands; an op with no module at all inherits only through a chain that starts at a
    layer's parameters or optimizer state (never from activations, which would pull the final
    norm and the loss into the last layer).
    """
    members: dict[tuple[str, int], list[int]] = {}
    key_of: dict[Value, tuple[tuple[str, int], bool]] = {}  # value -> (layer, from state)
    for n, value in enumerate(graph.inputs):
        key = layer_key(value.origin.path)
        if key is None and value.role is Role.CONSTANT:  # a traced constant: where it is read
            key = layer_key(value.origin.module)
        if key is not None:
            key_of[value] = (key, True)
            members.setdefault(key, []).append(n)
    base = len(graph.inputs)
    for i, op in enumerate(graph.ops):
        key, from_state = layer_key(op.origin.module), False
        if key is None and op.origin.module in INHERITING_MODULES:
            any_source = op.origin.module == "optimizer"
            keys = {
                key_of[v][0] for v in op.operands if v in key_of and (any_source or key_of[v][1])
            }
            key, from_state = (keys.pop(), True) if len(keys) == 1 else (None, False)
        if key is not None:
            members.setdefault(key, []).append(base + i)
            for r in op.results:
                key_of[r] = (key, from_state)
    return members


def _signature(graph: Graph, node: int) -> tuple:
    if node < len(graph.inputs):
        v = graph.inputs[node]
        return ("input", v.type, v.role, v.pinned and v.sharding)
    op = graph.ops[node - len(graph.inputs)]
    return (op.kind, op.rule, tuple(v.type for v in op.operands), tuple(r.type for r in op.results))


def find_repeated_layers(graph: Graph) -> RepeatedLayers:
    """Map every node of layers 1..L-1 onto the matching node of layer 0.

    Layers are aligned by their sequences of signatures (``difflib``), so a first or last
    layer with a few extra ops (a loss seed, a mask) still shares all the ops it has in common.
    """
    members = _layer_members(graph)
    stacks: dict[str, list[int]] = {}
    for stack, index in members:
        stacks.setdefault(stack, []).append(index)
    representative: dict[int, int] = {}
    layers: dict[str, list[int]] = {}
    for stack, indices in sorted(stacks.items()):
        indices.sort()
        first = members[(stack, indices[0])]
        signature = [_signature(graph, n) for n in first]
        shared = [indices[0]]
        alignments: dict[tuple, list[tuple[int, int]]] = {}  # copies usually repeat layer 1
        for index in indices[1:]:
            nodes = members[(stack, index)]
            copy = tuple(_signature(graph, n) for n in nodes)
            if copy not in alignments:
                alignments[copy] = _align(signature, list(copy))
            matched = alignments[copy]
            representative.update((nodes[j], first[i]) for i, j in matched)
            if len(matched) >= len(first) // 2:
                shared.append(index)
        if len(shared) > 1:
            layers[stack] = shared
    return RepeatedLayers(representative, layers)


def _align(first: list[tuple], copy: list[tuple]) -> list[tuple[int, int]]:
    """Index pairs of equal signatures in order (longest matching blocks)."""
    if first == copy:
        return [(i, i) for i in range(len(first))]
    matcher = difflib.SequenceMatcher(None, first, copy, autojunk=False)
    return [(b.a + k, b.b + k) for b in matcher.get_matching_blocks() for k in range(b.size)]


@register_pass("find-repeated-layers", options=NoOptions)
def find_repeated_layers_pass(graph: Graph, options: NoOptions) -> None:
    """Analysis only (the planner reads ``find_repeated_layers``); leaves the graph unchanged."""
    find_repeated_layers(graph)
