"""``shardplan.plan``: the one entry point, for IR graphs, torch modules and JAX callables."""

from __future__ import annotations

import dataclasses
import gc
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ..frontend import capture, capture_function, frontend_kind
from ..ir import FrontendError, Graph, Mesh, Pin, Sharding
from ..ir.errors import ArgumentError, IdleAxisWarning, IdleDevicesWarning
from ..solver import progress
from ..solver.plan import Plan
from .idle_devices import PREFERENCES


def _model_name(model: object) -> str:
    if isinstance(model, Graph):
        return f"graph @{model.name}"
    return getattr(model, "__name__", None) or type(model).__name__


def plan(
    model_or_fn: Any,
    *example_args: Any,
    # where
    mesh: Mesh | None = None,
    devices: int | None = None,
    cluster: str = "h100-sxm",
    mesh_top_k: int | None = None,
    # pipeline
    pipeline_axis: str = "pp",
    microbatches: int | None = None,
    schedule: str = "1f1b",
    # constraints
    pins: Mapping[str, Sharding | Pin] | None = None,
    memory_limit: float | str | None = None,
    # what "best" means
    prefer: str = "step",
    objective: str | None = None,
    max_batch: int | None = None,
    latency_bound: float | None = None,
    # the planner itself
    time_limit: float = 30.0,
    passes: Any = None,
    verbose: bool = False,
    # the frontend's
    **options: Any,
) -> Plan:
    """Plan shardings for a model on ``mesh``.

    Every keyword is optional except where to plan (``mesh`` or ``devices``); they come in
    groups:

    What to plan:
      model_or_fn: an IR ``Graph``, a ``torch.nn.Module`` (training step captured by default),
        or a JAX callable.
      example_args: example inputs; real, meta/fake tensors or ``jax.ShapeDtypeStruct``.
      options: passed to the frontend (``mode="inference"``, ``loss_fn=``, ``optimizer=``,
        ``mode="decode", context_len=4096``, HF keyword inputs ``input_ids=..., labels=...``);
        one the frontend does not take is an ``ArgumentError`` (a Graph takes none).

    Where (the devices):
      mesh: the device mesh and cluster (a plain dict ``{"dp": 2}`` plans on ``cluster``). An
        axis named ``pipeline_axis`` ("pp") is pipelined: stages and micro-batches are chosen
        too.
      devices: instead of a mesh, a device count: every (pp, dp, tp) shape on ``cluster`` is
        planned and the best returned (``plan.candidates`` has the table).
      cluster: the cluster for ``devices`` or a dict ``mesh`` (default h100-sxm).
      mesh_top_k: with ``devices``, plan only the ``k`` mesh shapes the learned predictor
        ranks best (shapes it scores alike share the k-th place; ``solver/predictor.py``;
        needs scikit-learn) instead of every shape.

    Pipeline (a mesh with a ``pipeline_axis``):
      pipeline_axis: the axis that is pipelined ("pp").
      microbatches, schedule: pipeline options (>= 1; "1f1b", "gpipe", "interleaved": 1F1B
        with model chunks per device, their count chosen; "auto": 1F1B or interleaved,
        whichever models fastest).

    Constraints:
      pins: value name or origin path -> required sharding (GSPMD-style user constraints), or
        ``sp.Pin(sharding, priority=N)`` with Shardy's user priority (lower propagates first).
      memory_limit: per-device bytes (a number or ``"40GB"`` / ``"512MiB"``); defaults to the
        cluster's device memory.

    What "best" means:
      prefer: ``"step"`` (default): the fastest modelled step, which on a tiny model may leave
        devices repeating the same work (then ``print(plan)`` says so and an
        ``IdleDevicesWarning`` gives the modelled reason and both step times);
        ``"throughput"``: in that case the data-parallel plan instead (batch split over every
        axis that divides it, parameters replicated or FSDP-sharded as memory needs;
        ``plan.idle`` has both step times; ``api/idle_devices.py``). Checked for a ``mesh=``
        training or inference plan without a pipeline; a searched mesh and serving plans
        are not checked.
      objective, max_batch: for a serving step (``mode="decode"``/``"prefill"``: torch HF
        decoders): ``"latency"`` (default) or ``"throughput"`` (tokens/s per device, the
        batch free in powers of two up to ``max_batch``); ``plan.serving`` reports both
        (``solver/serving.py``).
      latency_bound: for a torch serving step, seconds a step may take (per output token for
        ``mode="decode"``): continuous batching's throughput regime. The batch is the
        largest whose step meets the bound and whose KV cache fits (capped by ``max_batch``
        when given); ``plan.serving.tokens_per_second`` is what it serves. Even batch 1
        over the bound raises ``InfeasiblePlanError`` with the least latency reached.

    The planner itself:
      time_limit: solver budget: about this many seconds of search on one idle core,
        counted in CP-SAT's deterministic time, so the plan does not depend on machine load;
        the wall clock stops the search only at 10x it (docs/design.md, "Deterministic solves").
      passes: the planner's pipeline instead of the default (``shardplan plan
        --print-passes``; docs/architecture.md): a pipeline string, or a list of pass names,
        ``PlannerPass`` objects (a research pass: ``passes/planner_registry.py``) and
        ``PassSpec``s; unknown names list the known passes. Hand-written baselines and the
        idle-devices check keep the default.
      verbose: print progress on stderr (each phase with the seconds since the call began:
        capture, enumerate, price, solve with its bound and gap, simulate). Progress always
        goes to the ``logging`` logger ``"shardplan"`` at INFO (``solver/progress.py``).

    Returns:
      the Plan (``print(plan)`` shows it).
    """
    from .checks import check_plan_call

    given = dict(mesh=mesh, devices=devices, cluster=cluster, pipeline_axis=pipeline_axis,
                 microbatches=microbatches, schedule=schedule, pins=pins, verbose=verbose,
                 memory_limit=memory_limit, time_limit=time_limit,
                 mesh_top_k=mesh_top_k)  # fmt: skip
    checked = check_plan_call(model_or_fn, given, options)
    if passes is not None:  # checked before capture: a bad name fails at once
        from ..passes.planner_registry import normalize_planner_pipeline
        from ..solver import planner  # noqa: F401  (registers the planner's passes)

        checked = {**checked, "passes": normalize_planner_pipeline(passes)}
    if prefer not in PREFERENCES:
        raise ArgumentError(
            f"prefer={prefer!r}: pass 'step' (the fastest modelled step, the default) or "
            "'throughput' (the data-parallel plan when the fastest step leaves devices idle)"
        )
    serving = options.get("mode") in ("prefill", "decode")
    if serving or objective is not None or max_batch is not None or latency_bound is not None:
        from ..solver.serving import check_serving_args

        check_serving_args(objective, max_batch, options.get("mode"), latency_bound)
    limits = (max_batch, latency_bound)
    with progress.planning(verbose), _old_objects_frozen():
        kind = frontend_kind(model_or_fn)
        if serving and kind == "torch":
            result = _plan_serving(model_or_fn, example_args, checked, options, objective, limits)
        elif serving and kind == "jax":
            result = _plan_serving_jax(
                model_or_fn, example_args, checked, options, objective, limits
            )
        else:
            result = _plan(model_or_fn, example_args, checked, options)
            if checked["mesh"] is not None:  # a searched mesh is the planner's own choice
                _warn_idle_axes(result)
                result = _check_idle_devices(result, checked, prefer)
        progress.report(
            "done", "step %s modelled, peak %.1f GiB per device",
            progress.seconds_text(result.step_time), result.peak_memory_bytes / 2**30,
        )  # fmt: skip
        return result


