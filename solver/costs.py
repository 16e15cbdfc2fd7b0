"""Price a graph's strategies into a layout Problem: compute per op, resharding per edge."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..costmodel import compute_time, reshard_time
from ..costmodel.cluster import Cluster
from ..ir import Graph, Mesh, Op, Role, Sharding, TensorType, Value, op_bytes, op_flops
from ..passes.enumerate_strategies import Strategy, input_strategies, op_strategies
from .problem import Problem, group_layouts

PERSISTENT_ROLES = (Role.PARAMETER, Role.OPTIMIZER_STATE, Role.INPUT, Role.CONSTANT)
MEMORY_TIEBREAK = 1e-3
"""Seconds charged per second of HBM traffic the persistent state would take to read once:
it makes a sharded input win over an equally fast replicated one (memory has value) without
ever outweighing a real compute or communication difference."""


@dataclass(frozen=True, slots=True)
class PartialSemantics:
    """How the target runtime treats pending sums (partial values); frontends declare it.

    DTensor keeps ``Partial`` through linear ops and reduces per consumer; XLA in Auto mode
    reduces a dot's pending sum right at the dot, once, however many ops read it.
    """

    passthrough: bool = True
    """Linear ops may consume and produce partial values."""
    reduce_once: bool = False
    """A partial value read by several ops is reduced once (all-reduce) at its producer."""


@dataclass(eq=False, slots=True)
class Space:
    """The decision nodes of a graph: graph inputs first, then ops, with their strategies."""

    graph: Graph
    mesh: Mesh
    strategies: list[list[Strategy]]
    producer: dict[Value, tuple[int, int]]
    """Value -> (node, result index)."""
    repeated: object | None = None
    """``passes.repeated_layers.RepeatedLayers`` once computed (shared by solver variants)."""
    reduce_once: frozenset[Value] = frozenset()
    """Multi-use values whose pending sums are reduced once at the producer."""

    @property
    def num_inputs(self) -> int:
        return len(self.graph.inputs)

    def op_node(self, index: int) -> int:
        return self.num_inputs + index

    def produced(self, value: Value, choice: list[int]) -> Sharding:
        """The layout the producer's chosen strategy emits (may be partial)."""
        node, k = self.producer[value]
        return self.strategies[node][choice[node]].results[k]

    def layout(self, value: Value, choice: list[int]) -> Sharding:
        """The layout consumers see: a pinned op result is resharded to its pin first, and a
        reduce-once value has its pending sum reduced first."""
        return _seen(self.produced(value, choice), pinned_result(value), value in self.reduce_once)


def pinned_result(value: Value) -> Sharding | None:
    """The user pin of an op result (a GSPMD sharding constraint), if any."""
    if value.producer is not None and value.pinned and value.sharding is not None:
        return value.sharding
    return None


def build_space(graph: Graph, mesh: Mesh, semantics: PartialSemantics | None = None) -> Space:
    """Enumerate strategies; ops and inputs with the same signature share one list object
    (so the copies of a repeated layer cost a dictionary lookup, and pricing can be cached)."""
    semantics = semantics or PartialSemantics()
    cache: dict[tuple, list[Strategy]] = {}
    strategies = []
    for v in graph.inputs:
        pin = v.sharding if v.pinned else None
        key = ("input", v.type.shape, v.role is Role.CONSTANT and v.type.numel <= 1, pin)
        if key not in cache:
            cache[key] = input_strategies(v, mesh)
        strategies.append(cache[key])
    producer: dict[Value, tuple[int, int]] = {v: (n, 0) for n, v in enumerate(graph.inputs)}
    for i, op in enumerate(graph.ops):
        node = len(graph.inputs) + i
        key = ("op", op.kind, op.rule, bool(op.operands))
        if key not in cache:
            cache[key] = op_strategies(op, mesh, semantics.passthrough)
        strategies.append(cache[key])
        for k, r in enumerate(op.results):
            producer[r] = (node, k)
    once = frozenset(_multi_use(graph)) if semantics.reduce_once else frozenset()
    return Space(graph, mesh, strategies, producer, reduce_once=once)


def _multi_use(graph: Graph) -> list[Value]:
    """Op results read by two or more ops (or by an op and as a graph output)."""
    outputs = {id(v) for v in graph.outputs}
    return [
        r
        for op in graph.ops
        for r in op.results
        if len({id(u.op) for u in r.uses}) + (id(r) in outputs) >= 2
    ]


def op_cost(op: Op, strategy: Strategy, mesh: Mesh, cluster: Cluster) -> float:
    """Roofline time of the op on one device under a strategy."""
    ins = [v.type for v in op.operands]
    outs = [v.type for v in op.results]
    flops = op_flops(op.kind, op.rule, ins, outs) / strategy.split
    nbytes = op_bytes(
        op.kind,
        ins,
        outs,
        [s.shard_count(mesh) for s in strategy.operands],
        [s.shard_count(mesh) for s in strategy.results],
    )
    dtype = (outs or ins)[0].dtype
    return compute_time(flops, nbytes, dtype, cluster)


