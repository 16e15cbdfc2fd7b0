"""Versioned, deterministic JSON for plans: the same plan always gives the same bytes.

The graph travels as its text form (``ir.printer``), everything else as plain JSON. Wall-clock
solve time is left out on purpose (it would break byte identity); loading never unpickles and
rejects a file of the wrong format or version with a ShardplanError that says what to do.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from shardplan.costmodel.collectives import Collective
from shardplan.ir import Graph, Mesh, Sharding, ShardplanError
from shardplan.ir.errors import PlanFileError

from .plan import PLAN_FORMAT_VERSION, PipelinePlan, Plan, Reshard, SolverStats, StageSpec

PLAN_FORMAT = "shardplan-plan"


# -- writing ------------------------------------------------------------------------------------
def plan_to_json(plan: Plan) -> str:
    """The plan as JSON text: sorted keys, ``repr`` floats, a trailing newline."""
    from shardplan.ir.printer import print_graph

    document = {
        "format": PLAN_FORMAT,
        "version": PLAN_FORMAT_VERSION,
        "mesh": {
            "axes": [[name, size] for name, size in plan.mesh.axes],
            "cluster": plan.mesh.cluster,
        },
        "graph": print_graph(plan.graph).splitlines(),
        "shardings": {name: _sharding(s) for name, s in plan.shardings.items()},
        "operand_shardings": [
            [op, operand, _sharding(s)]
            for (op, operand), s in sorted(plan.operand_shardings.items())
        ],
        "output_shardings": [_sharding(s) for s in plan.output_shardings],
        "reshards": [_reshard(r) for r in plan.reshards],
        "costs": _costs(plan),
        "peak_memory_bytes": int(plan.peak_memory_bytes),
        "memory": {kind: int(n) for kind, n in plan.memory.items()},
        "solver": _solver(plan.solver),
        "pipeline": _pipeline(plan.pipeline) if plan.pipeline is not None else None,
        "recompute": {layer: mode for layer, mode in sorted(plan.recompute.items())},
        "memory_limit": None if plan.memory_limit is None else _float(plan.memory_limit),
        "candidates": [_candidate(c) for c in plan.candidates],
    }
    if plan.idle is not None:  # optional: files without it load with ``idle`` None
        document["idle"] = _idle(plan.idle)
    if plan.table_owners:  # optional: files without it have no table-wise tables
        document["table_owners"] = [
            {"table": o.table, "module": o.module, "axes": list(o.axes), "owner": o.owner}
            for o in plan.table_owners
        ]
    return _dump(document) + "\n"


def _idle(idle: Any) -> dict[str, Any]:
    """``solver.idle.IdleDevices``: what the free plan leaves idle, and why (modelled)."""

    def steps(t: Any) -> dict[str, Any]:
        return {"step": _float(t.step), "compute": _float(t.compute), "exposed": _float(t.exposed)}

    return {
        "axes": list(idle.axes), "repeats": idle.repeats, "work": _float(idle.work),
        "whole": idle.whole, "split_axes": list(idle.split_axes), "strategy": idle.strategy,
        "free": steps(idle.free), "split": steps(idle.split),
        "kernel_floor": _float(idle.kernel_floor), "chosen": idle.chosen,
    }  # fmt: skip


def _costs(plan: Plan) -> dict[str, Any]:
    """Compute, communication and (when simulated) the exposed part: what ``step_time`` sums."""
    costs: dict[str, Any] = {
        "compute_time": _float(plan.compute_time),
        "comm_time": _float(plan.comm_time),
    }
    if plan.exposed_comm_time is not None:
        costs["exposed_comm_time"] = _float(plan.exposed_comm_time)
    return costs


def _pipeline(p: PipelinePlan) -> dict[str, Any]:
    return {
        "axis": p.axis,
        "microbatches": p.microbatches,
        "schedule": p.schedule,
        "step_time": _float(p.step_time),
        "bubble_fraction": _float(p.bubble_fraction),
        **({"chunks": p.chunks} if p.chunks != 1 else {}),
        "stages": [
            {
                "index": s.index,
                "layers": list(s.layers),
                "stack": s.stack,
                "first_stage_extras": s.first_stage_extras,
                "time": _float(s.time),
                "memory_bytes": _float(s.memory_bytes),
                **({"chunk_layers": [list(c) for c in s.chunk_layers]} if s.chunk_layers else {}),
            }
            for s in p.stages
        ],
    }


def _candidate(c: Any) -> dict[str, Any]:
    """One mesh-search row; its wall-clock planning seconds are left out (byte identity)."""
    return {
        "mesh": dict(c.mesh),
        "step_time": None if c.step_time is None else _float(c.step_time),
        "peak_memory_bytes": None if c.peak_memory_bytes is None else _float(c.peak_memory_bytes),
        "rejected": c.rejected,
    }


def _dump(document: dict[str, Any]) -> str:
    """Sorted keys; one line per top-level entry and per item of a top-level list or object.

    Deeper structure stays on one line, so a plan reads as a table (one value, reshard or graph
    line per row) instead of a tower of brackets, and stays byte-for-byte reproducible.
    """

    def flat(value: object) -> str:
        return json.dumps(value, sort_keys=True, allow_nan=False)

    lines = []
    for key in sorted(document):
        value = document[key]
        if isinstance(value, dict) and value:
            items = [f"  {flat(k)}: {flat(value[k])}" for k in sorted(value)]
            text = "{\n" + ",\n".join(items) + "\n }"
        elif isinstance(value, list) and value:
            text = "[\n" + ",\n".join(f"  {flat(item)}" for item in value) + "\n ]"
        else:
            text = flat(value)
        lines.append(f" {flat(key)}: {text}")
    return "{\n" + ",\n".join(lines) + "\n}"


def _float(x: float) -> float | str:
    """JSON has no inf/nan; they are written as strings and read back by ``float``."""
    x = float(x)
    return x if math.isfinite(x) else repr(x)


def _sharding(s: Sharding) -> dict[str, Any]:
    out: dict[str, Any] = {"dims": [list(axes) for axes in s.dims]}
    if s.partial:
        out["partial"] = sorted(s.partial)
    return out


def _collective(c: Collective) -> dict[str, Any]:
    return {"kind": c.kind, "axes": list(c.axes), "bytes": int(c.bytes), "time": _float(c.time)}


def _reshard(r: Reshard) -> dict[str, Any]:
    return {
        "value": r.value,
        "consumer": r.consumer,
        "src": _sharding(r.src),
        "dst": _sharding(r.dst),
        "collectives": [_collective(c) for c in r.collectives],
        **({"count": r.count} if r.count != 1 else {}),
    }


def _solver(s: SolverStats) -> dict[str, Any]:
    return {
        "status": s.status,
        "objective": _float(s.objective),
        "bound": _float(s.bound),
        "num_variables": int(s.num_variables),
        "num_choices": int(s.num_choices),
        **({"fallback": s.fallback} if s.fallback else {}),
    }


# -- reading ------------------------------------------------------------------------------------
class _Reader:
    """Typed access to one JSON object; every failure names the key path and the file kind."""

    def __init__(self, data: object, where: str) -> None:
        if not isinstance(data, Mapping):
            raise _bad(where, f"expected an object, got {type(data).__name__}")
        self.data, self.where = data, where

    def get(self, key: str, kind: type | tuple[type, ...], default: object = ...) -> Any:
        if key not in self.data:
            if default is not ...:
                return default
            raise _bad(self.where, f"missing key {key!r}")
        value = self.data[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise _bad(f"{self.where}.{key}", f"expected {_kind_name(kind)}, got {value!r:.60}")
        return value

    def number(self, key: str) -> float:
        value = self.get(key, (int, float, str))
        try:
            return float(value)
        except ValueError:
            raise _bad(f"{self.where}.{key}", f"expected a number, got {value!r:.60}") from None


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {dict: "an object", list: "a list", str: "a string", int: "an integer"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _bad(where: str, what: str) -> PlanFileError:
    return PlanFileError(
        f"invalid plan file: {where}: {what}; the file is damaged or was not written by "
        "Plan.save (re-create it with `shardplan plan ... --out plan.json`)"
    )


def plan_from_json(data: Mapping[str, Any] | str) -> Plan:
    """Rebuild a Plan from ``json.loads`` output (or the JSON text), validating as it goes."""
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as exc:
            raise _bad("<file>", f"not JSON ({exc})") from None
    top = _Reader(data, "<plan>")
    _check_header(top)
    mesh = _read_mesh(_Reader(top.get("mesh", dict), "mesh"))
    graph = _read_graph(top.get("graph", (list, str)))
    shardings = {
        name: _read_sharding(s, f"shardings.{name}")
        for name, s in top.get("shardings", dict).items()
    }
    _check_shardings(graph, mesh, shardings)
    costs = _Reader(top.get("costs", dict), "costs")
    pipeline = top.get("pipeline", (dict, type(None)), None)
    memory_limit = top.get("memory_limit", (int, float, str, type(None)), None)
    return Plan(
        graph=graph,
        mesh=mesh,
        shardings=shardings,
        operand_shardings=_read_operand_shardings(top.get("operand_shardings", list)),
        reshards=[
            _read_reshard(r, f"reshards[{i}]") for i, r in enumerate(top.get("reshards", list))
        ],
        compute_time=costs.number("compute_time"),
        comm_time=costs.number("comm_time"),
        peak_memory_bytes=top.get("peak_memory_bytes", int),
        memory=_read_memory(_Reader(top.get("memory", dict), "memory")),
        solver=_read_solver(_Reader(top.get("solver", dict), "solver")),
        output_shardings=[
            _read_sharding(s, f"output_shardings[{i}]")
            for i, s in enumerate(top.get("output_shardings", list, []))
        ],
        recompute=_read_recompute(_Reader(top.get("recompute", dict, {}), "recompute")),
        memory_limit=None if memory_limit is None else top.number("memory_limit"),
        pipeline=_read_pipeline(_Reader(pipeline, "pipeline"), mesh) if pipeline else None,
        exposed_comm_time=(
            costs.number("exposed_comm_time") if "exposed_comm_time" in costs.data else None
        ),
        candidates=[
            _read_candidate(_Reader(c, f"candidates[{i}]"))
            for i, c in enumerate(top.get("candidates", list, []))
        ],
        idle=_read_idle(_Reader(top.data["idle"], "idle")) if "idle" in top.data else None,
        table_owners=_read_owners(top.get("table_owners", list, []), graph, mesh),
    )


def _read_owners(rows: list, graph: Graph, mesh: Mesh) -> tuple:
    """``table_owners``: each a table input of the graph, placed along the mesh's axes."""
    from shardplan.ir.table_wise import TableOwner

    names = {v.name for v in graph.inputs}
    owners = []
    for i, row in enumerate(rows):
        r = _Reader(row, f"table_owners[{i}]")
        axes = r.get("axes", list)
        if not all(isinstance(a, str) for a in axes) or r.get("table", str) not in names:
            raise _bad(r.where, "needs a graph input's name as table and mesh axis names as axes")
        try:
            owner = TableOwner(r.get("table", str), r.get("module", str), tuple(axes),
                               r.get("owner", int))  # fmt: skip
            owner.check(mesh)
        except ShardplanError as exc:
            raise _bad(r.where, str(exc)) from None
        owners.append(owner)
    return tuple(owners)