_freezing = False
"""Whether an ``sp.plan`` call froze the objects it found (``_old_objects_frozen``)."""


@contextmanager
def _old_objects_frozen() -> Iterator[None]:
    """Keep the objects that exist before the call, and then the captured graph's, out of the
    garbage collector's full passes while planning (``gc.freeze``; unfrozen after). A full pass
    walks every live object (torch, transformers, their modules: ~400k) and planning triggers a
    few: measured 1.0-2.0 s of a 1-layer HF Llama's plan on (2,2,2) and (2,2,2,2) meshes under
    load (docs/design.md, "Meshes of three and four axes"). Garbage made while planning is still
    collected. Nothing is done when the caller (or an outer ``plan``) froze objects already."""
    global _freezing
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    _freezing = True
    try:
        yield
    finally:
        _freezing = False
        gc.unfreeze()


def _freeze_captured() -> None:
    """Freeze what the capture left (the graph, the frontend's context) when this call froze
    the objects before it: the solver's full passes then walk only what planning makes."""
    if _freezing:
        gc.freeze()


def _plan(
    model_or_fn: Any, example_args: tuple, checked: dict, options: dict, captured: tuple = ()
) -> Plan:
    """``plan`` after its arguments were checked (``checked``: the normalised keywords);
    ``captured``: (graph, context, seconds) of a capture already made (serving plans)."""
    from ..solver.planner import plan_graph

    progress.report("start", "planner loaded (%.1f s)", progress.elapsed())
    pipeline_axis, pins = checked["pipeline_axis"], checked["pins"]
    schedule, microbatches = checked["schedule"], checked["microbatches"]
    mesh, devices, cluster = checked["mesh"], checked["devices"], checked["cluster"]
    memory_limit, time_limit = checked["memory_limit"], checked["time_limit"]
    context: object | None = None
    start = time.perf_counter()
    if captured:
        graph, context, _ = captured
    else:
        pipelined = mesh is not None and dict(mesh.axes).get(pipeline_axis, 1) > 1
        if pipelined and frontend_kind(model_or_fn) == "jax":
            options.setdefault("unroll_scans", True)  # stages split the layers of a scan
        graph, context = capture(model_or_fn, *example_args, **options)
    capture_seconds = captured[2] if captured else time.perf_counter() - start
    _freeze_captured()
    progress.report(
        "capture", "%s -> %d ops, %d inputs (%.1f s)", _model_name(model_or_fn),
        len(graph.ops), len(graph.inputs), capture_seconds,
    )  # fmt: skip
    _report_binding(context)
    annotated = context.user_pins(mesh) if hasattr(context, "user_pins") else {}
    if annotated:  # annotations in the user's code (constraints, DTensor placements); an
        pins = {**annotated, **(pins or {})}  # explicit pin of the same value wins
    semantics = getattr(context, "partial_semantics", None)  # what the target runtime does
    if mesh is None:
        if devices is None:
            raise FrontendError("pass mesh=sp.Mesh({...}) or devices=N (with cluster=...) to plan")
        from ..solver.mesh_search import search_mesh

        # pins are applied per candidate mesh by plan_graph (a pin that names an axis a shape
        # lacks rejects that shape, with the reason in the candidate table)
        result = search_mesh(
            graph, devices, cluster, memory_limit, time_limit, pins=pins, semantics=semantics,
            top_k=checked.get("mesh_top_k"), schedule=schedule, microbatches=microbatches,
            **_passes(checked),
        )  # fmt: skip
    elif pipeline_axis in mesh.axis_names and mesh.axis_size(pipeline_axis) > 1:
        from ..solver.pipeline import plan_pipeline

        result = plan_pipeline(
            graph, mesh, pipeline_axis, memory_limit, schedule, microbatches, time_limit,
            pins=pins, semantics=semantics, **_passes(checked),
        )  # fmt: skip
    else:
        from .evaluate import best_baseline

        def fallback():  # the best fitting hand-written strategy, if CP-SAT finds nothing in time
            return best_baseline(graph, mesh, pins, memory_limit, time_limit, semantics)

        result = plan_graph(
            graph, mesh, pins=pins, memory_limit=memory_limit, time_limit=time_limit,
            semantics=semantics, fallback=fallback, **_passes(checked),
        )  # fmt: skip
    if isinstance(model_or_fn, Graph):
        return result.with_context(context)
    timings = {"capture": capture_seconds, **result.timings}
    return dataclasses.replace(result, frontend_context=context, timings=timings)


