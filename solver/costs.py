"""Price a graph's per-op choices into a layout Problem: compute per op, resharding per edge."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from ..costmodel import compute_time
from ..costmodel.cluster import Cluster, get_cluster
from ..costmodel.context_parallel import attention_work_factor
from ..costmodel.conv import conv_work_factor, halo_time, layout_time
from ..costmodel.engine import launches as engine_launches
from ..costmodel.fusion import Fusion, OpFusion, fusion, unfused_penalty
from ..costmodel.reshard import ReshardPricer
from ..ir import (
    Graph,
    Mesh,
    Op,
    Role,
    Sharding,
    ShardingError,
    ShardingRule,
    TensorType,
    Value,
    op_bytes,
    op_flops,
)
from ..ir.moe import Buffer, dedup_buffers, wire_type
from ..passes.enumerate_strategies import (
    Choice,
    Coords,
    input_choices,
    input_choices_near,
    op_choices,
    op_choices_near,
)
from .problem import Problem, group_layouts

PERSISTENT_ROLES = (
    Role.PARAMETER, Role.OPTIMIZER_STATE, Role.INPUT, Role.CONSTANT, Role.KV_CACHE,
)  # fmt: skip
MEMORY_TIEBREAK = 1e-3
"""Seconds charged per second of HBM traffic the persistent state would take to read once:
it makes a sharded input win over an equally fast replicated one (memory has value) without
ever outweighing a real compute or communication difference."""


@dataclass(frozen=True, slots=True)
class PartialSemantics:
    """How the target runtime treats pending sums (partial values); frontends declare it.

    DTensor keeps ``Partial`` through linear ops and reduces per consumer; XLA in Auto mode
    reduces a dot's pending sum right at the dot, once, however many ops read it — into the
    unpartial layout (all-reduce) or, when every reader slices it the same way, straight into
    that slice (all-reduce + dynamic-slice, which XLA makes one reduce-scatter).
    """

    passthrough: bool = True
    """Linear ops may consume and produce partial values."""
    reduce_once: bool = False
    """A partial value read by several ops is reduced once (all-reduce) at its producer."""
    ordered_dims: bool = False
    """A dim split over several mesh axes must list them in mesh order (major first). DTensor's
    public placements (torch) say only which dim each axis splits and split it in mesh order;
    the other order is a ``_StridedShard``, which views cannot unflatten. Strategies with such
    a dim are then never proposed (docs/torch.md, "Layouts DTensor runs")."""


@dataclass(eq=False, slots=True)
class Space:
    """The decision nodes of a graph: graph inputs first, then ops, with their strategies."""

    graph: Graph
    mesh: Mesh
    strategies: list[list[Choice]]
    producer: dict[Value, tuple[int, int]]
    """Value -> (node, result index)."""
    repeated: object | None = None
    """``passes.repeated_layers.RepeatedLayers`` once computed (shared by solver variants)."""
    reduce_once: frozenset[Value] = frozenset()
    """Multi-use values whose pending sums are reduced once at the producer."""
    fusion: Fusion = field(default_factory=lambda: Fusion({}, frozenset()))
    """Elementwise chains kept on chip (``costmodel.fusion``): op prices skip their bytes."""
    prices: dict = field(default_factory=dict)
    """(from, to, type, fused) -> reshard seconds on ``mesh``; spaces of one mesh may share it
    (the axis search's steps ask mostly the same questions)."""
    tables: dict = field(default_factory=dict)
    """Op-cost vectors and edge tables keyed by strategy-list identity (``build_problem``);
    spaces whose lists come from one ``build_space`` cache may share it."""
    solved: tuple | None = None
    """(merged?, problem, solution, memory) of an axis-search step's solve of this space, for
    the finish on the same space to reuse (``planner._reusable_step``)."""

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
        node, k = self.producer[value]
        strategy = self.strategies[node][choice[node]]
        return seen_layout(strategy, k, pinned_result(value), value in self.reduce_once)


def _mesh_ordered(strategy: Choice, mesh: Mesh) -> bool:
    """Every dim of every operand and result lists its axes in mesh order."""
    return all(
        list(axes) == sorted(axes, key=mesh.axis_index)
        for layout in (*strategy.operands, *strategy.results)
        for axes in layout.dims
    )


def pinned_result(value: Value) -> Sharding | None:
    """The user pin of an op result (a GSPMD sharding constraint), if any."""
    if value.producer is not None and value.pinned and value.sharding is not None:
        return value.sharding
    return None


def build_space(
    graph: Graph,
    mesh: Mesh,
    semantics: PartialSemantics | None = None,
    around: list[Coords] | None = None,
    lists: dict | None = None,
    rules: Mapping[int, ShardingRule] | None = None,
) -> Space:
    """Enumerate strategies; ops and inputs with the same signature share one list object
    (so the copies of a repeated layer cost a dictionary lookup, and pricing can be cached).

    ``around``: per node (inputs, then ops) a strategy's coordinates; each node then gets only
    the strategies within one mesh axis of it (``solver/axis_search.py``). ``lists``: the
    signature -> strategy list cache, to share with other spaces of the same graph and mesh.
    ``rules``: op index -> the rule to enumerate that op's strategies by (a pipeline's
    micro-batch sizes, ``solver/batch.py``'s ``micro_rules``); pricing keeps the op's own."""
    semantics = semantics or PartialSemantics()
    once = frozenset(_multi_use(graph)) if semantics.reduce_once else frozenset()
    cache: dict[tuple, list[Choice]] = {} if lists is None else lists
    canon: dict = cache.setdefault(("canonical",), {})  # type: ignore[arg-type]
    strategies = []
    for v in graph.inputs:
        pin = v.sharding if v.pinned else None
        key = ("input", v.type.shape, v.role is Role.CONSTANT and v.type.numel <= 1, pin)
        if around is not None:
            key += (around[len(strategies)],)
        if key not in cache:
            cache[key] = _canonical(
                input_choices(v, mesh)
                if around is None
                else input_choices_near(v, mesh, around[len(strategies)]),
                canon,
            )
        strategies.append(cache[key])
    producer: dict[Value, tuple[int, int]] = {v: (n, 0) for n, v in enumerate(graph.inputs)}
    for i, op in enumerate(graph.ops):
        node = len(graph.inputs) + i
        reduced = tuple(k for k, r in enumerate(op.results) if r in once and not r.pinned)
        rule = rules.get(i, op.rule) if rules else op.rule
        key = ("op", op.kind, op.rule, bool(op.operands), reduced)
        if rule is not op.rule:
            key += (rule,)
        if around is not None:
            key += (around[node],)
        if key not in cache:
            cache[key] = _enumerated(op, mesh, semantics, rule, around, node)
            if reduced:
                cache[key] = _with_reductions(cache[key], op, reduced, mesh)
            cache[key] = _canonical(cache[key], canon)
        strategies.append(cache[key])
        for k, r in enumerate(op.results):
            producer[r] = (node, k)
    return Space(graph, mesh, strategies, producer, reduce_once=once, fusion=fusion(graph))


def _enumerated(op: Op, mesh: Mesh, semantics: PartialSemantics, rule: ShardingRule, around,
                node: int) -> list[Choice]:  # type: ignore[no-untyped-def]  # fmt: skip
    """The op's strategies (near ``around[node]`` when given) that the runtime can express. A
    centre the rule does not allow (a pipeline's later batch cap starting from an earlier
    cap's plan, which split the sequence under a batch that this cap's micro-batch does not
    fully split) may have no such neighbour: the replicated strategy's neighbourhood then
    stands in."""
    if around is None:
        return _expressible(op_choices(op, mesh, semantics.passthrough, rule), semantics, mesh)
    for center in (around[node], (None,) * len(around[node])):
        found = op_choices_near(op, mesh, center, semantics.passthrough, rule)
        found = _expressible(found, semantics, mesh)
        if found:
            break
    return found


def _expressible(strategies: list[Choice], semantics: PartialSemantics, mesh: Mesh) -> list:
    """Those the runtime can lay out (``ordered_dims``: mesh axes in mesh order per dim)."""
    if not semantics.ordered_dims:
        return strategies
    return [s for s in strategies if _mesh_ordered(s, mesh)]


def _canonical(strategies: list[Choice], canon: dict[Sharding, Sharding]) -> list[Choice]:
    """The strategies with every layout replaced by the first equal one seen (``canon``): the
    price tables are keyed by layout pairs, and a lookup whose keys are the stored objects
    themselves skips comparing them (a third of the lookup time on 3-D and 4-D meshes)."""
    get = canon.setdefault
    return [
        Choice(
            tuple(get(x, x) for x in s.operands),
            tuple(get(x, x) for x in s.results),
            s.assignment,
            s.split,
            tuple(get(x, x) for x in s.reduced),
        )
        for s in strategies
    ]


def reduced_layouts(produced: Sharding, type_: TensorType, mesh: Mesh) -> list[Sharding]:
    """Where a producer may reduce its pending sum to: the unpartial layout (one all-reduce),
    or that layout with every partial axis appended to one dim (one reduce-scatter: XLA turns
    an all-reduce that is only read through the same dynamic-slice into a reduce-scatter, so
    reducing once and slicing for every reader costs a reduce-scatter, not an all-reduce).
    Only all pending axes together: an all-reduce of some axes plus a reduce-scatter of the
    others is not what XLA does for one reduction."""
    base = produced.without_partial()
    if not produced.partial:
        return [base]
    out = [base]
    pending = [a for a in mesh.axis_names if a in produced.partial]
    for order in itertools.permutations(pending):
        for d in range(len(base.dims)):
            dims = list(base.dims)
            dims[d] = (*dims[d], *order)
            candidate = Sharding(tuple(dims), frozenset())
            try:
                candidate.check(type_, mesh)
            except ShardingError:
                continue
            out.append(candidate)
    return out


def _with_reductions(
    strategies: list[Choice], op: Op, reduced: tuple[int, ...], mesh: Mesh
) -> list[Choice]:
    """Each strategy once per choice of where its reduce-once results are reduced to."""
    out = []
    for s in strategies:
        options = [
            reduced_layouts(s.results[k], r.type, mesh) if k in reduced else [s.results[k]]
            for k, r in enumerate(op.results)
        ]
        for combo in itertools.product(*options):
            out.append(Choice(s.operands, s.results, s.assignment, s.split, tuple(combo)))
    return out


def _multi_use(graph: Graph) -> list[Value]:
    """Op results read by two or more ops (or by an op and as a graph output)."""
    outputs = {id(v) for v in graph.outputs}
    return [
        r
        for op in graph.ops
        for r in op.results
        if len({id(u.op) for u in r.uses}) + (id(r) in outputs) >= 2
    ]


def op_cost(
    op: Op, strategy: Choice, mesh: Mesh, cluster: Cluster, fused: OpFusion | None = None
) -> float:
    """Roofline time of the op on one device under a strategy (``fused``: its operands read
    and results kept on chip by a fused kernel, ``Space.fusion``)."""
    ins = [v.type for v in op.operands]
    outs = [v.type for v in op.results]
    flops = op_flops(op.kind, op.rule, ins, outs, op.attrs) / strategy.split
    flops *= attention_work_factor(op, strategy.operands, mesh, cluster)
    flops *= conv_work_factor(op, cluster)  # implicit-GEMM tiles (costmodel/conv.py)
    on_chip = (fused.on_chip_operands, fused.on_chip_results) if fused else ((), ())
    nbytes = op_bytes(
        op.kind,
        ins,
        outs,
        [s.shard_count(mesh) for s in strategy.operands],
        [s.shard_count(mesh) for s in strategy.results],
        *on_chip,
        attrs=op.attrs,
        split=strategy.split,
    )
    dtype = (outs or ins)[0].dtype
    halo = halo_time(op, strategy.operands, mesh, cluster)  # a spatially split convolution
    halo += layout_time(op, strategy.operands, strategy.results, mesh, cluster)  # NCHW convs
    launches = engine_launches(op.kind, fused is None or fused.launches, get_cluster(cluster))
    return halo + compute_time(flops, nbytes, dtype, cluster, launches=launches)


def _local_bytes(type_: TensorType, sharding: Sharding, mesh: Mesh) -> int:
    return type_.nbytes // sharding.shard_count(mesh)


def input_cost(memory_bytes: float, cluster: Cluster) -> float:
    """Tie-breaking price of holding ``memory_bytes`` of persistent state per device."""
    return MEMORY_TIEBREAK * memory_bytes / cluster.hbm_bandwidth


def op_costs(op: Op, strategies: list[Choice], space: Space, cluster: Cluster, cache: dict):
    """Roofline time of ``op`` under each strategy, cached by op signature (repeated layers)."""
    fused = space.fusion.of(op)
    key = (*op_signature(op, fused), id(strategies))
    if key not in cache:
        cache.setdefault("lists", {}).setdefault(id(strategies), strategies)  # ids stay unique
        cache[key] = np.array([op_cost(op, s, space.mesh, cluster, fused) for s in strategies])
    repeat = op.repeat
    return cache[key] * repeat if repeat != 1 else cache[key]


def op_signature(op: Op, fused: object) -> tuple:
    """What an op's roofline time depends on besides its layouts: alike ops (the layers of a
    stack) share it, so their times are priced once."""
    operands, results = tuple(v.type for v in op.operands), tuple(r.type for r in op.results)
    return (op.kind, op.rule, operands, results, fused, op.attrs.get("causal"),
            op.attrs.get("load_balance"), op.attrs.get("pooling"))  # fmt: skip


def op_vectors_key(space: Space, cluster: Cluster) -> tuple:
    """Key in ``Space.tables`` of (the strategy lists, the cluster, per op its seconds per
    strategy): what ``build_problem`` priced, which ``planner.build_plan`` looks up again."""
    return ("op_vectors", id(space), id(cluster))


def build_problem(space: Space, cluster: Cluster, memory_limit: float | None) -> Problem:
    graph, mesh = space.graph, space.mesh
    memory = [_input_memory(v, space.strategies[n], mesh) for n, v in enumerate(graph.inputs)]
    costs = [input_cost(m, cluster) for m in memory]
    cache = space.tables
    alive = cache.setdefault("lists", {})  # keys use id(list): keep every list alive
    for options in space.strategies:
        alive.setdefault(id(options), options)
    for i, op in enumerate(graph.ops):
        strategies = space.strategies[space.op_node(i)]
        costs.append(op_costs(op, strategies, space, cluster, cache))
        memory.append(np.zeros(len(strategies)))
    names = [f"%{v.name}" for v in graph.inputs] + [repr(op) for op in graph.ops]
    problem = Problem(names, costs, memory=memory, memory_limit=memory_limit)
    key = op_vectors_key(space, cluster)  # ``build_plan`` reads the same vectors (70B: 0.7 s)
    cache[key] = (list(space.strategies), cluster, costs[len(graph.inputs) :])

    seen = space.prices  # repeated layers ask the same (from, to, type) many times
    reshard_time = _pricer(seen, mesh, cluster)

    def price(type_: TensorType, fused: bool = False, buffer: Buffer | None = None):
        """Reshard seconds; on a fused edge also the HBM round trip the reshard forces; of a
        deduplicated dispatch ``buffer`` (``ir.moe.wire_type``), the bytes its dispatcher
        sends."""

        table = seen.get((type_, fused, buffer))  # per type: (a, b) keys hash and compare faster
        if table is None:
            table = seen[(type_, fused, buffer)] = {}

        def time(a: Sharding, b: Sharding) -> float:
            key = (a, b)
            found = table.get(key)
            if found is None:
                moved = wire_type(type_, buffer, a, b, mesh) if buffer else type_
                found = reshard_time(a, b, moved)
                if fused:
                    found += unfused_penalty(type_, a, b, mesh, cluster)
                table[key] = found
            return found

        return time

    for i, op in enumerate(graph.ops):
        v = space.op_node(i)
        _add_producer_costs(problem, space, op, v, price)
        _add_operand_edges(problem, space, i, op, v, price, cache)
    for j, value in enumerate(graph.outputs):
        _add_output_edge(problem, space, j, value, price(value.type), cache)
    return problem


def _add_operand_edges(problem: Problem, space: Space, i: int, op: Op, v: int, price, cache):  # type: ignore[no-untyped-def]
    """One edge per operand of op ``i`` (node ``v``) from its producer, priced per table."""
    buffers = wire_buffers(space)
    for j, value in enumerate(op.operands):
        u, k = space.producer[value]
        pin = pinned_result(value)
        once = value in space.reduce_once
        fused = (i, j) in space.fusion.edges
        buffer = buffers.get(value)
        key = ("edge", id(space.strategies[u]), k, pin, once, id(space.strategies[v]), j)
        key += (value.type, fused, buffer)
        layouts = partial(_operand_layouts, space, u, k, pin, once, v, j)
        u_group, v_group, matrix = _edge(cache, key, layouts, price(value.type, fused, buffer))
        if matrix is None:  # no layout pair reshards: no edge
            continue
        if op.repeat != 1:  # an edge into a scan body's op reshards every iteration
            matrix = matrix * op.repeat
        problem.add_grouped_edge(u, v, u_group, v_group, matrix, nonzero=True)


def wire_buffers(space: Space) -> dict[Value, Buffer]:
    """The graph's deduplicated dispatch buffers (``ir.moe.dedup_buffers``), found once per
    space: their expert all-to-alls are priced at the bytes the dispatcher sends."""
    found = space.tables.get(("wire_buffers",))
    if found is None:
        found = space.tables[("wire_buffers",)] = dedup_buffers(space.graph)
    return found


def _pricer(prices: dict, mesh: Mesh, cluster: Cluster) -> ReshardPricer:
    """The reshard pricer kept beside a space's price tables (shared with them by the axis
    search's steps, so each collective and walk is priced once per search)."""
    key = ("pricer", mesh, cluster)
    found = prices.get(key)
    if found is None:
        found = prices[key] = ReshardPricer(mesh, cluster)
    return found


def _add_producer_costs(problem: Problem, space: Space, op: Op, v: int, price) -> None:  # type: ignore[no-untyped-def]
    """The producer pays to meet a pinned result's layout, or to reduce a pending sum once."""
    for k, result in enumerate(op.results):
        if (pin := pinned_result(result)) is not None:
            cost = [price(result.type)(s.results[k], pin) for s in space.strategies[v]]
        elif result in space.reduce_once:
            reduce = price(result.type)
            cost = [reduce(s.results[k], seen_layout(s, k)) for s in space.strategies[v]]
        else:
            continue
        problem.node_costs[v] = problem.node_costs[v] + op.repeat * np.array(cost)


def _add_output_edge(
    problem: Problem, space: Space, j: int, value: Value, price, cache: dict
) -> None:  # type: ignore[no-untyped-def]
    """Aliased outputs must come back in their input's layout; others must not stay partial."""
    u, k = space.producer[value]
    pin = pinned_result(value)
    once = value in space.reduce_once
    alias = space.graph.output_aliases.get(j)
    if alias is not None:
        if alias == u:
            return
        key = ("alias", id(space.strategies[u]), k, pin, once, id(space.strategies[alias]))
        key += (value.type,)  # every layer's updated parameters ask the same question
        layouts = partial(_operand_layouts, space, u, k, pin, once, alias, None)
        u_group, v_group, matrix = _edge(cache, key, layouts, price)
        if matrix is not None:
            problem.add_grouped_edge(u, alias, u_group, v_group, matrix, nonzero=True)
        return
    produced = [seen_layout(s, k, pin, once) for s in space.strategies[u]]
    if value.pinned and value.sharding is not None:
        target = value.sharding
        problem.node_costs[u] = problem.node_costs[u] + np.array(
            [price(p, target) for p in produced]
        )
    else:
        extra = np.array([price(p, p.without_partial()) for p in produced])
        problem.node_costs[u] = problem.node_costs[u] + extra


def _operand_layouts(space: Space, u: int, k: int, pin, once: bool, v: int, j: int | None):  # type: ignore[no-untyped-def]
    """Per strategy, the layout ``u`` delivers and the layout ``v`` wants as operand ``j``
    (``None``: an aliased input, which wants its own stored layout)."""
    produced = [seen_layout(s, k, pin, once) for s in space.strategies[u]]
    if j is None:
        return produced, [s.results[0] for s in space.strategies[v]]
    return produced, [s.operands[j] for s in space.strategies[v]]


def _edge(cache: dict, key: tuple, layouts, price) -> tuple:  # type: ignore[no-untyped-def]
    """(producer groups, consumer groups, cost matrix) of an edge, priced once per ``key``:
    ``layouts()`` gives both ends' layouts per strategy; ``price(a, b)`` a reshard time. The
    matrix is None when every entry is zero (no edge; checked once, not per alike edge)."""
    found = cache.get(key)
    if found is None:
        produced, wanted = layouts()
        u_keys, u_group = group_layouts(produced)
        v_keys, v_group = group_layouts(wanted)
        matrix = np.array([[price(a, b) for b in v_keys] for a in u_keys], dtype=float)
        found = cache[key] = (u_group, v_group, matrix if np.any(matrix != 0) else None)
    return found


def seen_layout(
    strategy: Choice, k: int, pin: Sharding | None = None, once: bool = True
) -> Sharding:
    """The layout a consumer reads of result ``k``: the pin, the reduced layout (reduce-once
    values), or what was produced."""
    if pin is not None:
        return pin
    if not once:
        return strategy.results[k]
    return strategy.reduced[k] if strategy.reduced else strategy.results[k].without_partial()


def _input_memory(value: Value, strategies: list[Choice], mesh: Mesh) -> np.ndarray:
    if value.role not in PERSISTENT_ROLES:
        return np.zeros(len(strategies))
    return np.array([_local_bytes(value.type, s.results[0], mesh) for s in strategies], dtype=float)
