"""``sp.plan``'s check for devices that repeat the same work, and ``prefer="throughput"``.

A free plan of a tiny model (BERT, T5, a GNN, DLRM, an LSTM on a few GPUs) often splits
nothing: it is the fastest modelled step. When the batch could be split, this plans the
data-parallel alternative the user would run anyway (batch over every axis that divides it,
parameters replicated, or sharded like FSDP when replicated ones do not fit), prices both and
records them in ``plan.idle`` (``solver/idle.py``); ``prefer="throughput"`` returns it.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..ir import Graph, Mesh, Role, ShardplanError
from ..solver.idle import IdleDevices, StepTimes
from ..solver.plan import Plan

PREFERENCES = ("step", "throughput")
"""``sp.plan(prefer=...)``: ``"step"`` (default) returns the fastest modelled step;
``"throughput"`` returns the data-parallel plan when the fastest step leaves devices idle."""

CHECK_TIME_LIMIT = 10.0
"""Solver seconds for the data-parallel alternative (its inputs are all pinned)."""


def split_axes(graph: Graph, mesh: Mesh, skip: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Every mesh axis of size > 1 (mesh order, ``skip`` left out) the batch divides over:
    each batch input's dim 0 divides by the product of the axes taken."""
    batches = [v.type.shape[0] for v in graph.inputs if v.role is Role.INPUT and v.type.rank]
    taken: list[str] = []
    for axis, size in mesh.axes:
        if size > 1 and axis not in skip:
            group = math.prod(mesh.axis_size(a) for a in taken) * size
            if batches and all(b % group == 0 for b in batches):
                taken.append(axis)
    return tuple(taken)


def _times(plan: Plan) -> StepTimes:
    return StepTimes(plan.step_time, plan.compute_time, max(plan.step_time - plan.compute_time, 0))


def _data_parallel(graph, mesh, axes, pins, memory_limit, semantics) -> tuple[str, Plan] | None:  # type: ignore[no-untyped-def]
    """The first of DP, FSDP over ``axes`` that fits (priced as ``sp.evaluate`` prices them)."""
    from ..costmodel.cluster import cluster_of
    from ..solver.strategies import ParallelStrategy
    from .evaluate import _peak, _solve

    limit = memory_limit if memory_limit is not None else cluster_of(mesh).hbm_capacity
    for name, shard in (("dp", False), ("fsdp", True)):
        strategy = ParallelStrategy(name, dp=axes, shard_params=shard)
        inputs = strategy.pins(graph, mesh)
        split = {**_batch_split_activations(graph, mesh, inputs, axes), **(pins or {})}
        try:
            plan = _solve(graph, mesh, strategy, limit, CHECK_TIME_LIMIT, semantics, split)
        except (ShardplanError, ValueError):  # does not fit, or a user pin contradicts it
            continue
        if _peak(plan) <= limit:
            return name, plan
    return None


def _batch_split_activations(graph: Graph, mesh: Mesh, inputs: dict, axes: tuple[str, ...]) -> dict:
    """Value name -> layout for every op result the batch split reaches (``propagate`` from
    the strategy's input pins, GSPMD mode), pending sums left out: pinned, they keep the
    activations split as data parallelism runs them. Pinning the inputs alone lets a tiny
    model's solve gather the batch at its first op and compute replicated (cheaper still).
    Propagation runs on ``mesh`` (the user's): after a 3-axis solve ``graph.mesh`` may be the
    axis search's last merged mesh (``dp_fsdp``), which the layouts found there do not name."""
    from ..passes.propagate import PropagateOptions, run_propagation

    saved = [(v, v.sharding, v.pinned, v.priority, v.sharding_origin) for v in graph.values()]
    by_name = {v.name: v for v in graph.inputs}
    graph_mesh, graph.mesh = graph.mesh, mesh
    try:
        for name, layout in inputs.items():
            by_name[name].sharding, by_name[name].pinned = layout, True
        run_propagation(graph, PropagateOptions(direction="forward"))
        return {
            v.name: v.sharding
            for op in graph.ops
            for v in op.results
            if v.sharding is not None and not v.sharding.partial
            and v.sharding.used_axes & set(axes)
        }  # fmt: skip
    finally:
        graph.mesh = graph_mesh
        for v, sharding, pinned, priority, why in saved:
            v.sharding, v.pinned, v.priority, v.sharding_origin = sharding, pinned, priority, why


def check_idle_devices(  # type: ignore[no-untyped-def]
    free: Plan, pins, memory_limit: float | None, prefer: str, pipeline_axis: str = "pp"
) -> Plan:
    """``free`` with ``free.idle`` set when it leaves devices repeating the same work and the
    batch could be split; with ``prefer="throughput"`` the data-parallel plan instead (its
    ``idle`` records both). ``free`` unchanged when nothing is idle or nothing can split."""
    from ..solver.idle import REPEAT_THRESHOLD, work_repeats
    from ..solver.summary import batch_axes, idle_axes

    if free.pipeline is not None or free.serving is not None:
        return free
    mesh = free.mesh
    axes, work = tuple(idle_axes(free)), work_repeats(free)
    data_axes = split_axes(free.graph, mesh, skip=(pipeline_axis,))
    unsplit = tuple(a for a in data_axes if a not in batch_axes(free))
    whole = bool(set(axes) & set(data_axes))  # some axis splits nothing though it could
    if not whole and (work < REPEAT_THRESHOLD or not unsplit):
        return free  # nothing idle, or the batch cannot use it (IdleAxisWarning says so)
    semantics = getattr(free.frontend_context, "partial_semantics", None)
    found = _data_parallel(free.graph, mesh, data_axes, pins, memory_limit, semantics)
    if found is None:
        return free
    name, split = found
    cluster_floor = _kernel_floor(mesh)
    shown = axes if whole else unsplit
    repeats = math.prod(mesh.axis_size(a) for a in axes) if whole else int(work)
    idle = IdleDevices(
        shown, repeats, work, whole, data_axes, name, _times(free), _times(split), cluster_floor
    )
    if prefer != "throughput":
        return replace(free, idle=idle)
    return replace(
        split,
        frontend_context=free.frontend_context,
        timings=dict(free.timings),
        idle=replace(idle, chosen="throughput"),
    )


def _kernel_floor(mesh: Mesh) -> float:
    from ..costmodel.cluster import cluster_of

    return cluster_of(mesh).kernel_floor
