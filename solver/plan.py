"""The Plan: a sharding for every value, the collectives on every edge, and what it costs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..costmodel.collectives import Collective
from ..costmodel.memory import MemoryProfile
from ..ir import FrontendError, Graph, Mesh, Role, Sharding
from ..ir.errors import ArgumentError, UnknownTensorError
from ..ir.table_wise import TableOwner
from .idle import IdleDevices

if TYPE_CHECKING:
    from .mesh_search import Candidate

PLAN_FORMAT_VERSION = 2
"""2: the full mesh (pipeline axis included), the pipeline, exposed communication, recomputation,
the memory budget and the mesh-search table. Version 1 files still load (without those).
The idle-devices finding (``idle``) is an optional key of version 2: files without it load."""


@dataclass(frozen=True, slots=True)
class StageSpec:
    """One pipeline stage: the repeated layers one index of the pp axis runs (a contiguous range,
    or with interleaved 1F1B one range per model chunk)."""

    index: int
    layers: tuple[int, ...]
    """Layer indices (of ``stack``) the stage runs."""
    stack: str
    """Module path of the layer stack, e.g. ``model.layers``."""
    first_stage_extras: bool = False
    """Runs what precedes the stack (embedding); the last stage runs what follows (head, loss)."""
    time: float = 0.0
    """Seconds of forward + backward for the whole batch on this stage."""
    memory_bytes: float = 0.0
    """Per-device peak: layer state plus in-flight activations."""
    chunk_layers: tuple[tuple[int, ...], ...] = ()
    """Interleaved 1F1B: the layers of each model chunk this device runs (chunk ``c`` is virtual
    stage ``c * p + index``); empty when the device runs one contiguous chunk."""

    @property
    def first_module(self) -> str:
        return f"{self.stack}.{self.layers[0]}"


@dataclass(frozen=True, slots=True)
class PipelinePlan:
    axis: str
    stages: tuple[StageSpec, ...]
    microbatches: int
    schedule: str
    step_time: float
    bubble_fraction: float
    chunks: int = 1
    """Model chunks per device (virtual stages) when ``schedule`` is ``"interleaved"``."""


@dataclass(frozen=True, slots=True)
class Reshard:
    """Layout change on one edge: producer value -> consumer operand (or graph output / alias)."""

    value: str
    """Name of the value being moved."""
    consumer: str
    """``op:<index>:<operand>`` for an op operand, ``output:<index>`` or ``alias:<index>``."""
    src: Sharding
    dst: Sharding
    collectives: tuple[Collective, ...]
    count: int = 1
    """Times it runs per step: once per iteration for an edge into a scan body's op."""

    @property
    def time(self) -> float:
        """Seconds per step (all ``count`` runs)."""
        return self.count * sum(c.time for c in self.collectives)


@dataclass(frozen=True, slots=True)
class SolverStats:
    status: str
    """``OPTIMAL``, ``FEASIBLE`` (time limit hit), ``TRIVIAL`` (one choice everywhere), or
    ``FALLBACK`` (no solution in time: the best fitting hand-written strategy, see ``fallback``)."""
    objective: float
    """Modelled seconds the solver minimised."""
    bound: float
    """Best proven lower bound (equals objective when optimal)."""
    wall_time: float
    num_variables: int
    num_choices: int
    """Decision points after follower merging and dedup."""
    fallback: str = ""
    """With status ``FALLBACK``: the hand-written strategy returned because the solver found
    no plan in time (``solver/planner.py``); its layouts are that strategy's."""

    @property
    def gap(self) -> float:
        return (
            0.0 if self.objective <= 0 else max(0.0, (self.objective - self.bound) / self.objective)
        )


class FrontendContext(Protocol):
    """What a frontend's capture keeps for its emitters (``TorchContext``, ``JaxContext``):
    the captured steps (aten calls, jaxpr equations) they replay, and the serving step when the
    capture was of one. The plan carries it and never reads, compares or saves it."""

    @property
    def steps(self) -> Sequence[object]: ...

    @property
    def serving(self) -> object | None: ...


