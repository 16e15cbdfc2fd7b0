"""Build a ``Plan`` from a solved space: layouts, reshards with their collectives, memory."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..costmodel import reshard, reshard_time
from ..costmodel.cluster import Cluster
from ..costmodel.fusion import unfused_penalty
from ..costmodel.simulate import shared_reshards, simulate
from ..ir import Role, Sharding
from ..ir.moe import wire_type
from .costs import (
    PERSISTENT_ROLES,
    Space,
    input_cost,
    op_cost,
    op_costs,
    op_vectors_key,
    pinned_result,
    seen_layout,
    wire_buffers,
)
from .ilp import Solution
from .memory_terms import cache_write
from .plan import Plan, Reshard, SolverStats
from .problem import Problem

SEED_PLAN = ("seed_plan",)
"""Key in ``Space.tables`` of the priced seed's (choice, recomputation, simulated plan)
(``solver/seed.py``): a solve that returns that same point reuses the plan, since
``build_plan`` and the simulator depend only on the layouts and the recomputation."""


def build_plan(
    space: Space, cluster: Cluster, solution: Solution, problem: Problem, memory=None
) -> Plan:  # type: ignore[no-untyped-def]
    """The plan of ``solution``'s layouts on ``space`` (with the memory model's peak and
    recomputation when ``memory`` is given, else the v1 liveness breakdown)."""
    graph, choice = space.graph, solution.choice
    shardings: dict[str, Sharding] = {}
    for value in graph.values():
        shardings[value.name] = space.layout(value, choice)
    parts = _Parts(space, cluster, shardings)
    vectors = _op_vectors(space, cluster)
    for i, op in enumerate(graph.ops):
        node = space.op_node(i)
        strategy = space.strategies[node][choice[node]]
        parts.assignments[i] = strategy.assignment
        parts.compute += float(vectors[i][choice[node]])
        parts.add_op(i, op, strategy)
    outputs = parts.add_outputs()
    reshards = parts.reshards
    shared = shared_reshards(reshards)  # one buffer per (value, source, target): charged once
    comm = sum(r.time for r, leader in zip(reshards, shared, strict=True) if leader is None)
    found = (shardings, parts.operand_shardings, reshards, parts.compute, comm, outputs,
             parts.assignments)  # fmt: skip
    if memory is not None:  # memory hook: the modelled peak, recomputation and its cost
        return _with_memory(space, solution, problem, memory, found)
    breakdown = memory_breakdown(space, shardings)
    stats = solver_stats(solution, problem)
    return Plan(graph, space.mesh, shardings, parts.operand_shardings, reshards, parts.compute,
                comm, sum(breakdown.values()), breakdown, stats, outputs,
                assignments=parts.assignments)  # fmt: skip


class _Parts:
    """What ``build_plan`` collects op by op: operand layouts, strategies, reshards, compute."""

    def __init__(self, space: Space, cluster: Cluster, shardings: dict[str, Sharding]) -> None:
        self.space, self.cluster, self.shardings = space, cluster, shardings
        self.operand_shardings: dict = {}
        self.assignments: dict[int, tuple] = {}
        self.reshards: list[Reshard] = []
        self.compute = 0.0
        self.paths: dict = {}

    def record(self, name, consumer, src, dst, value, count=1) -> None:  # type: ignore[no-untyped-def]
        buffer = wire_buffers(self.space).get(value) if consumer.startswith("op:") else None
        _record(self.reshards, name, consumer, src, dst, value, self.space.mesh, self.cluster,
                self.paths, count, buffer)  # fmt: skip

    def add_op(self, i: int, op, strategy) -> None:  # type: ignore[no-untyped-def]
        """The op's result pins / reduce-once reshards, then each operand's reshard."""
        space, shardings = self.space, self.shardings
        for k, result in enumerate(op.results):
            if pinned_result(result) is not None or result in space.reduce_once:
                kind = "pin" if pinned_result(result) is not None else "reduce"
                self.record(result.name, f"{kind}:{result.name}", strategy.results[k],
                            shardings[result.name], result, op.repeat)  # fmt: skip
        for j, value in enumerate(op.operands):
            self.operand_shardings[(i, j)] = strategy.operands[j]
            if (i, j) in space.fusion.edges:  # a reshard here breaks a fused chain
                src, dst = shardings[value.name], strategy.operands[j]
                self.compute += unfused_penalty(value.type, src, dst, space.mesh, self.cluster)
            self.record(value.name, f"op:{i}:{j}", shardings[value.name], strategy.operands[j],
                        value, op.repeat)  # fmt: skip

    def add_outputs(self) -> list[Sharding]:
        """Each output's layout (its alias's, its pin, or the layout less pending sums)."""
        graph, outputs = self.space.graph, []
        for j, value in enumerate(graph.outputs):
            src = self.shardings[value.name]
            alias = graph.output_aliases.get(j)
            if alias is not None:
                dst, label = self.shardings[graph.inputs[alias].name], f"alias:{j}"
            else:
                dst, label = (
                    (value.sharding if value.pinned and value.sharding else src.without_partial()),
                    f"output:{j}",
                )
            outputs.append(dst)
            self.record(value.name, label, src, dst, value)
        return outputs


def solver_stats(solution: Solution, problem: Problem) -> SolverStats:
    return SolverStats(
        solution.status, solution.objective, solution.bound, solution.wall_time,
        solution.num_variables, len(problem.live_nodes()),
    )  # fmt: skip


def _op_vectors(space: Space, cluster: Cluster) -> list[np.ndarray]:
    """Per op, its seconds per strategy: the vectors ``build_problem`` priced (in
    ``space.tables``), looked up once per space and cluster (the op signature keys cost more
    than the lookups; a memory-bound plan builds two plans: the seed's and the solver's)."""
    key = op_vectors_key(space, cluster)
    found = space.tables.get(key)
    lists = space.strategies
    if (
        found is None
        or found[1] is not cluster
        or len(found[0]) != len(lists)
        or any(a is not b for a, b in zip(found[0], lists, strict=True))
    ):  # a new space or cluster, or lists replaced since (``cap_batch_split``)
        vectors = [
            op_costs(op, lists[space.op_node(i)], space, cluster, space.tables)
            for i, op in enumerate(space.graph.ops)
        ]
        found = space.tables[key] = (list(lists), cluster, vectors)
    return found[2]


def _with_memory(space, solution, problem, memory, parts) -> Plan:
    """Plan with the memory model's peak, breakdown and recomputation (memory hook)."""
    shardings, operand_shardings, reshards, compute, comm, outputs, assignments = parts
    profile = memory.profile(solution.choice)
    compute += memory.recompute_cost(solution.choice)
    stats = solver_stats(solution, problem)
    return Plan(space.graph, space.mesh, shardings, operand_shardings, reshards, compute, comm,
                profile.peak, dict(profile.by_category), stats, outputs,
                recompute=dict(memory.decisions), memory_limit=memory.limit,
                memory_profile=profile, assignments=assignments)  # fmt: skip


