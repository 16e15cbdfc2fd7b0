"""Argument checks of the public entry points (``sp.plan``, ``sp.evaluate``, ``sp.whatif``, the
CLI), beside them: a bad argument fails at the door with one line naming the argument, what was
given and the fix, instead of a traceback from deep inside. The generic checks (sizes, counts,
names, mesh axes) are ``shardplan.ir.checks``; plan-file I/O is ``shardplan.solver.plan_files``.

Every check raises ``ArgumentError`` (a ``ShardplanError`` and a ``ValueError``). Pure Python:
the frontend a model belongs to is asked through ``shardplan.frontend`` (lazily, no torch / jax).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..ir.checks import (
    DEFAULT_CLUSTER,
    _number,
    check_choice,
    check_count,
    check_model,
    check_seconds,
    check_size,
    did_you_mean,
)
from ..ir.errors import ArgumentError


def frontend_keywords(capture: Callable[..., Any]) -> list[str]:
    """The keyword options a frontend's ``capture(model, *args, **options)`` declares."""
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = list(inspect.signature(capture).parameters.values())[1:]
    return [p.name for p in params if p.kind in kinds]


# -- clusters and meshes ---------------------------------------------------------------------
def check_cluster(name: Any, what: str = "cluster") -> str:
    """A registered cluster name (the message lists the catalogue)."""
    from ..costmodel.cluster import Cluster, UnknownClusterError, known_clusters

    if isinstance(name, Cluster):
        return name.name
    known = known_clusters()
    if not isinstance(name, str) or name not in known:
        hint = did_you_mean(name, known) if isinstance(name, str) else ""
        raise UnknownClusterError(
            f"unknown {what} {name!r};{hint} known clusters: {', '.join(known)} "
            "(or register your own with load_cluster(path))"
        )
    return name


def resolve_cluster(cluster: Any, what: str = "cluster") -> Any:
    """The ``Cluster`` a cluster argument means: a cluster object as given (registered or not),
    a name checked (``check_cluster``) and looked up, once, here at the entry point."""
    from ..costmodel.cluster import Cluster, get_cluster

    if isinstance(cluster, Cluster):
        return cluster
    return get_cluster(check_cluster(cluster, what))


def check_mesh(mesh: Any, cluster: Any = DEFAULT_CLUSTER, *, allow_none: bool = False) -> Any:
    """A ``Mesh`` holding its resolved cluster (``costmodel.cluster.cluster_of`` reads it below
    the entry points); a plain dict ``{"dp": 2}``, or an ``sp.Mesh({...})`` built without
    ``cluster=``, becomes ``Mesh(axes, cluster=cluster)``: every way of writing a mesh without a
    cluster plans on the same one (``DEFAULT_CLUSTER`` unless the call names another)."""
    from ..ir.mesh import Mesh

    if mesh is None and allow_none:
        return None
    if isinstance(mesh, Mapping):
        mesh = Mesh(mesh, cluster=resolve_cluster(cluster))
    if not isinstance(mesh, Mesh):
        raise ArgumentError(
            f"mesh= must be sp.Mesh({{...}}, cluster=...) or a dict like {{'dp': 2}}, "
            f"got {type(mesh).__name__}"
        )
    if not mesh.cluster_given:
        mesh = Mesh(mesh.axes, cluster=resolve_cluster(cluster))
    if mesh.hardware is None:
        mesh = Mesh(mesh.axes, cluster=resolve_cluster(mesh.cluster, "mesh cluster"))
    return mesh


# -- the entry points -------------------------------------------------------------------------
PLAN_KEYWORDS = (
    "mesh", "devices", "cluster", "pipeline_axis", "microbatches", "schedule", "pins", "verbose",
    "mesh_top_k", "memory_limit", "time_limit",
)  # fmt: skip


def check_options(model: Any, options: Mapping[str, Any], where: str, own: Iterable[str]) -> None:
    """Keyword options go to the model's frontend: reject those it does not declare (a Graph
    takes none), with a did-you-mean over them and ``where``'s own keywords. For a torch
    module a keyword its ``forward`` takes is an example input (``input_ids=ids``)."""
    from ..ir.graph import Graph

    if not options:
        return
    inputs: list[str] = []
    if isinstance(model, Graph):
        frontend, known = "an IR Graph", []
    else:
        from ..frontend import capture_function, frontend_kind

        kind = frontend_kind(model)
        frontend = "the torch frontend" if kind == "torch" else "the JAX frontend"
        known = frontend_keywords(capture_function(kind))
        if kind == "torch":
            inputs = _forward_inputs(model, [k for k in options if k not in known])
    for key in options:
        if key not in known and key not in inputs:
            raise ArgumentError(_unexpected(model, key, where, frontend, list(own), known))


def _forward_inputs(model: Any, keys: list[str]) -> list[str]:
    """The ``keys`` a torch module's ``forward`` takes (example keyword inputs)."""
    from ..frontend.torch.inputs import accepts_keyword

    return [k for k in keys if accepts_keyword(model, k)]


