"""``plan.to_torchtitan()``: the torchtitan configuration nearest a plan, priced beside it.

torchtitan's vocabulary is five degrees and a fixed per-layer plan: Megatron column/row TP with
sequence parallelism, FSDP2 over ``dp_shard x cp`` (dim 0 of every parameter), HSDP replicas
over ``dp_replicate``, one activation-checkpoint mode for every layer (or every n-th). A plan's
mesh axes are read by what the plan does with them (``axis_roles``): an axis that splits a
projection weight on its Megatron dim is ``tp``, one that splits the token sequence is ``cp``,
the rest split the batch and are ``dp_shard`` when parameters or optimizer states are sharded
over them, else ``dp_replicate``. Whatever the plan does that torchtitan cannot say (an op-level
layout off its TP plan, ZeRO-1 without FSDP, recomputation of some layers only) is listed in
``differences``, and the configuration is priced with ``sp.evaluate`` on the plan's own graph
(no new capture) so the report gives both modelled steps.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

from ..costmodel.cluster import cluster_of
from ..ir import Role
from ..ir.axes import base_axis
from ..solver.plan import Plan
from ..solver.strategies import ParallelStrategy, tensor_parallel_dim
from ..solver.titan_config import TitanConfig, TitanConfigError

SCHEDULE_NAMES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "Interleaved1F1B"}
TOLERANCE = 0.05
"""Modelled-step gap to the plan under which the emitted configuration counts as the plan's."""


@dataclass
class TitanEmission:
    """A plan's torchtitan configuration, what differs, and both modelled steps."""

    config: TitanConfig
    plan_step: float
    titan_step: float | None
    titan_fits: bool
    differences: list[str] = field(default_factory=list)

    @property
    def overrides(self) -> list[str]:
        return self.config.overrides()

    def to_dict(self) -> dict[str, dict[str, object]]:
        return self.config.to_dict()

    @property
    def gap(self) -> float:
        """(torchtitan's modelled step - the plan's) / the plan's."""
        if self.titan_step is None or self.plan_step <= 0:
            return 0.0
        return self.titan_step / self.plan_step - 1

    def report(self) -> str:
        lines = [f"torchtitan     {self.config.label()} ({self.config.world_size} devices)"]
        if self.titan_step is not None:
            fit = "" if self.titan_fits else ", does NOT fit the memory limit"
            lines.append(
                f"modelled step  plan {self.plan_step * 1e3:.1f} ms, torchtitan "
                f"{self.titan_step * 1e3:.1f} ms ({self.gap:+.1%}{fit})"
            )
        if abs(self.gap) > TOLERANCE and not self.differences:
            self.differences.append("layouts inside the layers differ from torchtitan's plan")
        for text in self.differences or ["nothing: the plan is torchtitan's configuration"]:
            lines.append(f"differs        {text}")
        lines.append("overrides      " + " ".join(self.overrides))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()


def axis_roles(plan: Plan) -> dict[str, str]:
    """Mesh axis -> ``tp`` / ``cp`` / ``dp_shard`` / ``dp_replicate`` (module docstring)."""
    mesh = plan.stage_mesh
    tp, cp, sharded = set(), set(), set()
    states = {v.name for v in plan.graph.inputs if v.role is Role.OPTIMIZER_STATE}
    for v in plan.graph.inputs:
        layout = plan.shardings.get(v.name)
        if layout is None:
            continue
        if v.role is Role.PARAMETER:
            dim = tensor_parallel_dim(v)
            if dim is not None and v.type.rank == 2:
                tp.update(base_axis(a) for a in layout.dims[dim])
        if v.role is Role.PARAMETER or v.name in states:
            sharded.update(base_axis(a) for d in layout.dims for a in d)
        if v.role is Role.INPUT and v.type.rank == 2 and v.type.dtype.startswith("i"):
            cp.update(base_axis(a) for a in layout.dims[1])
    roles = {}
    for axis in mesh.axis_names:
        if mesh.axis_size(axis) == 1:
            continue
        if axis in cp:
            roles[axis] = "cp"
        elif axis in tp and _tp_only(plan, axis):
            roles[axis] = "tp"
        else:
            roles[axis] = "dp_shard" if axis in sharded else "dp_replicate"
    return roles


def _tp_only(plan: Plan, axis: str) -> bool:
    """The axis splits no batch dim of the token input (else the plan uses it as data)."""
    for v in plan.graph.inputs:
        if v.role is Role.INPUT and v.type.rank == 2:
            layout = plan.shardings.get(v.name)
            if layout is not None and axis in layout.dims[0]:
                return False
    return True


