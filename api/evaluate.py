"""``sp.evaluate`` (``shardplan.api.evaluate``): price a hand-written strategy with the
planner's own cost model.

The strategy's pins fix every graph input's layout and its recomputation policy; the solver
chooses only what the strategy leaves open (activation layouts inside), so the numbers are
directly comparable with ``shardplan.plan`` on the same graph, mesh and budget. A pipelined
strategy (``pp > 1``) goes through ``plan_pipeline``'s stage model with Megatron's equal
stages and its micro-batch count fixed, so it is priced exactly as a pipeline plan is.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any

from ..costmodel import cluster_of
from ..ir import Graph, InfeasiblePlanError, Mesh, Role, op_flops
from ..solver import progress
from ..solver.plan import Plan
from ..solver.strategies import ParallelStrategy


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
    plan: Plan = field(repr=False)

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
    """Evaluate ``strategy`` on a graph (or a torch module / JAX callable with example inputs).

    The returned ``Evaluation.plan`` keeps the capture context, so a torch module's plan can
    be applied (``plan.apply``) and a JAX function's jitted (``plan.jit``) like ``sp.plan``'s.
    """
    from .checks import check_evaluate_call

    mesh, memory_limit, time_limit = check_evaluate_call(
        model_or_graph, mesh, strategy, memory_limit, time_limit, options
    )
    strategy.check(mesh)
    graph, context = _graph(model_or_graph, example_args, options, strategy)
    limit = memory_limit if memory_limit is not None else cluster_of(mesh).hbm_capacity
    semantics = getattr(context, "partial_semantics", None)
    solve = functools.partial(_solve, graph, mesh, strategy, time_limit=time_limit,
                              semantics=semantics)  # fmt: skip
    fits = True
    try:
        plan = solve(limit)
    except InfeasiblePlanError:
        fits = False
        plan = solve(math.inf)
    if strategy.tp_comm_overlap and strategy.tp and strategy.pp == 1:
        plan = _simulate_tp_overlap(plan, strategy.tp)  # a pipeline's stages priced it already
    plan = plan.with_context(context)
    return _evaluation(strategy.name, graph, mesh, plan, fits and _peak(plan) <= limit, limit)


def _peak(plan: Plan) -> int:
    """Per-device peak: the fullest stage of a pipeline (each holds its own layers and
    in-flight micro-batches), else the plan's modelled peak."""
    if plan.pipeline is not None:
        return int(max(s.memory_bytes for s in plan.pipeline.stages))
    return plan.peak_memory_bytes


def best_baseline(
    graph: Graph,
    mesh: Mesh,
    pins=None,
    memory_limit: float | None = None,
    time_limit: float = 30.0,
    semantics: object | None = None,
) -> tuple[str, Plan] | None:
    """The fastest hand-written strategy (``strategies.for_graph``) that fits ``memory_limit``,
    priced as ``evaluate`` prices it, user ``pins`` kept; None if none fits.

    ``sp.plan``'s fallback when the solver finds no plan in time (``solver/planner.py``)."""
    from ..solver.strategies import for_graph

    limit = memory_limit if memory_limit is not None else cluster_of(mesh).hbm_capacity
    best: tuple[str, Plan] | None = None
    for strategy in for_graph(graph, mesh):
        try:
            with progress.muted():  # one progress line per strategy, not one per phase
                plan = _solve(graph, mesh, strategy, limit, time_limit, semantics, pins)
        except InfeasiblePlanError:
            progress.report("baseline", "%s does not fit", strategy.name)
            continue  # does not fit (or not solved in time either)
        step = progress.seconds_text(plan.step_time)
        progress.report("baseline", "%s: step %s, peak %.1f GiB", strategy.name, step,
                        _peak(plan) / 2**30)  # fmt: skip
        if _peak(plan) > limit:
            continue
        if best is None or plan.step_time < best[1].step_time:
            best = (strategy.name, plan)
    return best