def _read_idle(r: _Reader):
    from .idle import IdleDevices, StepTimes

    def names(key: str) -> tuple[str, ...]:
        values = r.get(key, list)
        if not all(isinstance(v, str) for v in values):
            raise _bad(f"{r.where}.{key}", f"expected mesh axis names, got {values!r:.60}")
        return tuple(values)

    def steps(key: str) -> StepTimes:
        t = _Reader(r.get(key, dict), f"{r.where}.{key}")
        return StepTimes(t.number("step"), t.number("compute"), t.number("exposed"))

    return IdleDevices(
        axes=names("axes"), repeats=r.get("repeats", int), work=r.number("work"),
        whole=r.get("whole", bool), split_axes=names("split_axes"),
        strategy=r.get("strategy", str), free=steps("free"), split=steps("split"),
        kernel_floor=r.number("kernel_floor"), chosen=r.get("chosen", str),
    )  # fmt: skip


def _check_header(top: _Reader) -> None:
    fmt = top.data.get("format")
    if fmt != PLAN_FORMAT:
        raise PlanFileError(
            f"not a shardplan plan: format is {fmt!r}, expected {PLAN_FORMAT!r} "
            "(plans are written by Plan.save or `shardplan plan --out`)"
        )
    version = top.get("version", int)
    if version > PLAN_FORMAT_VERSION:
        raise PlanFileError(
            f"plan format version {version} is newer than this shardplan reads "
            f"(version {PLAN_FORMAT_VERSION}); upgrade shardplan to load it"
        )
    if version < 1:
        raise _bad("version", f"unknown version {version}")