def _passes(checked: dict) -> dict:
    """``{"passes": pipeline}`` when ``sp.plan`` was given one (else the default runs)."""
    return {"passes": checked["passes"]} if checked.get("passes") is not None else {}


def _report_binding(context: object) -> None:
    """How a torch model's example inputs bound to its ``forward`` (a progress line)."""
    binding = getattr(context, "input_binding", "")
    if binding:
        progress.report("inputs", "bound by forward's signature: %s", binding)


def _warn_idle_axes(result: Plan) -> None:
    """An ``IdleAxisWarning`` when a mesh axis the user chose cannot split the batch and the
    plan splits nothing over it: silently repeating work on those devices is not what a user
    asking for that mesh expects (``dp=3`` with a batch of 8)."""
    from ..solver.summary import idle_axis_advice

    advice = idle_axis_advice(result)
    if advice:
        warnings.warn(advice, IdleAxisWarning, stacklevel=3)


def _check_idle_devices(result: Plan, checked: dict, prefer: str) -> Plan:
    """The data-parallel plan beside a free plan that leaves devices repeating the same work
    (``idle_devices.py``): recorded in ``plan.idle`` and warned about, or returned when
    ``prefer="throughput"``."""
    from .idle_devices import check_idle_devices

    pins, limit = checked["pins"], checked["memory_limit"]
    result = check_idle_devices(result, pins, limit, prefer, checked["pipeline_axis"])
    idle = result.idle
    if idle is not None and idle.chosen == "step":  # type: ignore[attr-defined]
        warnings.warn(
            f"{idle.summary()}",  # type: ignore[attr-defined]
            IdleDevicesWarning,
            stacklevel=3,
        )
    return result