def _unexpected(
    model: Any, key: str, where: str, frontend: str, own: list[str], known: list[str]
) -> str:
    from ..frontend import is_torch_module

    params: list[str] = []
    if is_torch_module(model):
        from ..frontend.torch.inputs import forward_signature, named_parameters

        signature = forward_signature(model)
        params = named_parameters(signature) if signature is not None else []
    hint = did_you_mean(key, [*own, *known, *params])
    takes = ", ".join(k + "=" for k in known) or "no extra options"
    inputs = ""
    if params:
        inputs = (
            f"; {type(model).__name__}.forward takes the example inputs "
            f"{', '.join(params)} (by name, positionally, or as one dict)"
        )
    return (
        f"{where} got an unexpected keyword argument {key!r};{hint or ''} "
        f"({frontend} takes {takes}{inputs})"
    )


def check_plan_call(model: Any, args: Mapping[str, Any], options: Mapping[str, Any]) -> dict:
    """``sp.plan``'s arguments checked and normalised (sizes parsed, a dict mesh built)."""
    from ..solver.pipeline import SCHEDULE_CHOICES

    check_model(model, "sp.plan()")
    check_options(model, options, "sp.plan()", PLAN_KEYWORDS)
    out = dict(args)
    out["cluster"] = resolve_cluster(args["cluster"])
    out["mesh"] = check_mesh(args["mesh"], out["cluster"], allow_none=True)
    out["devices"] = check_count(args["devices"], "devices", allow_none=True)
    out["mesh_top_k"] = check_count(args.get("mesh_top_k"), "mesh_top_k", allow_none=True)
    if out["mesh_top_k"] is not None and out["devices"] is None:
        raise ArgumentError("mesh_top_k= ranks the mesh shapes of devices=N; it needs devices=")
    if out["mesh"] is None and out["devices"] is None:
        raise ArgumentError("sp.plan() needs mesh=sp.Mesh({...}) or devices=N (with cluster=...)")
    if not isinstance(args["pipeline_axis"], str):
        raise ArgumentError(f"pipeline_axis={args['pipeline_axis']!r} must be an axis name")
    out["microbatches"] = check_count(args["microbatches"], "microbatches", allow_none=True)
    out["schedule"] = check_choice(args["schedule"], "schedule", SCHEDULE_CHOICES)
    if args["pins"] is not None and not isinstance(args["pins"], Mapping):
        raise ArgumentError(
            f"pins= must map value names to shardings, got {type(args['pins']).__name__}"
        )
    out["memory_limit"] = check_size(args["memory_limit"], "memory_limit")
    out["time_limit"] = check_seconds(args["time_limit"], "time_limit")
    if not isinstance(args.get("verbose", False), bool):
        raise ArgumentError(f"verbose={args['verbose']!r} must be True or False")
    return out


def check_evaluate_call(
    model: Any, mesh: Any, strategy: Any, memory_limit: Any, time_limit: Any, options: Mapping
) -> tuple[Any, float | None, float]:
    """``sp.evaluate``'s arguments: (mesh, memory_limit, time_limit) normalised."""
    from ..solver.strategies import RECOMPUTE, ParallelStrategy

    check_model(model, "sp.evaluate()")
    check_options(model, options, "sp.evaluate()", ("mesh", "strategy", *PLAN_KEYWORDS[-2:]))
    if not isinstance(strategy, ParallelStrategy):
        raise ArgumentError(
            f"strategy= must be one of sp.strategies (dp(), fsdp(), megatron(tp='tp')...), "
            f"got {type(strategy).__name__}"
        )
    check_choice(strategy.recompute, "recompute", RECOMPUTE)
    return (
        check_mesh(mesh),
        check_size(memory_limit, "memory_limit", unbounded=True),  # price it whether it fits or not
        check_seconds(time_limit, "time_limit"),
    )


def check_whatif_call(model: Any, args: Mapping[str, Any], options: Mapping[str, Any]) -> dict:
    """``sp.whatif``'s arguments: parameters by name, factors > 0, repeat >= 1."""
    from .whatif import PARAMETERS

    check_model(model, "sp.whatif()")
    own = ("mesh", "vary", "strategy", "repeat", "time_limit", "plot")
    check_options(model, options, "sp.whatif()", own)
    out = dict(args)
    out["mesh"] = check_mesh(args["mesh"])
    vary = args["vary"]
    if not isinstance(vary, Mapping) or not vary:
        raise ArgumentError(
            "vary= must map a parameter to scale factors, like {'link_bandwidth': [0.5, 1, 2]}"
        )
    for parameter, factors in vary.items():
        check_choice(parameter, "vary parameter", PARAMETERS)
        if isinstance(factors, str) or not isinstance(factors, Iterable):
            raise ArgumentError(f"vary[{parameter!r}] must be a list of factors, got {factors!r}")
        for factor in factors:
            if not _number(factor, f"vary[{parameter!r}] factor", "a factor > 0") > 0:
                raise ArgumentError(f"vary[{parameter!r}] factor {factor!r} must be > 0")
    if args["strategy"] is not None and not isinstance(args["strategy"], Mapping):
        raise ArgumentError("strategy= must map value names to shardings (or be None)")
    out["repeat"] = check_count(args["repeat"], "repeat")
    out["time_limit"] = check_seconds(args["time_limit"], "time_limit")
    return out


__all__ = [
    "DEFAULT_CLUSTER",
    "PLAN_KEYWORDS",
    "check_cluster",
    "check_evaluate_call",
    "check_mesh",
    "check_options",
    "check_plan_call",
    "check_whatif_call",
    "frontend_keywords",
    "resolve_cluster",
]