def _read_mesh(r: _Reader) -> Mesh:
    axes = []
    for i, pair in enumerate(r.get("axes", list)):
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], int)):
            raise _bad(f"mesh.axes[{i}]", f"expected [name, size], got {pair!r:.60}")
        axes.append((pair[0], pair[1]))
    try:
        return Mesh(axes, cluster=r.get("cluster", str))
    except ShardplanError as exc:
        raise _bad("mesh", str(exc)) from None


def _read_graph(lines: list | str) -> Graph:
    if isinstance(lines, list) and not all(isinstance(line, str) for line in lines):
        raise _bad("graph", "expected the graph's text form as a list of lines")
    text = lines if isinstance(lines, str) else "\n".join(lines) + "\n"
    try:
        from shardplan.ir.parser import parse_graph
    except ImportError:  # pragma: no cover - only while the parser is being written
        raise PlanFileError("this shardplan build cannot parse graph text (no ir.parser)") from None
    try:
        return parse_graph(text)
    except ShardplanError as exc:
        raise _bad("graph", f"the graph text does not parse:\n{exc}") from None


def _read_sharding(data: object, where: str) -> Sharding:
    r = _Reader(data, where)
    dims = r.get("dims", list)
    partial = r.get("partial", list, [])
    if not all(isinstance(d, list) and all(isinstance(a, str) for a in d) for d in dims):
        raise _bad(f"{where}.dims", f"expected lists of axis names, got {dims!r:.60}")
    if not all(isinstance(a, str) for a in partial):
        raise _bad(f"{where}.partial", f"expected axis names, got {partial!r:.60}")
    try:
        return Sharding(tuple(tuple(d) for d in dims), frozenset(partial))
    except ShardplanError as exc:
        raise _bad(where, str(exc)) from None


