"""Pipeline planning: intra-op plan on the sub-mesh, per-layer costs, then stage assignment.

The mesh axis named for pipelining (``"pp"``) is taken out; the rest is the sub-mesh each stage
runs on. Every repeated layer shares one intra-op plan (DESIGN.md §6), so one solve on the
sub-mesh prices every layer; its costs are attributed to layers, to what runs before the stack
(first stage) and after it (last stage), and the stage ILP (``solver/stages.py``) picks the
split and the micro-batch count under each stage's memory.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from functools import partial

from ..costmodel import cluster_of, group_link
from ..costmodel.cluster import Cluster
from ..costmodel.exposure import edge_exposure
from ..costmodel.fusion import fusion, unfused_penalty
from ..ir import (
    Graph,
    InfeasiblePlanError,
    Mesh,
    Op,
    Role,
    ShardplanError,
    Value,
    op_flops,
    op_info,
)
from ..ir.errors import PipelineError
from ..passes.liveness import liveness
from ..passes.repeated_layers import _layer_members
from .axis_search import shared_start
from .batch import batch_size, microbatch_fits, remembered
from .cap_bound import CapCannotWin
from .costs import op_cost, op_signature
from .plan import PipelinePlan, Plan, StageSpec
from .stages import LayerCosts, StageAssignment, assign_stages, evaluate_split

MAX_MICROBATCHES = 64
"""The most micro-batches tried (a bound on the search, well past where the bubble vanishes)."""

SCHEDULE_CHOICES = ("1f1b", "gpipe", "interleaved", "auto")
"""Pipeline schedules a plan may ask for; ``"auto"`` lets the planner pick 1F1B or interleaved."""


def plan_pipeline(
    graph: Graph,
    mesh: Mesh,
    axis: str = "pp",
    memory_limit: float | None = None,
    schedule: str = "1f1b",
    microbatches: int | None = None,
    time_limit: float = 30.0,
    stage_bounds: tuple[int, ...] | None = None,
    chunks: int | None = None,
    tp_overlap_axes: tuple[str, ...] = (),
    micro_sizes: bool = True,
    gathered_axes: tuple[str, ...] = (),
    **planner_options,
) -> Plan:
    """Plan ``graph`` on ``mesh`` with pipeline stages along ``axis``.

    ``stage_bounds`` (first layer of each stage) fixes the split instead of searching it, to
    evaluate a hand-written configuration (e.g. Megatron's uniform stages) under the same model.
    ``schedule="interleaved"``: Megatron's virtual pipeline, ``chunks`` model chunks per device
    (``None``: the planner picks it); ``"auto"``: the planner picks 1F1B or interleaved with
    any chunk count, whichever models fastest within memory.
    ``tp_overlap_axes``: collectives on these axes run chunked under their GEMM in the stage
    times (Megatron-Core ``--tp-comm-overlap``, as ``SimulationOptions.tp_overlap_axes``).
    ``micro_sizes``: size batch factors per micro-batch under each cap (``_sized``); False
    keeps whole-batch sizes, where a cap bounds every batch-carrying split (a hand-written
    strategy's stages, which split a micro-batch's tokens only as its batch split does).
    ``gathered_axes``: parameters sharded over these axes stay gathered over them for the
    whole step, their gradients accumulated unsharded in fp32 until one reduction after the
    last backward (torchtitan's FSDP under PP, ``docs/torchtitan.md``); each stage's memory
    counts them (``_state_split``).
    """
    from .planner import plan_graph

    _check_schedule(schedule, chunks, stage_bounds, microbatches, mesh.axis_size(axis))
    stages = mesh.axis_size(axis)
    sub_mesh = mesh.with_axes([(n, s) for n, s in mesh.axes if n != axis])
    limit = memory_limit if memory_limit is not None else cluster_of(mesh).hbm_capacity
    if stages == 1:
        return plan_graph(
            graph, sub_mesh, memory_limit=limit, time_limit=time_limit, **planner_options
        )
    return _plan_stages(
        graph, mesh, sub_mesh, axis, stages, limit, schedule, microbatches, time_limit,
        stage_bounds, planner_options, (chunks, tuple(tp_overlap_axes), tuple(gathered_axes)),
        micro_sizes,
    )  # fmt: skip


def _check_schedule(schedule: str, chunks, bounds, microbatches, stages: int) -> None:
    if schedule not in SCHEDULE_CHOICES:
        raise PipelineError(
            f"unknown pipeline schedule {schedule!r}: one of {', '.join(SCHEDULE_CHOICES)}"
        )
    if chunks is not None and (not isinstance(chunks, int) or chunks < 1):
        raise PipelineError(f"chunks={chunks!r}: a whole number of model chunks per device >= 1")
    if schedule != "interleaved" and chunks not in (None, 1):
        raise PipelineError(f"chunks={chunks} needs schedule='interleaved'")
    if schedule == "interleaved" and microbatches and microbatches % stages:
        raise PipelineError(
            f"interleaved 1F1B needs micro-batches ({microbatches}) divisible by the stage "
            f"count ({stages}), as Megatron-LM does"
        )


def _plan_stages(
    graph, mesh, sub_mesh, axis, stages, limit, schedule, microbatches, time_limit,
    stage_bounds, planner_options, extra=(None, (), ()), micro_sizes=True,
) -> Plan:  # fmt: skip
    """The best of one sub-mesh plan per batch-split cap, each with its best stages.

    A stage runs micro-batches of ``B / m`` samples, so its ops split the batch over at most
    that many devices: each cap (a sub-mesh group size, or ``B / microbatches`` when given)
    gets its own sub-mesh solve, whose batch split then bounds the micro-batch counts tried.
    Without the cap, slicing the batch is free and the sub-mesh plan splits it, which caps
    ``m`` and leaves a large bubble and every in-flight activation (GPT-175B found no split).
    """
    batch = batch_size(graph)
    floor = _compute_floor(graph, sub_mesh, cluster_of(mesh))
    best: tuple[Plan, LayerSplit, StageAssignment] | None = None
    error: ShardplanError | None = None
    v = _most_chunks(graph, schedule, extra[0], stages)  # the smallest bubble any plan has
    sized = [micro_sizes]  # micro-batch-sized spaces until one finds no plan in time (``_sized``)
    with remembered(graph), shared_start(graph):  # every cap plans the same graph and mesh
        for cap in _batch_caps(sub_mesh, batch, microbatches):
            m_max = microbatches or min(batch // cap, MAX_MICROBATCHES)
            if best is not None and _bubble_bound(floor, stages, m_max, v) >= best[2].step_time:
                continue  # even perfect stages at peak speed lose: skip the sub-mesh solve
            options = planner_options if best is None or extra[1] else {  # (TP overlap
                # shortens the stage times below what the bound counts)
                **planner_options, "cutoff": partial(_loses, stages, m_max, v, best[2].step_time)
            }  # fmt: skip
            try:
                found = _sized(sized, partial(
                    _plan_cap, graph, mesh, sub_mesh, axis, stages, limit, schedule,
                    microbatches, time_limit, stage_bounds, options, cap, extra,
                ))  # fmt: skip
            except CapCannotWin:
                continue  # the cap's own space bounds its step above the best: not solved
            except InfeasiblePlanError as exc:
                error = exc
                continue
            if best is None or found[2].step_time < best[2].step_time - 1e-12:
                best = found
    if best is None:
        raise error or InfeasiblePlanError("no pipeline plan")
    inner, split, assignment = best
    # the whole mesh; the layouts use only the stage mesh's axes
    return replace(inner, pipeline=_pipeline_plan(axis, split, assignment), mesh=mesh)


def _sized(sized: list[bool], plan_cap):  # type: ignore[no-untyped-def]
    """``plan_cap(micro=...)`` with micro-batch sizes while ``sized[0]``; when such a solve
    finds no plan in time, this cap and every later one use whole-batch sizes under the cap
    (``sized[0] = False``), the space before micro-batch sizes. Their space holds the
    whole-batch one, but a memory-bound solve is seeded from its LP's layouts only when those
    fit fully recomputed: on the HF 405B-shaped row (``bench/scale.py``, pp 8 x dp 2 x tp 8,
    16 x 8K) the LP split the tokens 16 ways with every weight replicated, which does not fit,
    and the unseeded first cap ended ``UNKNOWN`` (docs/design.md, "Pipelines")."""
    from .planner import NoPlanInTime

    if not sized[0]:
        return plan_cap(micro=False)
    try:
        return plan_cap(micro=True)
    except NoPlanInTime:
        sized[0] = False
    return plan_cap(micro=False)


def uniform_stage_bounds(graph: Graph, stages: int) -> tuple[int, ...]:
    """First layer (position in the layer stack) of each of ``stages`` equal stages, as
    Megatron-LM splits a model; with a remainder the last stages take one layer more (the
    first stage also runs the embedding)."""
    _, layer_ids, _ = _stack(graph)
    n = len(layer_ids)
    if n < stages:
        raise PipelineError(
            f"cannot pipeline {n} repeated layers over {stages} stages; use fewer stages"
        )
    small, extra = divmod(n, stages)
    sizes = [small] * (stages - extra) + [small + 1] * extra
    return tuple(sum(sizes[:s]) for s in range(stages))


def _compute_floor(graph: Graph, sub_mesh: Mesh, cluster: Cluster) -> float:
    """Seconds of the step's arithmetic with every op split over the whole sub-mesh at the
    roofline's math rate: no sub-mesh plan's stage times (plus per-step work) sum to less."""
    total = 0.0
    for op in graph.ops:
        ins, outs = [v.type for v in op.operands], [v.type for v in op.results]
        dtype = (outs or ins)[0].dtype
        flops = op_flops(op.kind, op.rule, ins, outs, op.attrs)
        total += flops / (cluster.peak(dtype) * cluster.compute_efficiency)
    return total / sub_mesh.size


def _most_chunks(graph: Graph, schedule: str, chunks: int | None, stages: int) -> int:
    """The most model chunks per device a plan may use (``_chunk_options``): the chunk count
    asked for, else with interleaving allowed as many as there are layers per stage."""
    if schedule not in ("interleaved", "auto"):
        return 1
    if chunks is not None:
        return chunks
    return max(1, _layers_per_stage(len(_stack(graph)[1]), stages))


def _layers_per_stage(layers: int, stages: int) -> int:
    """The most chunks per device interleaving may use: one layer per chunk at the most."""
    return layers // stages


def _loses(stages: int, m: int, chunks: int, best: float, op_time: float) -> bool:
    """Whether a sub-mesh plan whose ops take at least ``op_time`` seconds (stage times summed,
    ``solver/cap_bound.py``) pipelines no faster than ``best``."""
    return _bubble_bound(op_time, stages, m, chunks) >= best


def _bubble_bound(floor: float, stages: int, m: int, chunks: int = 1) -> float:
    """Lower bound on a pipeline step with at most ``m`` micro-batches: perfectly balanced
    stages, ``(sum/v + (m - 1/v) max) / m >= sum (p + v m - 1) / (p v m)`` with ``v = chunks``
    (interleaved 1F1B; 1 otherwise), no hand-off cost."""
    return floor * (stages + chunks * m - 1) / (stages * chunks * m)


def _batch_caps(sub_mesh: Mesh, batch: int, microbatches: int | None) -> list[int]:
    """Batch-split caps worth a solve: the micro-batch size when ``m`` is given, else every
    group size of the sub-mesh's axes that divides the batch (ascending: deterministic)."""
    if microbatches:
        return [max(1, batch // microbatches)]
    names = [n for n, size in sub_mesh.axes if size > 1]
    sizes = {sub_mesh.group_size(c) for r in range(len(names) + 1)
             for c in itertools.combinations(names, r)}  # fmt: skip
    return sorted(c for c in sizes if batch % c == 0)


def _plan_cap(
    graph, mesh, sub_mesh, axis, stages, limit, schedule, microbatches, time_limit,
    stage_bounds, planner_options, cap, extra=(None, (), ()), micro=True,
) -> tuple[Plan, LayerSplit, StageAssignment]:  # fmt: skip
    """Sub-mesh plan with the batch split at most ``cap``, and its best stages (``extra``:
    interleaving chunks, TP-overlap axes, gathered axes; ``micro``: enumerate by micro-batch
    sizes, ``plan_graph``'s ``micro_sizes``)."""
    from .planner import plan_graph

    chunks, tp_overlap_axes, gathered_axes = extra
    # The sub-mesh solve sees the whole batch through every layer: a stage holds 1/stages of
    # the state and at most `stages` of `m` micro-batches of its layers' activations.
    m_max = microbatches or min(batch_size(graph) // cap, MAX_MICROBATCHES)
    inner = plan_graph(
        graph, sub_mesh, memory_limit=limit * stages, time_limit=time_limit,
        activation_scale=min(1.0, stages / m_max), batch_split_limit=cap, micro_sizes=micro,
        **_seeded(planner_options),
    )  # fmt: skip
    split = attribute_layer_costs(inner, cluster_of(mesh), tp_overlap_axes, gathered_axes)
    if split.costs.num_layers < stages:
        raise PipelineError(
            f"cannot pipeline {split.costs.num_layers} repeated layers over {axis}={stages} "
            "stages; use fewer stages or a model with a layer stack (module paths layers.<i>)"
        )
    option_list = [microbatches] if microbatches else _microbatch_options(inner, m_max)
    link = group_link((axis,), mesh, cluster_of(mesh))
    base, chunk_options = _chunk_options(schedule, chunks, split.costs, stages)
    if stage_bounds is not None:
        best = _fixed_split(
            split.costs, tuple(stage_bounds), option_list, limit, base, link, chunk_options
        )
    else:
        best = assign_stages(
            split.costs, stages, option_list, limit, base, link.p2p_bandwidth, link.latency,
            chunk_options=chunk_options,
        )  # fmt: skip
    if best is None:
        raise InfeasiblePlanError(
            f"no split of {split.costs.num_layers} layers into {stages} stages fits "
            f"{limit / 2**30:.1f} GiB per device with micro-batches {option_list} (batch split "
            f"{cap}); add devices or allow recomputation"
        )
    return inner, split, best


def _seeded(planner_options: dict) -> dict:
    """The sub-mesh solve seeded from its LP: when its memory limit binds, the LP's layouts
    with every layer fully recomputed are the warm start (``plan_graph``'s ``lp_seed``), which
    lets the memory-bound solve use the primal heuristic, the Lagrangian bound and its stop
    within ``memory_solve.MEMORY_GAP``, and skip the overlap-weighted variant once proven within it
    (``planner._plan_space``). Unseeded, each cap of the 405B-shaped row was a full
    memory-bound search; the hand-written strategies (``sp.plan``'s seed without ``pp``) were
    no help: none splits the batch as little as a 1-sample micro-batch allows, and pricing
    them cost 10-48 s per cap (docs/design.md, "Pipelines"). Not when recomputation is fixed
    (a hand-written configuration priced by ``sp.evaluate``).

    Nor CP-SAT's capped search after the seed (``memory_search=False``): on the 405B-shaped
    row it found no plan in either objective variant of the cap it ran on, and building its
    memory rows over 46,869 ops cost about half of each solve; the seed's or the primal
    heuristic's point stands, with its bound (the stage ILP checks every stage's memory
    after)."""
    if planner_options.get("recompute", True) is not True:
        return planner_options
    return {"memory_search": False, **planner_options, "lp_seed": True}


def _chunk_options(
    schedule: str, chunks: int | None, costs: LayerCosts, stages: int
) -> tuple[str, tuple[int, ...]]:
    """(the schedule of one chunk per device, the chunk counts to try: 1 is that schedule,
    ``v > 1`` interleaved). The planner offers interleaving only over alike layers: it prices
    a device's chunks as one contiguous range, which is the same work only when the layers
    between the first (on stage 0 either way; it may also pay the embedding's hand-over) and
    the last (on the last stage either way) cost the same (a plan that recomputes some layers
    and not others keeps 1F1B)."""
    if schedule in ("1f1b", "gpipe"):
        return schedule, (1,)
    if chunks is not None:
        return "1f1b", (chunks,)
    alike = all(len(set(column[1:-1])) <= 1 for column in
                (costs.time, costs.state_bytes, costs.activation_bytes))  # fmt: skip
    many = tuple(range(2, _layers_per_stage(costs.num_layers, stages) + 1)) if alike else ()
    if schedule == "interleaved" and not many:
        raise PipelineError(
            f"interleaved 1F1B needs at least 2 alike layers per stage ({costs.num_layers} "
            f"layers on {stages} stages{'' if alike else ', not all priced alike'}); use "
            "schedule='1f1b' or 'auto', or pass chunks= with stage_bounds"
        )
    return "1f1b", many if schedule == "interleaved" else (1, *many)


def _fixed_split(costs, bounds, options, limit, schedule, link, chunk_options=(1,)):  # type: ignore[no-untyped-def]
    """The best micro-batch and chunk count for a given split (None if it never fits)."""
    best = None
    for m, v in itertools.product(options, chunk_options):
        kind = "interleaved" if v > 1 else schedule
        if v > 1 and m % len(bounds):
            continue
        p2p = link.latency + costs.boundary_bytes / m / link.p2p_bandwidth
        step, times, memory = evaluate_split(costs, bounds, m, kind, p2p, v)
        if max(memory) <= limit and (best is None or step < best.step_time):
            best = StageAssignment(bounds, m, kind, step, times, memory, v)
    return best


def _pipeline_plan(axis: str, split: LayerSplit, best: StageAssignment) -> PipelinePlan:
    ids = split.layer_ids
    chunked = _chunk_layers(best.layer_ranges(split.costs.num_layers), best.chunks)
    specs = tuple(
        StageSpec(s, tuple(sorted(ids[i] for c in chunks for i in c)), split.stack, s == 0,
                  best.stage_times[s], best.stage_memory[s],
                  tuple(tuple(ids[i] for i in c) for c in chunks) if best.chunks > 1 else ())
        for s, chunks in enumerate(chunked)
    )  # fmt: skip
    p, m = best.stages, best.microbatches
    v = best.chunks if best.schedule == "interleaved" else 1
    bubble = (p - 1) / (v * m + p - 1)
    return PipelinePlan(axis, specs, m, best.schedule, best.step_time, bubble, best.chunks)


def _chunk_layers(ranges: list[range], v: int) -> list[list[range]]:
    """Each device's ``v`` chunks, from its layer count: chunk ``c`` of device ``s`` is virtual
    stage ``c p + s``, and virtual stages take consecutive layers in that order (Megatron's
    layout: with equal counts device 0 runs layers 0-3, 32-35, 64-67 for 96 layers, p = 8,
    v = 3). A device's chunks differ by at most one layer, the earlier ones larger."""
    if v == 1:
        return [[r] for r in ranges]
    sizes = [[len(r) // v + (c < len(r) % v) for c in range(v)] for r in ranges]
    chunks: list[list[range]] = [[] for _ in ranges]
    start = 0
    for c in range(v):
        for s, device in enumerate(sizes):
            chunks[s].append(range(start, start + device[c]))
            start += device[c]
    return chunks


def _microbatch_options(plan: Plan, m_max: int) -> list[int]:
    """Micro-batch counts up to ``m_max`` (the cap's own) on whose micro-batches the plan runs
    as it is (``batch.microbatch_fits``: each op's batch split divides the micro-batch; a plan
    that splits the sequence under a batch split ``c`` ways, as HF's flattened ``(b s)``
    tokens need, runs only on micro-batches of ``c`` samples)."""
    batch = batch_size(plan.graph)
    return [
        m for m in range(1, min(batch, m_max) + 1)
        if batch % m == 0 and microbatch_fits(plan, batch // m)
    ]  # fmt: skip


@dataclass
class LayerSplit:
    costs: LayerCosts
    stack: str
    layer_ids: list[int]
    layer_of_op: dict[int, int] = field(default_factory=dict)


def attribute_layer_costs(
    plan: Plan,
    cluster: Cluster,
    tp_overlap_axes: tuple[str, ...] = (),
    gathered_axes: tuple[str, ...] = (),
) -> LayerSplit:
    """Split a solved plan's time and memory into per-layer, before-stack and after-stack parts.

    A recomputed layer (``plan.recompute``) pays its re-run forward ops again and keeps none of
    the values that recomputation frees: in a pipeline those are what each in-flight
    micro-batch would otherwise hold. ``gathered_axes``: as ``plan_pipeline``'s."""
    graph = plan.graph
    stack, layer_ids, layer_of = _stack(graph)
    turn = _turning_point(graph)
    live = liveness(graph) if plan.recompute else None
    times = _op_times(plan, cluster, tp_overlap_axes)
    time, pre, post, step = _time_split(plan, times, layer_of, len(layer_ids), turn)
    freed = _recompute(plan, live, times, layer_of, time)
    state, pre_bytes, post_bytes = _state_split(plan, layer_of, len(layer_ids), gathered_axes)
    act, boundary = _activation_split(plan, layer_of, len(layer_ids), turn, freed)
    costs = LayerCosts(tuple(time), tuple(state), tuple(act), pre, post, pre_bytes, post_bytes,
                       boundary, step)  # fmt: skip
    return LayerSplit(costs, stack, layer_ids, layer_of)


def _recompute(plan: Plan, live, times: list[float], layer_of: dict[int, int], time) -> set:
    """Add each recomputed layer's re-run ops (with the collectives feeding them) to its time;
    return the values its recomputation frees."""
    freed: set[Value] = set()
    base = len(plan.graph.inputs)
    for name, mode in sorted(plan.recompute.items()):
        layer = live.layers.get(name) if live is not None and mode else None
        if layer is None or base + layer.forward_ops[0] not in layer_of:
            continue
        time[layer_of[base + layer.forward_ops[0]]] += sum(
            times[i] for i in layer.recompute_ops[mode]
        )
        freed.update(layer.saved[mode])
    return freed


def _stack(graph: Graph) -> tuple[str, list[int], dict[int, int]]:
    """The longest layer stack: its name, layer indices, and node -> position in the stack."""
    members = _layer_members(graph)
    stacks: dict[str, list[int]] = {}
    for stack, index in members:
        stacks.setdefault(stack, []).append(index)
    if not stacks:
        raise PipelineError(
            "no repeated layers found (module paths like model.layers.<i>): nothing to pipeline"
        )
    stack = max(sorted(stacks), key=lambda s: len(stacks[s]))
    layer_ids = sorted(stacks[stack])
    layer_of = {node: i for i, layer in enumerate(layer_ids) for node in members[(stack, layer)]}
    return stack, layer_ids, layer_of


def _time_split(plan: Plan, times: list[float], layer_of: dict[int, int], n: int, turn: int):
    """Per-layer, before-stack, after-stack and per-step (optimizer outside layers) seconds."""
    graph, base = plan.graph, len(plan.graph.inputs)
    time, pre, post, step = [0.0] * n, 0.0, 0.0, 0.0
    first_layer_op = min((node - base for node in layer_of if node >= base), default=0)
    last_layer_op = max((node - base for node in layer_of if node >= base), default=0)
    for i, op in enumerate(graph.ops):
        layer = layer_of.get(base + i)
        if layer is not None:
            time[layer] += times[i]
        elif op.origin.module == "optimizer":
            step += times[i]
        elif i < first_layer_op or (turn < i and i > last_layer_op):
            pre += times[i]  # embedding forward, and its gradient after the stack's backward
        else:
            post += times[i]
    return time, pre, post, step


def _state_split(plan: Plan, layer_of: dict[int, int], n: int, gathered: tuple[str, ...] = ()):
    """Parameters (+ their gradients) and optimizer state per layer; the rest split pre/post.
    A parameter sharded over ``gathered`` axes also holds its copy gathered over them and an
    fp32 gradient accumulator of that size for the step (``plan_pipeline``)."""
    state, pre, post = [0.0] * n, 0.0, 0.0
    for node, value in enumerate(plan.graph.inputs):
        nbytes = _local(value, plan) * (2 if value.role is Role.PARAMETER else 1)
        if gathered and value.role is Role.PARAMETER:
            nbytes += _held(value, plan, gathered)
        if node in layer_of:
            state[layer_of[node]] += nbytes
        elif value.role in (Role.PARAMETER, Role.OPTIMIZER_STATE):
            pre, post = pre + nbytes / 2, post + nbytes / 2
    return state, pre, post


def _activation_split(plan: Plan, layer_of: dict[int, int], n: int, turn: int, freed: set):
    """Bytes saved for backward per layer (less what recomputation frees), and the largest
    layer-to-layer hand-off."""
    graph, base = plan.graph, len(plan.graph.inputs)
    act, boundary = [0.0] * n, 0.0
    index_of = {op: i for i, op in enumerate(graph.ops)}
    for i, op in enumerate(graph.ops[: turn + 1]):
        here = layer_of.get(base + i)
        for value in op.results:
            users = [index_of[u] for u in value.users]
            if here is not None and value not in freed and any(u > turn for u in users):
                act[here] += _local(value, plan)
            nxt = (here if here is not None else -1) + 1
            if any(layer_of.get(base + u, -2) == nxt for u in users if u <= turn):
                boundary = max(boundary, float(_local(value, plan)))
    return act, boundary


def _turning_point(graph: Graph) -> int:
    """Index of the op producing the loss (the first scalar graph output), else the middle."""
    for value in graph.outputs:
        if value.type.rank == 0 and value.producer is not None:
            return next(i for i, op in enumerate(graph.ops) if op is value.producer)
    return len(graph.ops) // 2


def _held(value: Value, plan: Plan, gathered: tuple[str, ...]) -> float:
    """Bytes of ``value`` gathered over the ``gathered`` axes it is split over, plus an fp32
    gradient of that size (FSDP2 accumulates unsharded gradients in its ``reduce_dtype``)."""
    layout = plan.sharding_of(value.name)
    axes = sorted(set(layout.sharded_axes) & set(gathered))
    if not axes:
        return 0.0
    elements = value.type.numel / layout.shard_count(plan.mesh) * plan.mesh.group_size(axes)
    return elements * (value.type.itemsize + 4)


def _local(value: Value, plan: Plan) -> int:
    return value.type.nbytes // plan.sharding_of(value.name).shard_count(plan.mesh)


def _op_times(plan: Plan, cluster: Cluster, tp_overlap_axes: tuple[str, ...] = ()) -> list[float]:
    """Per op: roofline time under its planned layouts plus the reshards feeding it. The
    roofline is priced once per op signature and layouts (``solver.costs.op_signature``):
    the layers of a stack repeat the same ops at the same layouts (405B-shaped row: 46,869
    ops priced one by one, 7.8 s per batch cap under cProfile; its unprofiled CPU time moved
    within the noise of the loaded box)."""
    from ..passes.enumerate_strategies import Choice

    graph = plan.graph
    fused = fusion(graph)
    times = []
    seen: dict[tuple, float] = {}
    for i, op in enumerate(plan.graph.ops):
        operands = tuple(plan.operand_shardings[(i, j)] for j in range(len(op.operands)))
        results = tuple(plan.sharding_of(v.name) for v in op.results)
        key = (*op_signature(op, fused.of(op)), operands, results)
        if key not in seen:
            strategy = Choice(operands, results, (), _split(op, operands, results, plan))
            seen[key] = op_cost(op, strategy, plan.mesh, cluster, fused.of(op))
        times.append(seen[key])
    by_name = {v.name: v for v in graph.values()}
    index_of = {op: i for i, op in enumerate(graph.ops)}
    incoming = [0.0] * len(graph.ops)
    for r in plan.reshards:
        kind, *rest = r.consumer.split(":")
        if kind == "op":  # the same overlap-aware price the intra-op objective used
            index = int(rest[0])
            value = by_name[r.value]
            moved = _overlapped(r, value, graph.ops[index], times, index_of, tp_overlap_axes,
                                plan.mesh)  # fmt: skip
            incoming[index] += moved * edge_exposure(value, graph.ops[index], graph)
            if (index, int(rest[1])) in fused.edges:  # the reshard breaks a fused chain
                incoming[index] += unfused_penalty(value.type, r.src, r.dst, plan.mesh, cluster)
    return [t + extra for t, extra in zip(times, incoming, strict=True)]


def _overlapped(reshard, value: Value, consumer: Op, times, index_of, axes, mesh) -> float:  # type: ignore[no-untyped-def]
    """Seconds of a reshard left on the critical path by tensor-parallel overlap: one
    all-gather into a GEMM, or one reduce-scatter of a GEMM's result, on ``axes`` runs in
    ``n`` chunks pipelined with that GEMM, ``max(0, c - g) + min(c, g) / n`` (the two-stream
    simulator's ``Transfer.pipelined``); anything else costs its full time."""
    if not axes or len(reshard.collectives) != 1:
        return reshard.time
    (c,) = reshard.collectives
    if not c.axes or not set(c.axes) <= set(axes):
        return reshard.time
    if c.kind == "all-gather" and _is_gemm(consumer):
        gemm = times[index_of[consumer]]
    elif c.kind == "reduce-scatter" and _is_gemm(value.producer):
        gemm = times[index_of[value.producer]]
    else:
        return reshard.time
    t, chunks = reshard.time, mesh.group_size(c.axes)
    return max(0.0, t - gemm) + min(t, gemm) / chunks


def _is_gemm(op: Op | None) -> bool:
    info = op_info(op.kind) if op is not None else None
    return info is not None and info.flops == "dot"


def _split(op: Op, operands, results, plan: Plan) -> int:
    axes = set()
    for s in (*operands, *results):
        axes |= set(s.sharded_axes) | set(s.partial)
    return plan.mesh.group_size(sorted(axes)) if axes else 1


__all__ = ["LayerSplit", "attribute_layer_costs", "plan_pipeline", "uniform_stage_bounds"]
