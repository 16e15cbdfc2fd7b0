"""The memory terms of a graph: per value its bytes per strategy of one decision node over its
live interval (``passes/liveness.py``), saved activations split around their layer's
recomputation window, and the compute each layer's recomputation re-runs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..costmodel.cluster import Cluster
from ..ir import Role, Value
from ..ir.op_cost import IN_PLACE_WRITES, VIEW_KINDS
from ..passes.liveness import Liveness, Phase, liveness
from .costs import Space, op_cost
from .memory import MemoryModel, Term

INPUT_CATEGORY = {
    Role.PARAMETER: "parameters", Role.OPTIMIZER_STATE: "optimizer_states",
    Role.KV_CACHE: "kv_cache",
}  # fmt: skip


SCAN_SLICES = ("scan_index", "scan_stack")


def cache_write(value: Value) -> bool:
    """Whether ``value`` is a KV cache written in place (``index_copy`` or XLA's
    ``dynamic_update_slice`` into a ``KV_CACHE`` input): it lives in the input's buffer, which
    is counted once, as ``kv_cache``. A scanned decoder's cache reaches the write through the
    scan's slice of the stacked cache and comes back stacked (``scan_index``/``scan_stack``):
    the stacked result is the donated input's buffer too."""
    op = value.producer
    while op is not None and (op.kind in IN_PLACE_WRITES or op.kind in SCAN_SLICES):
        value = op.operands[0]
        op = value.producer
    return op is None and value.role is Role.KV_CACHE and value.producer is None


def build_memory_model(
    space: Space,
    cluster: Cluster,
    limit: float | None,
    recompute: bool | dict[str, str | None] = True,
    activation_scale: float = 1.0,
) -> MemoryModel:
    """Terms of every value plus the per-layer recomputation costs.

    Args:
      recompute: True lets the solver choose per layer; False forbids recomputation; a dict
        fixes the decision of each layer (``{"layers.0": "full"}``; missing layers: none).
      activation_scale: factor on activation terms; a pipeline's sub-mesh solve passes
        in-flight micro-batches / micro-batches (a stage holds that share of its activations).
    """
    live = liveness(space.graph)
    terms: list[Term] = []
    cache: dict = {}
    for n, value in enumerate(space.graph.inputs):
        vec = _bytes(space, n, "results", 0, value, cache)
        category = INPUT_CATEGORY.get(value.role, "inputs")
        terms.append(Term(f"%{value.name}", category, 0, live.end, n, vec))
    freed = _freed_classes(live)
    for i, op in enumerate(space.graph.ops):
        for k, value in enumerate(op.results):
            term = _result_term(space, live, i, k, value, cache)
            if term is not None and term.category == "activations" and activation_scale != 1.0:
                term = replace(term, nbytes=np.ceil(term.nbytes * activation_scale))
            if term is not None:
                terms += _split(term, freed.get(value), live)
    forced = recompute if isinstance(recompute, dict) else None
    allow = recompute is not False
    costs = _recompute_costs(space, cluster, live) if allow else {}
    return MemoryModel(space, live, terms, limit, costs, forced, allow)


