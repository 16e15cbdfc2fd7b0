"""The plan as text: ``print(plan)`` shows the one-screen summary (``summary.py``);
``plan.report(full=True)`` adds every input, the heaviest ops, the reshards and a small ASCII
picture of each parameter's layout.

Rendered with rich into a string of fixed width and no colour codes, so the same plan always
prints the same text (logs, golden tests, the README). The CLI prints the same renderables with
colour on a terminal.
"""

from __future__ import annotations

import math
from io import StringIO

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text
from shardplan.ir import Graph, Op, Role, Sharding, ShardplanError, op_flops

from .plan import Plan, Reshard

REPORT_WIDTH = 110
MAX_OP_ROWS = 24
MAX_RESHARD_ROWS = 40
MAX_PICTURE_CELLS = 8
"""A picture splits a dimension into at most this many drawn cells (the rest is elided)."""


# -- units --------------------------------------------------------------------------------------
def format_bytes(n: float) -> str:
    """Binary units, three significant digits: ``1.50 GiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:  # 1000-1023 MiB: whole units, not "1e+03 MiB"
            value = n / scale
            return f"{value:.3g} {unit}" if abs(value) < 999.5 else f"{value:.0f} {unit}"
    return f"{int(n)} B"


def format_seconds(t: float) -> str:
    if not math.isfinite(t):
        return str(t)
    if abs(t) >= 1:
        return f"{t:.3g} s"
    if abs(t) >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} µs"


# -- the report ---------------------------------------------------------------------------------
def format_plan(plan: Plan, width: int = REPORT_WIDTH, full: bool = False) -> str:
    """The summary, or with ``full`` the whole report, as plain text (deterministic for a given
    plan and width)."""
    if not full:
        from .summary import format_summary

        return format_summary(plan, width)
    buffer = StringIO()
    console = Console(
        file=buffer, width=width, color_system=None, force_terminal=False, no_color=True
    )
    console.print(plan_renderable(plan))
    lines = [line.rstrip() for line in buffer.getvalue().splitlines()]
    # A table ends in a blank line and the sections are separated by one: keep a single blank.
    kept = [line for i, line in enumerate(lines) if line or (i > 0 and lines[i - 1])]
    return "\n".join(kept) + "\n"


def plan_renderable(plan: Plan) -> RenderableType:
    """Header, inputs, ops, reshards and the layout picture, in reading order."""
    blank = Text("")
    return Group(
        _header(plan),
        blank,
        _inputs_table(plan),
        blank,
        _ops_table(plan),
        blank,
        _reshards_table(plan),
        blank,
        Text("Parameter layouts (rows split dim 0, columns the other dims; numbers are shards)"),
        blank,
        Text(plan_picture(plan)),
    )


def _exposed(plan: Plan) -> str:
    if plan.exposed_comm_time is None or plan.pipeline is not None:
        return ""
    return f", {format_seconds(plan.exposed_comm_time)} of it not hidden by compute"


def _pipeline_text(plan: Plan) -> str:
    """``pp=4, 1f1b, 16 micro-batches, bubble 16%: layers 0-7 | 8-15 | ...``."""
    pipe = plan.pipeline
    ranges = " | ".join(
        stage.stack
        + "."
        + ",".join(f"{c[0]}-{c[-1]}" for c in stage.chunk_layers or [stage.layers])
        for stage in pipe.stages
    )
    schedule = f"interleaved x{pipe.chunks}" if pipe.schedule == "interleaved" else pipe.schedule
    return (
        f"{pipe.axis}={len(pipe.stages)}, {schedule}, {pipe.microbatches} micro-batches, "
        f"bubble {pipe.bubble_fraction:.0%}: {ranges}"
    )


def _header(plan: Plan) -> Table:
    mesh, solver = plan.mesh, plan.solver
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    _add_row(
        grid,
        "graph",
        f"@{plan.graph.name}: {len(plan.graph.inputs)} inputs, {len(plan.graph.ops)} ops",
    )
    _add_row(grid, "mesh", f"{mesh} = {mesh.size} devices, cluster {mesh.cluster}")
    _add_row(
        grid,
        "step time",
        f"{format_seconds(plan.step_time)} modelled (compute {format_seconds(plan.compute_time)}, "
        f"communication {format_seconds(plan.comm_time)}{_exposed(plan)})",
    )
    if plan.pipeline is not None:
        _add_row(grid, "pipeline", _pipeline_text(plan))
    breakdown = ", ".join(f"{kind} {format_bytes(n)}" for kind, n in sorted(plan.memory.items()))
    memory_text = f"{format_bytes(plan.peak_memory_bytes)} peak ({breakdown or 'no breakdown'})"
    if plan.pipeline is not None:  # per device is per stage
        from .summary import stage_memory_text

        memory_text = stage_memory_text(plan)
    _add_row(grid, "memory/device", memory_text)
    wall = format_seconds(solver.wall_time) if solver.wall_time > 0 else "solve time not saved"
    _add_row(
        grid,
        "solver",
        f"{solver.status}, objective {format_seconds(solver.objective)}, gap {solver.gap:.2%}, "
        f"{wall}, {solver.num_variables} variables, {solver.num_choices} choices",
    )
    return grid


def _table(title: str, *columns: str) -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for name in columns:
        table.add_column(name, overflow="fold")
    return table


def _add_row(table: Table, *cells: str) -> None:
    """Cells as plain Text: ``all-reduce[tp]`` must not be read as rich markup."""
    table.add_row(*(Text(cell) for cell in cells))


def _local_shape(plan: Plan, name: str, sharding: Sharding) -> str:
    try:
        shape = sharding.local_shape(plan.graph.value(name).type, plan.mesh)
    except (ShardplanError, KeyError):
        return "?"
    return "[" + ",".join(str(d) for d in shape) + "]"


def _inputs_table(plan: Plan) -> Table:
    table = _table("Inputs", "value", "origin", "role", "type", "sharding", "local shape")
    for value in plan.graph.inputs:
        sharding = plan.shardings.get(value.name)
        _add_row(
            table,
            f"%{value.name}",
            value.origin.path or "",
            value.role.value,
            str(value.type),
            str(sharding) if sharding is not None else "-",
            _local_shape(plan, value.name, sharding) if sharding is not None else "-",
        )
    return table


def _op_flops(op: Op) -> float:
    try:
        return op_flops(
            op.kind, op.rule, [v.type for v in op.operands], [r.type for r in op.results], op.attrs
        )
    except Exception:  # a missing FLOP model must not stop the report
        return 0.0


def _ops_to_show(plan: Plan) -> list[tuple[int, Op, float]]:
    """Ops that communicate, then the heaviest ops, in graph order, at most MAX_OP_ROWS."""
    communicating = {_consumer_op_index(r) for r in plan.reshards if r.collectives}
    rows = [(i, op, _op_flops(op)) for i, op in enumerate(plan.graph.ops)]
    total = sum(f for _, _, f in rows) or 1.0
    chosen = [row for row in rows if row[0] in communicating or row[2] >= 0.02 * total]
    chosen.sort(key=lambda row: (row[0] not in communicating, -row[2], row[0]))
    return sorted(chosen[:MAX_OP_ROWS], key=lambda row: row[0])


def _ops_table(plan: Plan) -> Table:
    table = _table(
        "Ops (communicating or >= 2% of FLOPs)", "op", "module", "GFLOP", "operands", "result"
    )
    for index, op, flops in _ops_to_show(plan):
        operands = "\n".join(
            str(plan.operand_shardings.get((index, k), plan.shardings.get(v.name, "?")))
            for k, v in enumerate(op.operands)
        )
        results = "\n".join(str(plan.shardings.get(r.name, "?")) for r in op.results)
        module = op.origin.module or op.origin.path
        _add_row(table, repr(op), module, f"{flops / 1e9:.3g}", operands, results)
    shown = len(_ops_to_show(plan))
    if shown < len(plan.graph.ops):
        table.caption = f"{len(plan.graph.ops) - shown} more ops not shown"
        table.caption_justify = "left"
    return table


def _consumer_op_index(reshard: Reshard) -> int | None:
    kind, _, rest = reshard.consumer.partition(":")
    if kind != "op":
        return None
    try:
        return int(rest.split(":")[0])
    except ValueError:
        return None


def describe_consumer(graph: Graph, consumer: str) -> str:
    """``op:3:1`` -> ``%out = dot(...) operand 1``; outputs and aliases as written."""
    parts = consumer.split(":")
    if parts[0] == "op" and len(parts) == 3 and parts[1].isdigit():
        index = int(parts[1])
        if index < len(graph.ops):
            op = graph.ops[index]
            results = ", ".join(f"%{r.name}" for r in op.results)
            return f"{results} = {op.kind} operand {parts[2]}"
    return consumer.replace(":", " ", 1)


def _reshards_table(plan: Plan) -> Table:
    table = _table("Reshards", "value -> consumer", "from -> to", "collectives", "time")
    for reshard in plan.reshards[:MAX_RESHARD_ROWS]:
        collectives = "\n".join(
            f"{c.kind}[{','.join(c.axes)}] {format_bytes(c.bytes)} {format_seconds(c.time)}"
            for c in reshard.collectives
        )
        _add_row(
            table,
            f"%{reshard.value} -> {describe_consumer(plan.graph, reshard.consumer)}",
            f"{reshard.src}\n-> {reshard.dst}",
            collectives or "local slice (free)",
            format_seconds(reshard.time),
        )
    hidden = len(plan.reshards) - MAX_RESHARD_ROWS
    if hidden > 0:
        table.caption = f"{hidden} more reshards not shown (plan.reshards has them all)"
        table.caption_justify = "left"
    if not plan.reshards:
        table.caption = "none: every value is consumed in the layout it is produced in"
        table.caption_justify = "left"
    return table


# -- the picture --------------------------------------------------------------------------------
def plan_picture(plan: Plan) -> str:
    """Per parameter / optimizer state, a grid of its shards and which mesh axes split what."""
    blocks = []
    roles = (Role.PARAMETER, Role.OPTIMIZER_STATE)
    for value in plan.graph.inputs:
        sharding = plan.shardings.get(value.name)
        if value.role in roles and sharding is not None:
            label = value.origin.path or f"%{value.name}"
            blocks.append(layout_picture(label, value.type.shape, str(value.type), sharding, plan))
    return "\n\n".join(blocks) if blocks else "(the graph has no parameters)"


def layout_picture(
    label: str, shape: tuple[int, ...], type_text: str, sharding: Sharding, plan: Plan
) -> str:
    """A box per shard: rows split dim 0, columns split the remaining dims together."""
    mesh = plan.mesh
    rows = mesh.group_size(sharding.dims[0]) if shape else 1
    cols = math.prod(mesh.group_size(axes) for axes in sharding.dims[1:])
    grid = _grid(rows, cols)
    notes = [
        _dim_note(d, size, axes, mesh)
        for d, (size, axes) in enumerate(zip(shape, sharding.dims, strict=True))
    ]
    replicated = [f"{a}={n}" for a, n in mesh.axes if a not in sharding.used_axes]
    notes.append("replicated over " + (", ".join(replicated) if replicated else "no mesh axis"))
    if sharding.partial:
        notes.append("partial (pending sum) over " + ", ".join(sorted(sharding.partial)))
    lines = [f"{label}  {type_text}  {sharding}"]
    height = max(len(grid), len(notes))
    for i in range(height):
        left = grid[i] if i < len(grid) else " " * len(grid[0])
        right = notes[i] if i < len(notes) else ""
        lines.append(f"  {left}   {right}".rstrip())
    return "\n".join(lines)


def _dim_note(d: int, size: int, axes: tuple[str, ...], mesh) -> str:
    if not axes:
        return f"dim {d} ({size}): whole"
    split = mesh.group_size(axes)
    return f"dim {d} ({size}): split {split} ways over {','.join(axes)} -> {size // split} each"


def _grid(rows: int, cols: int) -> list[str]:
    """ASCII boxes numbered by shard (one line per row), elided past MAX_PICTURE_CELLS."""
    shown_cols, shown_rows = min(cols, MAX_PICTURE_CELLS), min(rows, MAX_PICTURE_CELLS)
    more = ".." if cols > shown_cols else ""
    border = "+" + "---+" * shown_cols + more
    lines = [border]
    for r in range(shown_rows):
        lines.append("|" + "".join(f"{r * cols + c:^3}|" for c in range(shown_cols)) + more)
    if rows > shown_rows:
        lines.append("|" + " : |" * shown_cols + more)
    return [*lines, border]
