"""``shardplan.evaluate``: price a hand-written strategy with the planner's own cost model.

The strategy's pins fix every graph input's layout and its recomputation policy; the solver
chooses only what the strategy leaves open (activation layouts inside), so the numbers are
directly comparable with ``shardplan.plan`` on the same graph, mesh and budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .costmodel import get_cluster
from .ir import Graph, InfeasiblePlanError, Mesh, Role, op_flops
from .solver.plan import Plan
from .strategies import ParallelStrategy


@dataclass(frozen=True, slots=True)
class Evaluation:
    """Modelled step of one strategy. ``fits`` is False when even its best interior layouts
    exceed the budget; ``plan`` is then the fastest layout with no budget (for its numbers)."""

    strategy: str
    step_time: float
    throughput: float
    """Tokens per second (batch x sequence of the integer data input, per step)."""
    mfu: float
    """Model FLOPs (forward + backward, no recomputation) / (step time x mesh peak)."""
    peak_memory_bytes: int
    memory: dict[str, int]
    fits: bool
    memory_limit: float
    plan: Plan

    def memory_breakdown(self):
        return self.plan.memory_breakdown()


def evaluate(
    model_or_graph: Any,
    *example_args: Any,
    mesh: Mesh,
    strategy: ParallelStrategy,
    memory_limit: float | None = None,
    time_limit: float = 30.0,
    **options: Any,
) -> Evaluation:
    """Evaluate ``strategy`` on a graph (or a torch module / JAX callable with example inputs)."""
    from .validate import check_evaluate_call

    mesh, memory_limit, time_limit = check_evaluate_call(
        model_or_graph, mesh, strategy, memory_limit, time_limit, options
    )
    if strategy.pp > 1:
        raise NotImplementedError(
            f"{strategy.name}: pipeline parallelism (pp={strategy.pp}) is not evaluated yet; "
            "use pp=1 (the pipeline schedule cost lives in costmodel/pipeline.py)"
        )
    graph = _graph(model_or_graph, example_args, options)
    limit = memory_limit if memory_limit is not None else get_cluster(mesh.cluster).hbm_capacity
    pins = strategy.pins(graph, mesh)
    recompute = strategy.recompute_decisions(graph)
    fits = True
    try:
        plan = _solve(graph, mesh, pins, limit, recompute, time_limit)
    except InfeasiblePlanError:
        fits = False
        plan = _solve(graph, mesh, pins, math.inf, recompute, time_limit)
    if strategy.tp_comm_overlap and strategy.tp:
        _simulate_tp_overlap(plan, strategy.tp)
    return _evaluation(
        strategy.name, graph, mesh, plan, fits and plan.peak_memory_bytes <= limit, limit
    )


def _simulate_tp_overlap(plan: Plan, axis: str) -> None:
    """Re-simulate the step with ``axis``'s all-gathers / reduce-scatters pipelined with their
    GEMMs (the strategy's ``tp_comm_overlap``); the layouts do not change."""
    from .costmodel.simulate import SimulationOptions, simulate

    result = simulate(plan, SimulationOptions(tp_overlap_axes=(axis,)))
    plan.exposed_comm_time = result.exposed_comm_time


def _graph(model_or_graph: Any, example_args: tuple, options: dict) -> Graph:
    if isinstance(model_or_graph, Graph):
        return model_or_graph
    from .api import _is_torch_module

    if _is_torch_module(model_or_graph):
        from .frontend.torch.capture import capture
    else:
        from .frontend.jax.capture import capture  # type: ignore[no-redef]
    graph, _ = capture(model_or_graph, *example_args, **options)
    return graph


def _solve(graph: Graph, mesh: Mesh, pins, limit: float, recompute, time_limit: float) -> Plan:
    """Plan under the pins, then restore the graph's own annotations (it is reused).

    Followers are always merged (``merge_followers=True``): a follower of a pinned op takes
    its leader's layout, as the hand-written strategy runs it. The planner's extra exact solve
    of small graphs could trade the strategy away (on a tiny model it gathers Megatron's
    weights and runs every op replicated), which is not the configuration asked about."""
    from .solver.planner import plan_graph

    saved = [(v, v.sharding, v.pinned) for v in graph.values()]
    try:
        return plan_graph(
            graph, mesh, pins=pins, memory_limit=limit, time_limit=time_limit,
            recompute=recompute, merge_followers=True,
        )  # fmt: skip
    finally:
        for v, sharding, pinned in saved:
            v.sharding, v.pinned = sharding, pinned


def model_flops(graph: Graph) -> float:
    """Global FLOPs of forward and backward (and update), without recomputation."""
    total = 0.0
    for op in graph.ops:
        ins = [v.type for v in op.operands]
        outs = [v.type for v in op.results]
        total += op_flops(op.kind, op.rule, ins, outs)
    return total


def tokens_per_step(graph: Graph) -> int:
    """Elements of the first integer data input (token ids ``[batch, seq]``); else its batch."""
    for v in graph.inputs:
        if v.role is Role.INPUT and v.type.dtype.startswith(("i", "u")):
            return v.type.numel
    data = [v for v in graph.inputs if v.role is Role.INPUT and v.type.rank]
    return data[0].type.shape[0] if data else 1


def _evaluation(name: str, graph: Graph, mesh: Mesh, plan: Plan, fits: bool, limit: float):
    cluster = get_cluster(mesh.cluster)
    step = plan.step_time
    peak = cluster.peak("bf16") * mesh.size
    flops = model_flops(graph)
    return Evaluation(
        name,
        step,
        tokens_per_step(graph) / step if step > 0 else math.inf,
        flops / (step * peak) if step > 0 else 0.0,
        plan.peak_memory_bytes,
        dict(plan.memory),
        fits,
        limit,
        plan,
    )
