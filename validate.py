"""Argument checks for the public entry points (``sp.plan``, ``sp.evaluate``, ``sp.whatif``,
``sp.Mesh``, ``sp.load_plan``, the CLI), so a bad argument fails at the door with one line
naming the argument, what was given and the fix, instead of a traceback from deep inside.

Every check raises ``ArgumentError`` (a ``ShardplanError`` and a ``ValueError``); names are
matched case-sensitively and a near miss gets a "did you mean". Pure Python: no torch / jax.
"""

from __future__ import annotations

import difflib
import inspect
import math
import operator
import os
import re
import tempfile
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from .ir.errors import ArgumentError, ShardingError

DEFAULT_CLUSTER = "h100-sxm"
"""The one default cluster: of ``sp.Mesh({...})`` without ``cluster=``, of a dict ``mesh=``, of
``sp.plan(devices=...)`` and of the CLI. A user who names no cluster most likely plans for real
GPUs; the synthetic ``cpu-test`` cluster is opt-in (``cluster="cpu-test"``)."""

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


# -- names ------------------------------------------------------------------------------------
def did_you_mean(name: str, known: Iterable[str]) -> str:
    """`` did you mean 'x'?`` for a near miss (case differences included), else ``""``."""
    known = list(known)
    folded = [k for k in known if k.lower() == name.lower()]
    close = folded or difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" did you mean {close[0]!r}?" if close else ""


def check_choice(value: Any, name: str, choices: Collection[Any]) -> Any:
    """``value`` must be one of ``choices`` exactly (case-sensitive)."""
    if value in choices and (value is None or isinstance(value, str)):
        return value
    shown = ", ".join(repr(c) for c in choices)
    hint = (
        did_you_mean(value, [c for c in choices if c is not None]) if isinstance(value, str) else ""
    )
    raise ArgumentError(f"{name}={value!r} is not one of {shown};{hint or ' pick one of those'}")


def frontend_keywords(capture: Callable[..., Any]) -> list[str]:
    """The keyword options a frontend's ``capture(model, *args, **options)`` declares."""
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = list(inspect.signature(capture).parameters.values())[1:]
    return [p.name for p in params if p.kind in kinds]


# -- numbers ----------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """Bytes from ``40GB`` (10^9), ``512MiB`` (2^20), ``24e9`` or ``1.5TB``."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ArgumentError(
            f"bad size {text!r}: use a number with an optional unit, like 40GB, 512MiB or 24e9"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def check_size(value: Any, name: str, unbounded: bool = False) -> float | None:
    """Bytes > 0 from a number or a string like ``"40GB"``; ``None`` stays ``None``.
    ``unbounded``: ``math.inf`` is accepted too (no limit)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = parse_size(value)
        except ArgumentError:
            raise ArgumentError(
                f"{name}={value!r} is not a size: use bytes or a unit, like 40e9, '40GB', '512MiB'"
            ) from None
    number = _number(value, name, "bytes, like 40e9 or '40GB'")
    if not number > 0 or (math.isinf(number) and not unbounded):
        raise ArgumentError(f"{name}={value!r} must be a finite size > 0, like 40e9 or '40GB'")
    return number


def check_seconds(value: Any, name: str) -> float:
    """A finite time limit > 0 (``None`` is refused: the solver always needs a limit)."""
    number = _number(value, name, "seconds > 0, like 30")
    if not number > 0 or math.isinf(number):
        raise ArgumentError(f"{name}={value!r} must be a finite number of seconds > 0, like 30")
    return number


def check_count(value: Any, name: str, *, allow_none: bool = False) -> int | None:
    """A whole number >= 1 (``2.5`` is refused, never rounded)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool):
        raise ArgumentError(f"{name}={value!r} must be a whole number >= 1, not a bool")
    try:
        count = operator.index(value)
    except TypeError:
        raise ArgumentError(
            f"{name}={value!r} ({type(value).__name__}) must be a whole number >= 1"
        ) from None
    if count < 1:
        auto = "; leave it out (None) to choose automatically" if allow_none else ""
        raise ArgumentError(f"{name}={count} must be >= 1{auto}")
    return count


def _number(value: Any, name: str, want: str) -> float:
    if isinstance(value, bool) or (not isinstance(value, int | float) and not _is_real(value)):
        raise ArgumentError(f"{name}={value!r} ({type(value).__name__}) must be {want}")
    number = float(value)
    if math.isnan(number):
        raise ArgumentError(f"{name} is NaN; give {want}")
    return number


def _is_real(value: Any) -> bool:
    """numpy scalars and similar: anything ``float()`` accepts that is not text."""
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, str | bytes)


# -- meshes, clusters, models -----------------------------------------------------------------
def mesh_axes(axes: Any) -> tuple[tuple[str, int], ...]:
    """``Mesh``'s axes as checked ``(name, size)`` pairs: identifiers, whole sizes >= 1."""
    if isinstance(axes, Mapping):
        pairs = list(axes.items())
    elif isinstance(axes, Iterable) and not isinstance(axes, str | bytes):
        pairs = list(axes)
    else:
        raise ShardingError(
            f"mesh axes must be a dict of name -> size like {{'dp': 2, 'tp': 4}}, "
            f"got {type(axes).__name__}"
        )
    out = []
    for pair in pairs:
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            raise ShardingError(f"mesh axes must be (name, size) pairs, got {pair!r:.60}")
        name, size = pair
        if not isinstance(name, str) or not name.isidentifier():
            raise ShardingError(f"mesh axis name {name!r} must be an identifier like 'dp'")
        if isinstance(size, bool) or not hasattr(size, "__index__"):
            raise ShardingError(
                f"mesh axis {name!r} has size {size!r} ({type(size).__name__}); "
                f"sizes are whole numbers >= 1, like {{{name!r}: 2}}"
            )
        size = operator.index(size)
        if size < 1:
            raise ShardingError(f"mesh axis {name!r} has size {size}; sizes must be >= 1")
        out.append((name, size))
    names = [name for name, _ in out]
    if len(set(names)) != len(names):
        raise ShardingError(f"mesh axis names must be unique, got {names}")
    return tuple(out)