class ServingSummary(Protocol):
    """A prefill/decode plan's serving metrics (``serving.ServingReport``), printed first by
    ``print(plan)``."""

    @property
    def mode(self) -> str: ...

    @property
    def batch(self) -> int: ...

    @property
    def tokens_per_second(self) -> float: ...


Emitter = Callable[..., Any]
"""``emitter(plan, *args, **kwargs)``: a plan emitted for a framework (``frontend/``)."""

_EMITTERS: dict[str, Emitter] = {}


def register_emitter(name: str, emitter: Emitter) -> None:
    """Make ``plan.<name>(...)`` call ``emitter(plan, ...)``.

    The frontends register theirs when ``shardplan.frontend`` is imported (``import shardplan``
    does; ``frontend/emitters.py``), as small wrappers that import torch or jax only when
    called: this module imports no frontend. A second registration of a name replaces the
    first (a test's or a research emitter)."""
    if not name.isidentifier():
        raise ArgumentError(f"emitter name {name!r} is not an identifier; name it like a method")
    _EMITTERS[name] = emitter


def emitter(name: str) -> Emitter:
    """The emitter registered as ``name``; a ``FrontendError`` naming the fix when none is."""
    try:
        return _EMITTERS[name]
    except KeyError:
        known = ", ".join(sorted(_EMITTERS)) or "none"
        raise FrontendError(
            f"Plan.{name} has no emitter registered (registered: {known}); the frontends "
            "register theirs when shardplan.frontend is imported: `import shardplan` (or "
            "`import shardplan.frontend`) before emitting, or call the frontend's function "
            f"directly (shardplan.frontend.torch / shardplan.frontend.jax .{name}(plan, ...))"
        ) from None