def _check_shardings(graph: Graph, mesh: Mesh, shardings: dict[str, Sharding]) -> None:
    """Every sharding must name a value of the graph and fit its type on the mesh."""
    types = {v.name: v.type for v in graph.values()}
    for name, sharding in shardings.items():
        if name not in types:
            raise _bad(f"shardings.{name}", f"the graph has no value %{name}")
        try:
            sharding.check(types[name], mesh)
        except ShardplanError as exc:
            raise _bad(f"shardings.{name}", str(exc)) from None


def _read_operand_shardings(rows: list) -> dict[tuple[int, int], Sharding]:
    out: dict[tuple[int, int], Sharding] = {}
    for i, row in enumerate(rows):
        where = f"operand_shardings[{i}]"
        if not (isinstance(row, list) and len(row) == 3 and all(_is_int(x) for x in row[:2])):
            raise _bad(where, f"expected [op_index, operand_index, sharding], got {row!r:.60}")
        out[(row[0], row[1])] = _read_sharding(row[2], where)
    return out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _read_reshard(data: object, where: str) -> Reshard:
    r = _Reader(data, where)
    collectives = []
    for i, c in enumerate(r.get("collectives", list)):
        cr = _Reader(c, f"{where}.collectives[{i}]")
        axes = cr.get("axes", list)
        try:
            collectives.append(
                Collective(
                    cr.get("kind", str), tuple(axes), cr.get("bytes", int), cr.number("time")
                )
            )
        except ValueError as exc:
            raise _bad(cr.where, str(exc)) from None
    return Reshard(
        value=r.get("value", str),
        consumer=r.get("consumer", str),
        src=_read_sharding(r.get("src", dict), f"{where}.src"),
        dst=_read_sharding(r.get("dst", dict), f"{where}.dst"),
        collectives=tuple(collectives),
        count=r.get("count", int, 1),
    )