def check_cluster(name: Any, what: str = "cluster") -> str:
    """A registered cluster name (the message lists the catalogue)."""
    from .costmodel.cluster import Cluster, UnknownClusterError, known_clusters

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


def check_mesh(mesh: Any, cluster: str = DEFAULT_CLUSTER, *, allow_none: bool = False) -> Any:
    """A ``Mesh``; a plain dict ``{"dp": 2}``, or an ``sp.Mesh({...})`` built without
    ``cluster=``, becomes ``Mesh(axes, cluster=cluster)``: every way of writing a mesh without a
    cluster plans on the same one (``DEFAULT_CLUSTER`` unless the call names another)."""
    from .ir.mesh import Mesh

    if mesh is None and allow_none:
        return None
    if isinstance(mesh, Mapping):
        mesh = Mesh(mesh, cluster=check_cluster(cluster))
    if not isinstance(mesh, Mesh):
        raise ArgumentError(
            f"mesh= must be sp.Mesh({{...}}, cluster=...) or a dict like {{'dp': 2}}, "
            f"got {type(mesh).__name__}"
        )
    if not mesh.cluster_given:
        mesh = Mesh(mesh.axes, cluster=check_cluster(cluster))
    check_cluster(mesh.cluster, "mesh cluster")
    return mesh


def check_model(model: Any, where: str) -> None:
    """Catch a class passed where an instance (or a function) belongs."""
    if isinstance(model, type):
        raise ArgumentError(
            f"{where} got the class {model.__name__}, not a model; pass an instance, "
            f"like {model.__name__}(...)"
        )


# -- files --------------------------------------------------------------------------------------
def read_plan_text(path: Any) -> str:
    """A plan file's text, or one line saying why it cannot be read (missing, binary)."""
    if not isinstance(path, str | os.PathLike):
        raise ArgumentError(f"a plan path must be a str or Path, got {type(path).__name__}")
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ArgumentError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ArgumentError(f"{path} is not a plan file (binary, not JSON text)") from None


def check_output_path(path: Any) -> Path:
    """Refuse an output path that cannot be written, before any work is done."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ArgumentError(f"cannot write {path}: it is a directory; give a file name")
    if not parent.is_dir():
        raise ArgumentError(f"cannot write {path}: no directory {parent}; create it first")
    try:  # a real probe: os.access misses read-only mounts, and root passes every mode check
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        raise ArgumentError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path


def atomic_write_text(path: Any, text: str) -> None:
    """Write through a temporary file in the same directory and rename it over ``path``, so a
    failed write (full disk, interrupt) never truncates the previous good file."""
    path = Path(path)
    handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        if path.exists():
            os.chmod(temp, path.stat().st_mode & 0o777)
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(temp, 0o666 & ~umask)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


# -- the entry points -------------------------------------------------------------------------
PLAN_KEYWORDS = (
    "mesh", "devices", "cluster", "pipeline_axis", "microbatches", "schedule", "pins", "verbose",
    "mesh_top_k", "memory_limit", "time_limit",
)  # fmt: skip
RECOMPUTE = (None, "selective", "full")


def check_options(model: Any, options: Mapping[str, Any], where: str, own: Iterable[str]) -> None:
    """Keyword options go to the model's frontend: reject those it does not declare (a Graph
    takes none), with a did-you-mean over them and ``where``'s own keywords. For a torch
    module a keyword its ``forward`` takes is an example input (``input_ids=ids``)."""
    from .ir.graph import Graph

    if not options:
        return
    inputs: list[str] = []
    if isinstance(model, Graph):
        frontend, known = "an IR Graph", []
    else:
        from .api import _is_torch_module

        if _is_torch_module(model):
            from .frontend.torch.capture import capture
        else:
            from .frontend.jax.capture import capture
        frontend = "the torch frontend" if _is_torch_module(model) else "the JAX frontend"
        known = frontend_keywords(capture)
        if _is_torch_module(model):
            inputs = _forward_inputs(model, [k for k in options if k not in known])
    for key in options:
        if key not in known and key not in inputs:
            raise ArgumentError(_unexpected(model, key, where, frontend, list(own), known))


def _forward_inputs(model: Any, keys: list[str]) -> list[str]:
    """The ``keys`` a torch module's ``forward`` takes (example keyword inputs)."""
    from .frontend.torch.inputs import accepts_keyword

    return [k for k in keys if accepts_keyword(model, k)]


def _unexpected(
    model: Any, key: str, where: str, frontend: str, own: list[str], known: list[str]
) -> str:
    from .api import _is_torch_module

    params: list[str] = []
    if _is_torch_module(model):
        from .frontend.torch.inputs import forward_signature, named_parameters

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
    from .solver.pipeline import SCHEDULE_CHOICES

    check_model(model, "sp.plan()")
    check_options(model, options, "sp.plan()", PLAN_KEYWORDS)
    out = dict(args)
    out["cluster"] = check_cluster(args["cluster"])
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
    from .strategies import ParallelStrategy

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
    "ArgumentError",
    "atomic_write_text",
    "check_choice",
    "check_cluster",
    "check_count",
    "check_evaluate_call",
    "check_mesh",
    "check_model",
    "check_options",
    "check_output_path",
    "check_plan_call",
    "check_seconds",
    "check_size",
    "check_whatif_call",
    "did_you_mean",
    "mesh_axes",
    "parse_size",
    "read_plan_text",
]