def _record(
    reshards, name, consumer, src, dst, value, mesh, cluster, paths, count=1, buffer=None
) -> None:  # type: ignore[no-untyped-def]
    if src == dst:
        return
    moved = wire_type(value.type, buffer, src, dst, mesh) if buffer else value.type
    key = (src, dst, moved)
    if key not in paths:
        paths[key] = tuple(reshard(src, dst, moved, mesh, cluster))
    reshards.append(Reshard(name, consumer, src, dst, paths[key], count))


def memory_breakdown(space: Space, shardings: dict[str, Sharding]) -> dict[str, int]:
    """Per-device bytes: persistent state by role plus the peak of live activations.

    Activations are live from their producer to their last use in graph order (v1 liveness;
    the memory issue refines this with the training schedule).
    """
    graph, mesh = space.graph, space.mesh
    by_role = {"parameters": 0, "optimizer_states": 0, "inputs": 0}
    key = {Role.PARAMETER: "parameters", Role.OPTIMIZER_STATE: "optimizer_states",
           Role.KV_CACHE: "kv_cache"}  # fmt: skip
    for v in graph.inputs:
        kind = key.get(v.role, "inputs")
        by_role[kind] = by_role.get(kind, 0) + v.type.nbytes // shardings[v.name].shard_count(mesh)
    last_use: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        for v in op.operands:
            last_use[v.name] = i
    for v in graph.outputs:
        last_use[v.name] = len(graph.ops)
    live, peak = 0, 0
    frees: dict[int, int] = {}
    for i, op in enumerate(graph.ops):
        for r in op.results:
            if cache_write(r):  # in place: the cache input's bytes
                continue
            size = r.type.nbytes // shardings[r.name].shard_count(mesh)
            live += size
            end = last_use.get(r.name, i)
            frees[end] = frees.get(end, 0) + size
        peak = max(peak, live)
        live -= frees.pop(i, 0)
    by_role["activations"] = peak
    return by_role


def evaluate_choice(space: Space, cluster: Cluster, choice: list[int]) -> float:
    """Modelled cost of a full assignment, recomputed from scratch (tests compare with the ILP)."""
    graph, mesh = space.graph, space.mesh
    total = 0.0
    for n, value in enumerate(graph.inputs):
        if value.role in PERSISTENT_ROLES:
            layout = space.strategies[n][choice[n]].results[0]
            total += input_cost(value.type.nbytes // layout.shard_count(mesh), cluster)
    buffers = wire_buffers(space)
    for i, op in enumerate(graph.ops):
        strategy = space.strategies[space.op_node(i)][choice[space.op_node(i)]]
        total += op.repeat * op_cost(op, strategy, mesh, cluster, space.fusion.of(op))
        for k, result in enumerate(op.results):
            if (pin := pinned_result(result)) is not None or result in space.reduce_once:
                seen = seen_layout(strategy, k, pin)
                total += op.repeat * reshard_time(
                    strategy.results[k], seen, result.type, mesh, cluster
                )
        for j, value in enumerate(op.operands):
            src = space.layout(value, choice)
            wire = wire_type(value.type, buffers.get(value), src, strategy.operands[j], mesh)
            moved = reshard_time(src, strategy.operands[j], wire, mesh, cluster)
            if (i, j) in space.fusion.edges:
                moved += unfused_penalty(value.type, src, strategy.operands[j], mesh, cluster)
            total += op.repeat * moved
    for j, value in enumerate(graph.outputs):
        src = space.layout(value, choice)
        alias = graph.output_aliases.get(j)
        if alias is not None:
            dst = space.strategies[alias][choice[alias]].results[0]
        else:
            dst = src.without_partial()
        total += reshard_time(src, dst, value.type, mesh, cluster)
    return total


def simulated(plan: Plan) -> Plan:
    """The plan with its exposed communication from the two-stream simulator."""
    result = simulate(plan)
    return dataclasses.replace(plan, exposed_comm_time=result.exposed_comm_time)


__all__ = ["SEED_PLAN", "build_plan", "evaluate_choice", "memory_breakdown", "simulated"]
