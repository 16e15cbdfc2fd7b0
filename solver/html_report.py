"""A plan as one self-contained HTML page: ``plan.to_html(path)``, ``shardplan report``.

Text output has to fold and cut (one screen); a page can show everything at once and let the
reader look closer: the mesh, a layout map (each parameter's mesh axes per tensor dimension,
colour-coded, alike layers folded), memory by category against the budget, the simulator's
two-stream timeline (hover a box for its op or collective), the pipeline schedule when there is
one, and every reshard in a sortable table. The style sheet and script are inlined
(``html_assets.py``) and nothing is fetched, so the file opens offline and can be mailed.
Every number comes from the plan or from ``costmodel.simulate`` on it; the page adds none.
"""

from __future__ import annotations

import html
from pathlib import Path

from ..costmodel.pipeline import _order, _run
from ..costmodel.simulate import simulate
from ..ir import Mesh, Role, Sharding
from .html_assets import AXIS_COLOURS, CSS, JS, MEMORY_COLOURS, OTHER_COLOUR
from .plan import Plan
from .report import describe_consumer, format_bytes, format_seconds
from .summary import LABEL_WIDTH, _pattern, _state_owners, header_lines, index_ranges

TIMELINE_WIDTH = 1200
"""Pixels of the timeline; compute boxes narrower than a pixel are drawn merged."""
MAX_RESHARD_ROWS = 3000
"""Reshard table rows (the costliest); a 32-layer plan has a few thousand."""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _colour(mesh: Mesh, axis: str) -> str:
    return AXIS_COLOURS[mesh.axis_index(axis) % len(AXIS_COLOURS)]


def _axes_html(mesh: Mesh, axes: tuple[str, ...] | list[str]) -> str:
    return "".join(
        f'<span class="axis" style="background:{_colour(mesh, a)}">{_e(a)}</span>' for a in axes
    )


def layout_cells(sharding: Sharding, shape: tuple[int, ...], mesh: Mesh) -> str:
    """One box per tensor dimension: its size and the mesh axes splitting it (coloured)."""
    cells = [
        f'<span class="dim" data-dim="{d}" data-axes="{_e(",".join(axes))}">{size}'
        f"{_axes_html(mesh, axes)}</span>"
        for d, (size, axes) in enumerate(zip(shape, sharding.dims, strict=True))
    ]
    if sharding.partial:
        ordered = [a for a in mesh.axis_names if a in sharding.partial]
        cells.append(f'<span class="dim">partial{_axes_html(mesh, ordered)}</span>')
    return "".join(cells) or '<span class="dim">scalar</span>'


# -- sections -----------------------------------------------------------------------------------
def _summary(plan: Plan) -> str:
    rows = []
    for line in header_lines(plan, 10**6):
        label, text = line[:LABEL_WIDTH].strip(), line[LABEL_WIDTH:]
        rows.append(f'<tr data-row="{_e(label)}"><td>{_e(label)}</td><td>{_e(text)}</td></tr>')
    return f'<table class="summary" id="summary">{"".join(rows)}</table>'


def _mesh(plan: Plan) -> str:
    mesh = plan.mesh
    axes = "".join(
        f'<span class="dim" data-axis="{_e(name)}">{_axes_html(mesh, [name])} × {size}</span>'
        for name, size in mesh.axes
    )
    return (
        f'<h2>Mesh</h2><p id="mesh">{axes} = {mesh.size} devices on cluster '
        f"<b>{_e(mesh.cluster)}</b> (major axis first; the innermost axis is inside a node)</p>"
    )


def _layout_groups(plan: Plan) -> list[dict]:
    """Parameters grouped by (name with the layer index folded, type, layout, update layout)."""
    owners = _state_owners(plan)
    updates: dict[str, list[Sharding]] = {}
    for value in plan.graph.inputs:
        if value.name in owners and value.name in plan.shardings:
            updates.setdefault(owners[value.name], []).append(plan.shardings[value.name])
    groups: dict[tuple, dict] = {}
    for value in plan.graph.inputs:
        layout = plan.shardings.get(value.name)
        if value.role is not Role.PARAMETER or layout is None:
            continue
        path = value.origin.path or f"%{value.name}"
        update = sorted(set(updates.get(path, [])), key=str)
        pattern, index = _pattern(path)
        key = (pattern, str(value.type), str(layout), tuple(map(str, update)))
        group = groups.setdefault(
            key, {"pattern": pattern, "value": value, "layout": layout, "update": update, "at": []}
        )
        if index is not None:
            group["at"].append(index)
    return list(groups.values())