def _plan_serving(model, example_args, checked, options, objective, limits) -> Plan:  # type: ignore[no-untyped-def]
    """A prefill/decode step planned per candidate batch (``serving.py``); ``limits``:
    ``(max_batch, latency_bound)``."""
    from ..frontend.torch.serving import resized_inputs
    from ..solver.serving import check_cache_fits, plan_serving

    example_args, options = _serving_inputs(example_args, options)
    batch, seq = resized_inputs(example_args, None)[1]
    mesh = checked["mesh"]
    if mesh is None:
        raise FrontendError("a serving plan needs mesh= (the mesh search is for training)")
    context_len = options.get("context_len") or seq

    def plan_at(b: int) -> Plan:
        args = resized_inputs(example_args, b)[0]
        start = time.perf_counter()
        graph, context = capture(model, *args, **options)
        check_cache_fits(graph, mesh, checked["memory_limit"])
        captured = (graph, context, time.perf_counter() - start)
        return _plan(model, args, checked, options, captured)

    max_batch, bound = limits
    mode = options["mode"]
    return plan_serving(plan_at, batch, mode, context_len, seq, objective, max_batch, bound)


def _serving_inputs(example_args: tuple, options: dict) -> tuple[tuple, dict]:
    """A serving step's ``input_ids=`` given by name, as the one dict ``serving.py`` reads."""
    from .checks import frontend_keywords

    known = frontend_keywords(capture_function("torch"))
    named = {k: v for k, v in options.items() if k not in known}
    if not named:
        return example_args, options
    if example_args:
        raise ArgumentError(
            f"mode={options['mode']!r}: give input_ids positionally or by name, not both ways"
        )
    return (named,), {k: v for k, v in options.items() if k in known}


def _plan_serving_jax(fn, example_args, checked, options, objective, limits) -> Plan:  # type: ignore[no-untyped-def]
    """A JAX prefill/decode step (``frontend/jax/serving.py``), planned at its own batch."""
    max_batch, bound = limits
    if bound is not None:
        raise ArgumentError(
            "latency_bound=: a JAX step is planned at the batch of its example arguments; "
            "the batch search under a bound is for torch models (plan each batch's arguments)"
        )
    from ..solver.serving import check_cache_fits, plan_serving

    mesh = checked["mesh"]
    if mesh is None:
        raise FrontendError("a serving plan needs mesh= (the mesh search is for training)")
    start = time.perf_counter()
    graph, context = capture(fn, *example_args, **options)
    step = context.serving
    if max_batch is not None and max_batch != step.batch:
        raise ArgumentError(
            f"max_batch={max_batch}: a JAX step is planned at the batch of its example "
            f"arguments ({step.batch}); plan each batch's arguments to compare them"
        )
    check_cache_fits(graph, mesh, checked["memory_limit"])
    captured = (graph, context, time.perf_counter() - start)

    def plan_at(batch: int) -> Plan:
        return _plan(fn, example_args, checked, options, captured)

    plan = plan_serving(
        plan_at, step.batch, step.mode, step.context_len, step.tokens, objective, None
    )
    reason = f"batch {step.batch} as given (a JAX step is planned at its arguments' batch)"
    return dataclasses.replace(plan, serving=dataclasses.replace(plan.serving, reason=reason))


def annotate(tensor: Any, sharding: Any = None, **placements: Any) -> Any:
    """Pin a torch tensor's layout from inside ``forward``: ``sp.annotate(h, ("dp", None))``.

    A ``Sharding``, a PartitionSpec-like tuple naming planner mesh axes, or
    ``placements=[Shard(0), Replicate()], mesh=device_mesh``. Identity outside a capture; in
    JAX write ``jax.lax.with_sharding_constraint``, which capture reads the same way. See
    ``frontend/torch/annotate.py``.
    """
    from ..frontend.torch.annotate import annotate as torch_annotate

    return torch_annotate(tensor, sharding, **placements)