def nearest_config(plan: Plan, flavor: str | None = None) -> tuple[TitanConfig, list[str]]:
    """The torchtitan configuration of ``plan`` and what it cannot express (module docstring)."""
    mesh = plan.stage_mesh
    roles = axis_roles(plan)
    degrees = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1}
    for axis, role in roles.items():
        degrees[role] *= mesh.axis_size(axis)
    differences = []
    if (
        degrees["dp_replicate"] > 1
        and degrees["dp_shard"] * degrees["cp"] == 1
        and (degrees["tp"] > 1 or plan.pipeline is not None)
    ):
        differences.append("replicated data parallel with tp/pp: torchtitan's DDP is 1-D, "
                           "emitted as FSDP over those axes")  # fmt: skip
        degrees["dp_shard"], degrees["dp_replicate"] = degrees["dp_replicate"], 1
    tokens = next(v for v in plan.graph.inputs if v.role is Role.INPUT and v.type.rank == 2)
    batch, seq = tokens.type.shape
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    mode, option, ac_notes = _ac_mode(plan)
    differences += ac_notes + _zero1_note(plan, roles)
    pp, schedule, micro = _pipeline(plan, batch // dp, differences)
    dtype = "bfloat16" if tokens is not None and _param_dtype(plan) == "bf16" else "float32"
    config = TitanConfig(
        **degrees, pp=pp, local_batch_size=batch // dp, seq_len=seq, ac_mode=mode,
        selective_ac_option=option, pipeline_schedule=schedule, microbatch_size=micro,
        mixed_precision_param=dtype, flavor=flavor,
    )  # fmt: skip
    return config, differences


def _param_dtype(plan: Plan) -> str:
    params = [v for v in plan.graph.inputs if v.role is Role.PARAMETER]
    return params[0].type.dtype if params else "f32"


def _ac_mode(plan: Plan) -> tuple[str, str, list[str]]:
    """One mode for every layer: the plan's when they agree, else the commonest one (noted)."""
    from ..passes.liveness import liveness

    layers = list(liveness(plan.graph).layers)
    modes = Counter(plan.recompute.get(name) or "none" for name in layers)
    if not modes:
        return "none", "op", []
    mode, count = modes.most_common(1)[0]
    notes = []
    if count != len(layers):
        text = ", ".join(f"{m} on {n} layers" for m, n in sorted(modes.items()))
        notes.append(f"recomputation per layer ({text}): torchtitan takes one mode, {mode}")
    return mode, "op", notes


def _zero1_note(plan: Plan, roles: dict[str, str]) -> list[str]:
    """ZeRO-1/2: most parameter bytes stored whole over the ``dp_shard`` axes (which shard
    their optimizer states), weighed by bytes so that one sharded table does not hide it."""
    shard_axes = {a for a, r in roles.items() if r == "dp_shard"}
    whole = total = 0
    for v in plan.graph.inputs:
        if v.role is Role.PARAMETER and v.name in plan.shardings:
            axes = {base_axis(a) for d in plan.shardings[v.name].dims for a in d}
            total += v.type.nbytes
            whole += v.type.nbytes if shard_axes and not axes & shard_axes else 0
    if not total or whole * 2 <= total:
        return []
    return [f"optimizer states sharded over {sorted(shard_axes)} with {whole / total:.0%} of "
            "the parameter bytes replicated (ZeRO-1/2): torchtitan shards both "
            "(FSDP2)"]  # fmt: skip


def _pipeline(plan: Plan, local_batch: int, differences: list[str]) -> tuple[int, str, int]:
    pipe = plan.pipeline
    if pipe is None:
        return 1, "1F1B", 1
    schedule = SCHEDULE_NAMES.get(pipe.schedule, "1F1B")
    if pipe.schedule == "interleaved" and pipe.chunks != 2:
        differences.append(
            f"interleaved with {pipe.chunks} chunks per device: torchtitan's default is 2 "
            "(pipeline_parallel_layers_per_stage sets others)"
        )
    micro = max(1, local_batch // pipe.microbatches)
    sizes = {len(s.layers) for s in pipe.stages}
    if len(sizes) > 1:
        differences.append("unequal stages: torchtitan splits layers evenly")
    return len(pipe.stages), schedule, micro


def _layout_differences(plan: Plan, config: TitanConfig) -> list[str]:
    """Parameters the plan stores over other axes than torchtitan's plan would (compared dim
    by dim in torchtitan's axis names: each plan axis renamed to its role)."""
    roles = axis_roles(plan)
    pins = config.strategy().pins(plan.graph, config.mesh(cluster_of(plan.mesh)))
    differ = []
    params = [v for v in plan.graph.inputs if v.role is Role.PARAMETER]
    for v in params:
        if v.name not in plan.shardings or v.name not in pins:
            continue
        ours = [
            {roles[base_axis(a)] for a in d if base_axis(a) in roles}
            for d in plan.shardings[v.name].dims
        ]
        theirs = [set(d) for d in pins[v.name].dims]
        if ours != theirs:
            differ.append(v.origin.path or v.name)
    if not differ:
        return []
    shown = ", ".join(differ[:3]) + (", ..." if len(differ) > 3 else "")
    return [f"{len(differ)} of {len(params)} parameters are stored split otherwise than "
            f"torchtitan's TP/FSDP plan splits them ({shown})"]  # fmt: skip


def to_torchtitan(
    plan: Plan, flavor: str | None = None, price: bool = True, time_limit: float = 30.0
) -> TitanEmission:
    """The torchtitan configuration of ``plan`` (``plan.to_torchtitan()``), priced with
    ``sp.evaluate`` on the plan's graph unless ``price=False``."""
    from .evaluate import evaluate

    config, differences = nearest_config(plan, flavor)
    differences += _layout_differences(plan, config)
    emission = TitanEmission(config, plan.step_time, None, True, differences)
    if price:
        evaluation = evaluate(
            plan.graph, mesh=config.mesh(cluster_of(plan.mesh)), strategy=config.strategy(),
            time_limit=time_limit,
        )  # fmt: skip
        emission.titan_step = evaluation.step_time
        emission.titan_fits = evaluation.fits
        if abs(emission.gap) > TOLERANCE and any("recomputation" in d for d in differences):
            emission.differences.append(_recompute_share(plan, config, time_limit))
    return emission


def _recompute_share(plan: Plan, config: TitanConfig, time_limit: float) -> str:
    """How much of the gap the per-layer recomputation explains: torchtitan's degrees priced
    again with the plan's own recompute decisions (which torchtitan cannot express)."""
    from .evaluate import evaluate

    strategy = _PlanRecompute(**_fields(config.strategy()), decisions=dict(plan.recompute))
    mesh = config.mesh(cluster_of(plan.mesh))
    step = evaluate(plan.graph, mesh=mesh, strategy=strategy, time_limit=time_limit).step_time
    gap = step / plan.step_time - 1
    rest = (
        "so the per-layer recomputation is the gap"
        if abs(gap) <= TOLERANCE / 5
        else "the rest of the gap is the plan's op-level layouts inside the layers"
    )
    return (f"with the plan's per-layer recomputation torchtitan's degrees model "
            f"{step * 1e3:.1f} ms ({gap:+.1%}): {rest}")  # fmt: skip


def _fields(strategy: ParallelStrategy) -> dict:
    return {f.name: getattr(strategy, f.name) for f in dataclasses.fields(strategy)}


@dataclass(frozen=True)
class _PlanRecompute(ParallelStrategy):
    """A strategy whose layers recompute as a plan chose, layer by layer."""

    decisions: dict = field(default_factory=dict)

    def recompute_decisions(self, graph):  # type: ignore[no-untyped-def]
        return {k: (None if v in (None, "none") else v) for k, v in self.decisions.items()}


def evaluate_torchtitan(
    graph: object,
    config: TitanConfig | list[str] | str,
    cluster: str = "h100-sxm",
    memory_limit: float | None = None,
    time_limit: float = 30.0,
):  # type: ignore[no-untyped-def]
    """Price a torchtitan configuration (a ``TitanConfig`` or its override list) on a captured
    step with ``sp.evaluate``: "what will these flags cost". The graph's batch must be the
    configuration's global batch (``local_batch_size`` x dp_replicate x dp_shard)."""
    from ..ir import Graph, Role
    from .evaluate import evaluate

    if not isinstance(config, TitanConfig):
        config = TitanConfig.from_overrides(config)
    if isinstance(graph, Graph):
        tokens = [v for v in graph.inputs if v.role is Role.INPUT and v.type.rank == 2]
        if tokens and tokens[0].type.shape != (config.global_batch_size, config.seq_len):
            raise TitanConfigError(
                f"the graph's tokens are {list(tokens[0].type.shape)} but the configuration "
                f"runs a global batch of {config.global_batch_size} x {config.seq_len} "
                f"(local_batch_size {config.local_batch_size} x {config.data_parallel} data-"
                "parallel ranks); capture the step at that batch or change local_batch_size"
            )
    return evaluate(
        graph, mesh=config.mesh(cluster), strategy=config.strategy(),
        memory_limit=memory_limit, time_limit=time_limit,
    )  # fmt: skip