def _layouts(plan: Plan) -> str:
    mesh, rows = plan.mesh, []  # colours by the whole mesh's axis order, as in "Mesh"
    for g in _layout_groups(plan):
        at, value = g["at"], g["value"]
        name = g["pattern"].format(index_ranges(at)) if at else g["pattern"].format()
        count = f" ×{len(at)}" if len(at) > 1 else ""
        update = "".join(layout_cells(u, value.type.shape, mesh) for u in g["update"])
        rows.append(
            f'<tr class="layout" data-name="{_e(name)}" data-layout="{_e(g["layout"])}" '
            f'data-count="{max(len(at), 1)}">'
            f"<td>{_e(name)}{count}</td><td>{_e(value.type)}</td>"
            f"<td>{layout_cells(g['layout'], value.type.shape, mesh)}</td><td>{update}</td></tr>"
        )
    legend = "".join(f"<span>{_axes_html(mesh, [a])}</span>" for a in plan.stage_mesh.axis_names)
    return (
        '<h2>Layout map</h2><p class="legend">Mesh axes: '
        f"{legend} — each box is a tensor dimension (its size) and the axes splitting it; "
        "no axis: replicated. Alike layers are shown once.</p>"
        '<table id="layouts"><thead><tr><th>parameter</th><th>type</th><th>layout</th>'
        f"<th>update (optimizer states)</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )


def _memory(plan: Plan) -> str:
    limit = plan.memory_limit or 0.0
    scale = max(limit, float(plan.peak_memory_bytes), 1.0)
    parts, rows = [], []
    for kind, nbytes in sorted(plan.memory.items(), key=lambda kv: -kv[1]):
        colour = MEMORY_COLOURS.get(kind, OTHER_COLOUR)
        share = 100.0 * nbytes / scale
        tip = f"{kind}: {format_bytes(nbytes)}"
        parts.append(
            f'<div class="segment" data-kind="{_e(kind)}" data-bytes="{nbytes}" '
            f'data-tip="{_e(tip)}" style="width:{share:.3f}%;background:{colour}"></div>'
        )
        rows.append(
            f'<tr><td><span class="axis" style="background:{colour}">&nbsp;</span> {_e(kind)}'
            f'</td><td class="num">{format_bytes(nbytes)}</td>'
            f'<td class="num">{100.0 * nbytes / max(plan.peak_memory_bytes, 1):.1f}%</td></tr>'
        )
    marker = (
        f'<div class="limit" style="left:{100.0 * limit / scale:.3f}%" '
        f'data-tip="budget {format_bytes(limit)}"></div>'
        if limit
        else ""
    )
    budget = f", budget {format_bytes(limit)} (dashed line)" if limit else ""
    return (
        f"<h2>Memory per device</h2><p>peak {format_bytes(plan.peak_memory_bytes)}{budget}</p>"
        f"{_stage_memory(plan)}"
        f'<div class="bar" id="memory-bar" data-peak="{plan.peak_memory_bytes}" '
        f'data-limit="{int(limit)}">{"".join(parts)}{marker}</div>'
        f'<table id="memory"><thead><tr><th>category</th><th>bytes</th><th>of peak</th></tr>'
        f"</thead><tbody>{''.join(rows)}</tbody></table>"
    )


def _stage_memory(plan: Plan) -> str:
    """A pipelined plan: each stage's modelled peak (the bar below is the sub-mesh solve's
    view of the whole model, under the stage count times the per-device budget)."""
    if plan.pipeline is None:
        return ""
    rows = "".join(
        f'<tr data-stage="{s.index}" data-bytes="{s.memory_bytes!r}"><td>stage {s.index}</td>'
        f'<td class="num">{format_bytes(s.memory_bytes)}</td></tr>'
        for s in plan.pipeline.stages
    )
    return (
        '<p>Per stage (the devices of one pipeline stage):</p><table id="stage-memory">'
        f"<thead><tr><th>stage</th><th>peak</th></tr></thead><tbody>{rows}</tbody></table>"
        "<p>Whole model as the sub-mesh solve sees it (a stage holds its share):</p>"
    )


def _op_label(plan: Plan, index: int) -> str:
    op = plan.graph.ops[index]
    where = op.origin.module or op.origin.path
    return f"{op.kind} %{op.results[0].name if op.results else ''}" + (
        f" in {where}" if where else ""
    )


def _compute_boxes(plan: Plan, items: list, scale: float) -> list[tuple[float, float, str, int]]:
    """Compute boxes; consecutive ones narrower than a pixel in all are merged into one."""
    boxes: list[tuple[float, float, str, int]] = []
    run: list = []
    for item in [*items, None]:
        if item is not None and (not run or (item[3] - run[0][2]) * scale < 1.0):
            run.append(item)
            continue
        if run:
            first, last = run[0], run[-1]
            label = _op_label(plan, first[1])
            if len(run) > 1:
                label = f"{len(run)} ops, from {label} to {_op_label(plan, last[1])}"
            boxes.append((first[2], last[3], label, len(run)))
        run = [item] if item is not None else []
    return boxes


def _timeline(plan: Plan) -> str:
    if plan.pipeline is not None:
        return ""  # a pipelined plan's step is the schedule below, not one stage's two streams
    timeline: list = []
    result = simulate(plan, timeline=timeline)
    step = max(result.step_time, 1e-12)
    scale = TIMELINE_WIDTH / step
    compute = [t for t in timeline if t[0] == "compute"]
    boxes = []
    for start, end, label, count in _compute_boxes(plan, compute, scale):
        tip = f"{label}: {format_seconds(end - start)} at {format_seconds(start)}"
        boxes.append(_rect("compute", 0, start, end, scale, "#4e79a7", tip, count))
    for _, index, start, end in (t for t in timeline if t[0] == "comm"):
        r = plan.reshards[index]
        kinds = " + ".join(
            f"{c.kind}[{','.join(c.axes)}] {format_bytes(c.bytes)}" for c in r.collectives
        )
        where = describe_consumer(plan.graph, r.consumer)
        tip = f"{kinds}: %{r.value} -> {where}, {format_seconds(end - start)}"
        boxes.append(_rect("comm", 1, start, end, scale, "#f28e2b", tip, 1))
    axis = "".join(
        f'<text x="{100 + TIMELINE_WIDTH * k / 4:.1f}" y="76">{format_seconds(step * k / 4)}</text>'
        for k in range(5)
    )
    return (
        "<h2>Step timeline (two streams)</h2>"
        f"<p>simulated step {format_seconds(result.step_time)}: compute "
        f"{format_seconds(result.compute_time)}, communication {format_seconds(result.comm_time)} "
        f"of which {format_seconds(result.exposed_comm_time)} not hidden by compute. "
        "Hover a box.</p>"
        f'<svg id="timeline" width="{TIMELINE_WIDTH + 160}" height="84" '
        f'data-step="{result.step_time!r}">'
        '<text x="0" y="20">compute</text><text x="0" y="50">communication</text>'
        f"{''.join(boxes)}{axis}</svg>"
    )


def _rect(stream: str, lane: int, start: float, end: float, scale: float, colour: str,
          tip: str, count: int) -> str:  # fmt: skip
    width = max((end - start) * scale, 0.5)
    return (
        f'<rect class="{stream}" x="{100 + start * scale:.2f}" y="{6 + 30 * lane}" '
        f'width="{width:.2f}" height="22" fill="{colour}" data-start="{start!r}" '
        f'data-end="{end!r}" data-count="{count}" data-tip="{_e(tip)}"></rect>'
    )


def _pipeline(plan: Plan) -> str:
    pipe = plan.pipeline
    if pipe is None:
        return ""
    p, m = len(pipe.stages), pipe.microbatches
    v = pipe.chunks if pipe.schedule == "interleaved" else 1
    # per micro-batch forward : backward taken 1 : 2 (backward computes two gradients)
    fwd = [s.time / m / 3 for s in pipe.stages]
    bwd = [2 * s.time / m / 3 for s in pipe.stages]
    orders = [_order(pipe.schedule, s, p, m, v) for s in range(p)]
    done, _ = _run(orders, [f / v for f in fwd], [b / v for b in bwd], p, v, 0.0)
    span = max(done.values(), default=1e-12)
    scale = TIMELINE_WIDTH / span
    boxes = []
    for (stage, task), end in sorted(done.items(), key=lambda kv: (kv[0][0], kv[1])):
        length = (fwd[stage] if task.forward else bwd[stage]) / v
        kind = "forward" if task.forward else "backward"
        tip = f"stage {stage} {kind} micro-batch {task.microbatch}" + (
            f" chunk {task.chunk}" if v > 1 else ""
        )
        colour = "#59a14f" if task.forward else "#e15759"
        boxes.append(_rect(f"task {kind}", stage, end - length, end, scale, colour, tip, 1))
    labels = "".join(f'<text x="0" y="{22 + 30 * s}">stage {s}</text>' for s in range(p))
    return (
        f"<h2>Pipeline schedule</h2><p>{_e(pipe.schedule)}, {p} stages, {m} micro-batches"
        f"{f', {v} chunks per device' if v > 1 else ''}, bubble {pipe.bubble_fraction:.1%}; "
        "forward green, backward red (drawn 1 : 2 per micro-batch).</p>"
        f'<svg id="pipeline" width="{TIMELINE_WIDTH + 160}" height="{30 * p + 10}">'
        f"{labels}{''.join(boxes)}</svg>"
    )


def _num(value: object) -> str:
    return ' class="num"' if isinstance(value, (int, float)) else ""


def _reshards(plan: Plan) -> str:
    moved = [r for r in plan.reshards if r.collectives]
    moved.sort(key=lambda r: -r.time)
    rows = []
    for r in moved[:MAX_RESHARD_ROWS]:
        kinds = " + ".join(f"{c.kind}[{','.join(c.axes)}]" for c in r.collectives)
        nbytes = sum(c.bytes for c in r.collectives)
        where = describe_consumer(plan.graph, r.consumer)
        cells = [
            (f"%{r.value}", f"%{r.value}"), (where, where), (str(r.src), str(r.src)),
            (str(r.dst), str(r.dst)), (kinds, kinds), (nbytes, format_bytes(nbytes)),
            (r.count, str(r.count)), (r.time, format_seconds(r.time)),
        ]  # fmt: skip
        tds = "".join(
            f'<td data-value="{_e(value)}"{_num(value)}>{_e(text)}</td>' for value, text in cells
        )
        rows.append(f"<tr>{tds}</tr>")
    heads = [("value", "text"), ("consumer", "text"), ("from", "text"), ("to", "text"),
             ("collectives", "text"), ("bytes", "number"), ("count", "number"),
             ("time", "number")]  # fmt: skip
    head = "".join(f'<th data-key="{k}" data-type="{t}">{k}</th>' for k, t in heads)
    note = (
        f'<p class="note">the costliest {MAX_RESHARD_ROWS} of {len(moved)}</p>'
        if len(moved) > MAX_RESHARD_ROWS
        else ""
    )
    return (
        f"<h2>Reshards ({len(moved)} with collectives)</h2><p>Click a header to sort; "
        f"time is per step (all runs).</p>{note}"
        f'<table class="sortable" id="reshards" data-sorted-by="time"><thead><tr>{head}</tr>'
        f"</thead><tbody>{''.join(rows)}</tbody></table>"
    )


def _candidates(plan: Plan) -> str:
    """The mesh shapes a ``devices=N`` plan tried (``solver/mesh_search.py``), best first."""
    if not plan.candidates:
        return ""
    from .mesh_search import format_candidates

    return (
        f'<h2>Mesh shapes tried</h2><pre id="candidates">'
        f"{_e(format_candidates(plan.candidates))}</pre>"
    )


def plan_html(plan: Plan) -> str:
    """The report as one HTML document (UTF-8 text)."""
    title = f"shardplan: @{plan.graph.name} on {plan.mesh}"
    sections = [
        f"<h1>{_e(title)}</h1>", _summary(plan), _mesh(plan), _candidates(plan), _layouts(plan),
        _memory(plan),
        _timeline(plan), _pipeline(plan), _reshards(plan),
    ]  # fmt: skip
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e(title)}</title><style>{CSS}</style></head><body>"
        f'{"".join(sections)}<div id="tooltip"></div><script>{JS}</script></body></html>\n'
    )


def write_html(plan: Plan, path: str | Path) -> Path:
    """Write ``plan_html(plan)`` to ``path`` atomically (a failed write keeps the old file)."""
    from .plan_files import atomic_write_text, check_output_path

    check_output_path(Path(path))
    atomic_write_text(path, plan_html(plan))
    return Path(path)


__all__ = ["layout_cells", "plan_html", "write_html"]