def _local_bytes(type_: TensorType, sharding: Sharding, mesh: Mesh) -> int:
    return type_.nbytes // sharding.shard_count(mesh)


def input_cost(memory_bytes: float, cluster: Cluster) -> float:
    """Tie-breaking price of holding ``memory_bytes`` of persistent state per device."""
    return MEMORY_TIEBREAK * memory_bytes / cluster.hbm_bandwidth


def op_costs(op: Op, strategies: list[Strategy], space: Space, cluster: Cluster, cache: dict):
    """Roofline time of ``op`` under each strategy, cached by op signature (repeated layers)."""
    key = (op.kind, op.rule, tuple(v.type for v in op.operands), tuple(r.type for r in op.results))
    key += (id(strategies),)
    if key not in cache:
        cache[key] = np.array([op_cost(op, s, space.mesh, cluster) for s in strategies])
    return cache[key]


def build_problem(space: Space, cluster: Cluster, memory_limit: float | None) -> Problem:
    graph, mesh = space.graph, space.mesh
    memory = [_input_memory(v, space.strategies[n], mesh) for n, v in enumerate(graph.inputs)]
    costs = [input_cost(m, cluster) for m in memory]
    cache: dict = {}
    for i, op in enumerate(graph.ops):
        strategies = space.strategies[space.op_node(i)]
        costs.append(op_costs(op, strategies, space, cluster, cache))
        memory.append(np.zeros(len(strategies)))
    names = [f"%{v.name}" for v in graph.inputs] + [repr(op) for op in graph.ops]
    problem = Problem(names, costs, memory=memory, memory_limit=memory_limit)

    seen: dict[tuple, float] = {}  # repeated layers ask the same (from, to, type) many times

    def price(type_: TensorType):
        def time(a: Sharding, b: Sharding) -> float:
            key = (a, b, type_)
            if key not in seen:
                seen[key] = reshard_time(a, b, type_, mesh, cluster)
            return seen[key]

        return time

    for i, op in enumerate(graph.ops):
        v = space.op_node(i)
        for k, result in enumerate(op.results):
            if (pin := pinned_result(result)) is not None:  # the producer pays to meet its pin
                cost = [price(result.type)(s.results[k], pin) for s in space.strategies[v]]
                problem.node_costs[v] = problem.node_costs[v] + np.array(cost)
            elif result in space.reduce_once:  # ... or to reduce its pending sum, once
                reduce = price(result.type)
                cost = [
                    reduce(s.results[k], s.results[k].without_partial())
                    for s in space.strategies[v]
                ]
                problem.node_costs[v] = problem.node_costs[v] + np.array(cost)
        for j, value in enumerate(op.operands):
            u, k = space.producer[value]
            pin = pinned_result(value)
            once = value in space.reduce_once
            key = ("edge", id(space.strategies[u]), k, pin, once, id(space.strategies[v]), j)
            key += (value.type,)
            if key not in cache:
                u_keys, u_group = group_layouts(
                    [_seen(s.results[k], pin, once) for s in space.strategies[u]]
                )
                v_keys, v_group = group_layouts([s.operands[j] for s in space.strategies[v]])
                price_of = price(value.type)
                matrix = np.array([[price_of(a, b) for b in v_keys] for a in u_keys], dtype=float)
                cache[key] = (u_group, v_group, matrix)
            problem.add_grouped_edge(u, v, *cache[key])
    for j, value in enumerate(graph.outputs):
        _add_output_edge(problem, space, j, value, price(value.type))
    return problem


def _add_output_edge(problem: Problem, space: Space, j: int, value: Value, price) -> None:
    """Aliased outputs must come back in their input's layout; others must not stay partial."""
    u, k = space.producer[value]
    pin = pinned_result(value)
    once = value in space.reduce_once
    produced = [_seen(s.results[k], pin, once) for s in space.strategies[u]]
    alias = space.graph.output_aliases.get(j)
    if alias is not None:
        wanted = [s.results[0] for s in space.strategies[alias]]
        if alias != u:
            problem.add_edge(u, alias, produced, wanted, price)
        return
    if value.pinned and value.sharding is not None:
        target = value.sharding
        problem.node_costs[u] = problem.node_costs[u] + np.array(
            [price(p, target) for p in produced]
        )
    else:
        extra = np.array([price(p, p.without_partial()) for p in produced])
        problem.node_costs[u] = problem.node_costs[u] + extra


def _seen(produced: Sharding, pin: Sharding | None, once: bool) -> Sharding:
    """The layout a consumer reads: the pin, the reduced layout, or what was produced."""
    if pin is not None:
        return pin
    return produced.without_partial() if once else produced


def _input_memory(value: Value, strategies: list[Strategy], mesh: Mesh) -> np.ndarray:
    if value.role not in PERSISTENT_ROLES:
        return np.zeros(len(strategies))
    return np.array([_local_bytes(value.type, s.results[0], mesh) for s in strategies], dtype=float)