@dataclass(frozen=True, slots=True, eq=False)
class Plan:
    """The result of ``shardplan.plan``: an immutable value (``dataclasses.replace`` or
    ``with_context`` make a changed copy).

    ``shardings`` maps every value name (graph inputs and op results) to its layout;
    ``operand_shardings[(op_index, operand_index)]`` is what each op consumes (after resharding);
    ``reshards`` lists every edge whose layout changes and the collectives that do it.
    The emitters are the frontends' functions (``shardplan.frontend.torch.apply(plan, model,
    device_mesh)``, ``shardplan.frontend.jax.jit(plan, fn, mesh)``); ``plan.apply``,
    ``plan.jit`` and the others call them through the emitter registry (``register_emitter``).
    Equality is identity (the graph is compared by identity too).
    """

    graph: Graph
    mesh: Mesh
    shardings: dict[str, Sharding]
    operand_shardings: dict[tuple[int, int], Sharding]
    reshards: list[Reshard]
    compute_time: float
    comm_time: float
    peak_memory_bytes: int
    memory: dict[str, int]
    """Per-device bytes by kind: parameters, optimizer_states, inputs, activations..."""
    solver: SolverStats
    output_shardings: list[Sharding] = field(default_factory=list)
    frontend_context: FrontendContext | None = None
    """Framework data for emitters (pytree structure, module FQNs); never serialised."""
    recompute: dict[str, str] = field(default_factory=dict)
    """Layer -> recomputation mode (``selective``/``full``) the plan uses (memory model)."""
    memory_limit: float | None = None
    """Per-device budget the plan was solved under."""
    memory_profile: MemoryProfile | None = None
    """The modelled peak (``costmodel.memory``); never serialised."""
    pipeline: PipelinePlan | None = None
    """Stages and micro-batches when the mesh has a pipeline axis (``solver/pipeline.py``)."""
    exposed_comm_time: float | None = None
    """Communication the two-stream simulator could not hide behind compute (None: all)."""
    candidates: list[Candidate] = field(default_factory=list)
    """Mesh-shape search: every (pp, dp, tp) tried (``solver/mesh_search.py``); saved without
    their wall-clock planning seconds."""
    timings: dict[str, float] = field(default_factory=dict)
    """Wall seconds per planning phase (capture, enumerate, price, shrink, solve...)."""
    serving: ServingSummary | None = None
    """``serving.ServingReport`` of a prefill/decode plan (batch, latency, tokens/s,
    roofline); never serialised."""
    idle: IdleDevices | None = None
    """Devices the free plan leaves repeating the same work, why (modelled), and the
    data-parallel alternative's step (``sp.plan(..., prefer=...)``); None when every device
    does its own share. Saved with the plan (an optional key)."""
    table_owners: tuple[TableOwner, ...] = ()
    """Table-wise embedding tables: where each lives whole (``ir/table_wise.py``; placed and
    priced by ``solver/table_wise.py``), which the SPMD layouts cannot say. Saved with the plan
    (an optional key)."""
    assignments: dict[int, tuple[tuple[str, tuple[str, ...]], ...]] = field(default_factory=dict)
    """Op index -> its chosen choice's factor -> mesh axes pairs (``Choice.assignment``):
    what each op splits, which its layouts alone do not always say (a result's layout is
    what consumers see: pinned or reduced). Read by ``batch.microbatch_fits``; never
    serialised (a loaded plan's is empty and its layouts are read instead)."""

    def with_context(self, context: FrontendContext | None) -> Plan:
        """This plan carrying ``context`` (a capture's, for the emitters)."""
        return dataclasses.replace(self, frontend_context=context)

    def memory_breakdown(self) -> MemoryProfile:
        """The modelled peak: bytes by kind and the largest values live at it (memory model)."""
        if self.memory_profile is not None:
            return self.memory_profile
        return MemoryProfile(self.peak_memory_bytes, 0, dict(self.memory), ())

    @property
    def step_time(self) -> float:
        """Modelled seconds of one step (compute + exposed communication; the pipeline
        schedule's step, bubble included, when the plan has stages)."""
        if self.pipeline is not None:
            return self.pipeline.step_time
        exposed = self.comm_time if self.exposed_comm_time is None else self.exposed_comm_time
        return self.compute_time + exposed

    @property
    def stage_mesh(self) -> Mesh:
        """The mesh one pipeline stage runs on (``mesh`` without the pipeline axis): the
        layouts in ``shardings`` use only its axes. ``mesh`` itself when not pipelined."""
        if self.pipeline is None:
            return self.mesh
        axes = [(n, s) for n, s in self.mesh.axes if n != self.pipeline.axis]
        return self.mesh.with_axes(axes)

    @property
    def stages(self) -> list[StageSpec]:
        """Pipeline stages (one stage covering everything when not pipelined)."""
        return list(self.pipeline.stages) if self.pipeline is not None else []

    def sharding_of(self, name: str) -> Sharding:
        try:
            return self.shardings[name]
        except KeyError:
            raise UnknownTensorError(f"the plan has no value named %{name}") from None

    def collectives(self) -> list[Collective]:
        """Every collective the plan predicts, in graph order."""
        return [c for r in self.reshards for c in r.collectives]

    def input_shardings(self) -> list[Sharding]:
        return [self.shardings[v.name] for v in self.graph.inputs]

    def parameter_shardings(self) -> dict[str, Sharding]:
        """Origin path (FQN / pytree path) -> layout, for parameters and optimizer states."""
        roles = (Role.PARAMETER, Role.OPTIMIZER_STATE)
        return {
            v.origin.path or v.name: self.shardings[v.name]
            for v in self.graph.inputs
            if v.role in roles
        }

    # -- emission: the frontends' functions, through the registry (``register_emitter``) ------
    def apply(self, model: Any, device_mesh: Any) -> Any:
        """The same module with DTensor parameters and boundary redistribution, trained as
        planned (``shardplan.frontend.torch.apply``)."""
        return emitter("apply")(self, model, device_mesh)

    def to_placements(self) -> Any:
        """``{param_fqn: (Shard|Replicate|Partial, ...) per mesh dim}``."""
        return emitter("to_placements")(self)

    def to_parallelize_plan(self) -> Any:
        """``parallelize_module`` styles and ``fully_shard`` calls where the plan is expressible."""
        return emitter("to_parallelize_plan")(self)

    def pipeline_split_spec(self) -> Any:
        """``{"model.layers.8": SplitPoint.BEGINNING, ...}`` for torch.distributed.pipelining."""
        return emitter("pipeline_split_spec")(self)

    def to_torchtitan(self, *args: Any, **kwargs: Any) -> Any:
        """The torchtitan configuration of the plan, priced (``shardplan.to_torchtitan``)."""
        return emitter("to_torchtitan")(self, *args, **kwargs)

    def jit(self, fn: Callable[..., Any] | None = None, jax_mesh: Any = None) -> Any:
        """``jax.jit`` of ``fn`` with planned in/out shardings and internal sharding constraints
        (``shardplan.frontend.jax.jit``). ``fn`` defaults to the planned function, ``jax_mesh``
        to ``make_jax_mesh(plan)`` (the first devices, the plan's axis names, Auto axis types).
        """
        return emitter("jit")(self, fn, jax_mesh)

    def in_shardings(self, jax_mesh: Any = None) -> Any:
        """Pytree of NamedSharding matching the example arguments (default mesh as ``jit``)."""
        return emitter("in_shardings")(self, jax_mesh)

    def out_shardings(self, jax_mesh: Any = None) -> Any:
        """Pytree of NamedSharding matching the function's outputs (default mesh as ``jit``)."""
        return emitter("out_shardings")(self, jax_mesh)

    def to_partition_specs(self) -> Any:
        """Pytree of PartitionSpec for the inputs (for users who build their own jit)."""
        return emitter("to_partition_specs")(self)

    # -- serialisation --------------------------------------------------------------------------
    def to_json(self) -> str:
        from .serialize import plan_to_json

        return plan_to_json(self)

    def save(self, path: str | Path) -> None:
        from .plan_files import atomic_write_text

        atomic_write_text(path, self.to_json())  # a failed write keeps the previous file

    def report(self, full: bool = False) -> str:
        """The one-screen summary ``print(plan)`` shows; ``full=True`` adds every input, the
        heaviest ops, the reshards and a picture of each parameter's layout."""
        from .report import format_plan

        return format_plan(self, full=full)

    def __str__(self) -> str:
        if self.serving is not None:  # a prefill/decode plan: its serving metrics first
            return f"{self.serving}\n{self.report()}"
        return self.report()

    def __repr__(self) -> str:
        """One line (the dataclass default printed the whole graph: megabytes for a model)."""
        from .report import format_bytes

        pipeline = f", {len(self.pipeline.stages)} stages" if self.pipeline else ""
        return (
            f"<Plan {self.graph.name} on {self.mesh}: step {self.step_time * 1e3:.3g} ms, "
            f"peak {format_bytes(self.peak_memory_bytes)}, {len(self.reshards)} reshards"
            f"{pipeline}, {self.solver.status}>"
        )

    def explain(self, name: str):
        """Why the tensor ``name`` (value name or parameter path) has its layout: the chosen
        sharding, the cheapest alternatives with their modelled compute / communication /
        memory difference, and what decided (``solver/explain.py``); ``print`` it."""
        from .explain import explain

        return explain(self, name)

    def to_html(self, path: str | Path | None = None) -> str:
        """The plan as one self-contained HTML page (``solver/html_report.py``): mesh, layout
        map, memory against the budget, the two-stream step timeline, the pipeline schedule,
        every reshard in a sortable table. Written to ``path`` when given; returns the HTML."""
        from .html_report import plan_html, write_html

        if path is not None:
            write_html(self, path)
            return Path(path).read_text(encoding="utf-8")
        return plan_html(self)


def load_plan(path: str | Path) -> Plan:
    from .plan_files import read_plan_text
    from .serialize import plan_from_json

    return plan_from_json(read_plan_text(path))