def _bytes(space: Space, node: int, side: str, slot: int, value: Value, cache: dict) -> np.ndarray:
    strategies = space.strategies[node]
    key = (id(strategies), side, slot, value.type)
    if key not in cache:
        mesh, nbytes = space.mesh, value.type.nbytes
        cache[key] = np.array(
            [nbytes // getattr(s, side)[slot].shard_count(mesh) for s in strategies], dtype=np.int64
        )
    return cache[key]


def _result_term(space: Space, live: Liveness, i: int, k: int, value: Value, cache) -> Term | None:
    """Kept in the layout of its last reader (a partial gradient is reduced into the update's
    layout); a parameter copy and an unread loss in the produced layout (FSDP gathers a
    copy per use: that traffic is on the edges, the buffer is transient)."""
    if cache_write(value):
        return None
    serving, outputs = _graph_facts(space, cache)
    category = _category(value, live, i)
    if category == "parameter_copies" and serving:
        # a serving step has no backward to keep weights for: a view of a weight aliases it,
        # any other copy (a gathered weight) lives until its last reader, like an activation
        if value.producer is not None and value.producer.kind in VIEW_KINDS:
            return None
        category = "activations"
    start, stop = live.define[value], live.last_use[value]
    if value in live.last_reader and category != "parameter_copies":
        reader, slot = live.last_reader[value]
        node = space.op_node(reader)
        return Term(f"%{value.name}", category, start, stop, node,
                    _bytes(space, node, "operands", slot, value, cache))  # fmt: skip
    if category == "parameter_copies" or id(value) in outputs:
        node = space.op_node(i)
        return Term(f"%{value.name}", category, start, live.end, node,
                    _bytes(space, node, "results", k, value, cache))  # fmt: skip
    return None


def _graph_facts(space: Space, cache: dict) -> tuple[bool, set[int]]:
    """(whether the graph is a serving step: it has a KV cache, the ids of its outputs that
    alias no input), worked out once per model (per result they were 11 of 70B's 16 s of
    building the memory model under cProfile)."""
    facts = cache.get("graph_facts")
    if facts is None:
        graph = space.graph
        serving = any(v.role is Role.KV_CACHE for v in graph.inputs)
        outputs = {id(v) for j, v in enumerate(graph.outputs) if j not in graph.output_aliases}
        facts = cache["graph_facts"] = (serving, outputs)
    return facts


def _category(value: Value, live: Liveness, i: int) -> str:
    phase = live.phase[i]
    if phase is Phase.UPDATE:
        return "update"
    if phase is Phase.BACKWARD:
        return "gradients" if _read_by_update(value, live) else "activations"
    operands = [v for v in value.producer.operands if v.type.numel > 1]  # type: ignore[union-attr]
    if operands and all(_parameter_derived(v) for v in operands):
        return "parameter_copies"
    return "activations"


def _read_by_update(value: Value, live: Liveness) -> bool:
    reader = live.last_reader.get(value)
    return reader is not None and live.phase[reader[0]] is Phase.UPDATE


def _parameter_derived(value: Value) -> bool:
    while value.producer is not None and len(value.producer.operands) == 1:
        value = value.producer.operands[0]
    return value.producer is None and value.role is Role.PARAMETER


def _freed_classes(live: Liveness) -> dict[Value, tuple[str, str, int, int]]:
    """Saved value -> (layer, mode class, forward end, backward start)."""
    out: dict[Value, tuple[str, str, int, int]] = {}
    for name, layer in live.layers.items():
        selective = set(layer.saved["selective"])
        for v in layer.saved["full"]:
            cls = "selective" if v in selective else "full"
            out[v] = (name, cls, layer.forward_end, layer.backward_start)
    return out


def _split(term: Term, freed, live: Liveness) -> list[Term]:
    """A saved value: live in forward, free in its layer's window if recomputed, live again."""
    if freed is None:
        return [term]
    layer, cls, fe, bs = freed
    if not (term.start <= fe and bs <= term.stop and fe + 1 <= bs - 1):
        return [term]
    parts = [
        Term(term.label, term.category, term.start, fe, term.node, term.nbytes),
        Term(term.label, term.category, fe + 1, bs - 1, term.node, term.nbytes, (layer, cls)),
        Term(term.label, term.category, bs, term.stop, term.node, term.nbytes),
    ]
    return parts


def _recompute_costs(space: Space, cluster: Cluster, live: Liveness) -> dict:
    """(layer, mode) -> per recomputed op, its node and compute seconds per strategy."""
    cache: dict = {}
    out: dict[tuple[str, str], list[tuple[int, np.ndarray]]] = {}
    for name, layer in live.layers.items():
        for mode, ops in layer.recompute_ops.items():
            entries = []
            for i in ops:
                op, node = space.graph.ops[i], space.op_node(i)
                fused = space.fusion.of(op)
                key = (op.kind, op.rule, id(space.strategies[node]), fused)
                key += (tuple(v.type for v in op.operands), op.attrs.get("causal"))
                if key not in cache:
                    cache[key] = np.array(
                        [op_cost(op, s, space.mesh, cluster, fused) for s in space.strategies[node]]
                    )
                entries.append((node, cache[key] * op.repeat if op.repeat != 1 else cache[key]))
            out[(name, mode)] = entries
    return out