def _read_pipeline(r: _Reader, mesh: Mesh) -> PipelinePlan:
    axis = r.get("axis", str)
    if axis not in mesh.axis_names:
        raise _bad("pipeline.axis", f"the mesh {mesh} has no axis {axis!r}")
    stages = []
    for i, data in enumerate(r.get("stages", list)):
        s = _Reader(data, f"pipeline.stages[{i}]")
        layers = s.get("layers", list)
        if not layers or not all(_is_int(x) for x in layers):
            raise _bad(f"{s.where}.layers", f"expected layer indices, got {layers!r:.60}")
        chunks = s.get("chunk_layers", list, [])
        if not all(isinstance(c, list) and c and all(_is_int(x) for x in c) for c in chunks):
            raise _bad(
                f"{s.where}.chunk_layers", f"expected lists of layer indices, got {chunks!r:.60}"
            )
        stages.append(
            StageSpec(
                s.get("index", int),
                tuple(layers),
                s.get("stack", str),
                s.get("first_stage_extras", bool),
                s.number("time"),
                s.number("memory_bytes"),
                tuple(tuple(c) for c in chunks),
            )
        )
    if len(stages) != mesh.axis_size(axis):
        raise _bad("pipeline.stages", f"{len(stages)} stages on {axis}={mesh.axis_size(axis)}")
    return PipelinePlan(
        axis, tuple(stages), r.get("microbatches", int), r.get("schedule", str),
        r.number("step_time"), r.number("bubble_fraction"), r.get("chunks", int, 1),
    )  # fmt: skip


def _read_recompute(r: _Reader) -> dict[str, str]:
    return {layer: r.get(layer, str) for layer in r.data}


def _read_candidate(r: _Reader):
    from .mesh_search import Candidate

    mesh = r.get("mesh", dict)
    if not all(isinstance(k, str) and _is_int(n) for k, n in mesh.items()):
        raise _bad(f"{r.where}.mesh", f"expected axis sizes, got {mesh!r:.60}")
    step = r.get("step_time", (int, float, str, type(None)))
    peak = r.get("peak_memory_bytes", (int, float, str, type(None)))
    return Candidate(
        dict(mesh),
        None if step is None else r.number("step_time"),
        None if peak is None else r.number("peak_memory_bytes"),
        0.0,  # planning seconds are not saved
        r.get("rejected", str),
    )


def _read_memory(r: _Reader) -> dict[str, int]:
    return {kind: r.get(kind, int) for kind in r.data}


def _read_solver(r: _Reader) -> SolverStats:
    return SolverStats(
        status=r.get("status", str),
        objective=r.number("objective"),
        bound=r.number("bound"),
        wall_time=0.0,  # not saved: it would make equal plans differ byte for byte
        num_variables=r.get("num_variables", int),
        num_choices=r.get("num_choices", int),
        fallback=r.get("fallback", str, ""),
    )