def _simulate_tp_overlap(plan: Plan, axis: str) -> Plan:
    """The plan re-simulated with ``axis``'s all-gathers / reduce-scatters pipelined with their
    GEMMs (the strategy's ``tp_comm_overlap``); the layouts do not change."""
    from ..costmodel.simulate import SimulationOptions, simulate

    result = simulate(plan, SimulationOptions(tp_overlap_axes=(axis,)))
    return replace(plan, exposed_comm_time=result.exposed_comm_time)


def _graph(
    model_or_graph: Any, example_args: tuple, options: dict, strategy: ParallelStrategy
) -> tuple[Graph, object | None]:
    """The graph and the frontend's capture context (None for an IR graph)."""
    from ..frontend import capture, frontend_kind

    if strategy.pp > 1 and frontend_kind(model_or_graph) == "jax":
        options.setdefault("unroll_scans", True)  # stages split the layers of a scan
    return capture(model_or_graph, *example_args, **options)


def _solve(
    graph: Graph,
    mesh: Mesh,
    strategy: ParallelStrategy,
    limit: float | None,
    time_limit: float,
    semantics: object | None,
    user_pins=None,
) -> Plan:
    """Plan under the pins, then restore the graph's own annotations (it is reused).

    Followers are always merged (``merge_followers=True``): a follower of a pinned op takes
    its leader's layout, as the hand-written strategy runs it. The planner's extra exact solve
    of small graphs could trade the strategy away (on a tiny model it gathers Megatron's
    weights and runs every op replicated), which is not the configuration asked about.
    A pipelined strategy fixes the stages (equal layer counts) and the micro-batch count, and
    its stages split a micro-batch's tokens only as its batch split does (``micro_sizes=False``,
    the space before micro-batch sizes: with them, the GPT-175B selective row's stages took
    layouts its configuration does not name and modelled 16.6% under the published time, where
    it models +3.8%; ``tests/test_fidelity_bench.py``)."""
    from ..solver.pipeline import plan_pipeline, uniform_stage_bounds
    from ..solver.planner import plan_graph

    saved = [(v, v.sharding, v.pinned, v.priority, v.sharding_origin) for v in graph.values()]
    stage_mesh = mesh.with_axes([(n, s) for n, s in mesh.axes if n != strategy.pipeline_axis])
    options = {
        "pins": {**strategy.pins(graph, stage_mesh), **(user_pins or {})},
        "recompute": strategy.recompute_decisions(graph),
        "merge_followers": True,
        "semantics": semantics,
    }
    try:
        if strategy.pp > 1:
            return plan_pipeline(
                graph, mesh, strategy.pipeline_axis, memory_limit=limit,
                schedule="interleaved" if strategy.chunks > 1 else strategy.schedule,
                chunks=strategy.chunks, microbatches=strategy.microbatches, time_limit=time_limit,
                tp_overlap_axes=(strategy.tp,) if strategy.tp_comm_overlap and strategy.tp else (),
                stage_bounds=uniform_stage_bounds(graph, strategy.pp), micro_sizes=False,
                gathered_axes=strategy.shard_axes(stage_mesh) if strategy.pp_gathered else (),
                **options,
            )  # fmt: skip
        plan = plan_graph(graph, mesh, memory_limit=limit, time_limit=time_limit, **options)
        return strategy.finish(plan)
    finally:
        for v, sharding, pinned, priority, why in saved:
            v.sharding, v.pinned, v.priority, v.sharding_origin = sharding, pinned, priority, why


def model_flops(graph: Graph) -> float:
    """Global FLOPs of forward and backward (and update), without recomputation. Causal
    attention counts dense, as model-FLOPs conventions do (PaLM's ``6NT + 12 l s h T``), though
    the cost model prices the half a causal kernel computes."""
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
    cluster = cluster_of(mesh)
    step = plan.step_time
    peak = cluster.peak("bf16") * mesh.size
    flops = model_flops(graph)
    return Evaluation(
        name,
        step,
        tokens_per_step(graph) / step if step > 0 else math.inf,
        flops / (step * peak) if step > 0 else 0.0,
        _peak(plan),
        dict(plan.memory),
        fits,
        limit,
        plan,
    )
