"""The one-screen summary ``print(plan)`` shows: what was planned, what it costs, where time goes.

A plan of a 16-layer model has thousands of values and hundreds of reshards; a reader first wants
the step time and its split, memory by kind, the strategy in words, one layout per kind of
parameter (alike layers folded: ``model.layers.0-15.mlp.up_proj.weight x16``) and the reshards
that cost the most. ``plan.report(full=True)`` (``--full`` in the CLI) keeps every table.
"""

from __future__ import annotations

import itertools
import re
import textwrap
from collections import defaultdict
from dataclasses import dataclass, field

from shardplan.costmodel.conv import HALO_KINDS, halo_collectives
from shardplan.ir import Graph, Mesh, Role

from .plan import Plan, Reshard
from .table_wise import table_exchanges

MAX_LAYOUT_ROWS = 14
"""Kinds of parameter listed; the rest are counted in one line."""
MAX_RESHARD_ROWS = 5
"""Reshard groups listed (the costliest)."""

_INDEX = re.compile(r"(?<=[.\[])(\d+)(?=[.\]]|$)")
"""A numeric path component: ``layers.3.mlp`` or ``['layers'][3]``."""


# -- the strategy in words ----------------------------------------------------------------------
def _axes_text(axes: list[str] | tuple[str, ...]) -> str:
    return "×".join(axes)


def _ordered(mesh: Mesh, axes: set[str]) -> list[str]:
    return [a for a in mesh.axis_names if a in axes]


def batch_axes(plan: Plan) -> list[str]:
    """Mesh axes the batch is split over, as the first op reading a batch input consumes it.

    A batch input may be stored replicated and sliced for free where it is read, so the stored
    layout alone would say "not split"."""
    inputs = {v.name for v in plan.graph.inputs if v.role is Role.INPUT}
    axes: set[str] = set()
    seen: set[str] = set()
    for index, op in enumerate(plan.graph.ops):
        for k, operand in enumerate(op.operands):
            if operand.name in inputs and operand.name not in seen and operand.type.rank:
                seen.add(operand.name)
                layout = plan.operand_shardings.get((index, k), plan.shardings.get(operand.name))
                if layout is not None:
                    axes.update(layout.dims[0])
        if seen == inputs:
            break
    return _ordered(plan.mesh, axes)


def idle_axes(plan: Plan) -> list[str]:
    """Axes of the (stage) mesh, of size > 1, that split no tensor the plan stores or an op
    reads: their devices repeat the work of the others."""
    used: set[str] = set()
    for layout in itertools.chain(plan.shardings.values(), plan.operand_shardings.values()):
        used |= layout.used_axes
    return [axis for axis, size in plan.stage_mesh.axes if size > 1 and axis not in used]


def idle_axis_advice(plan: Plan) -> str | None:
    """Why an idle axis is idle when the batch is what keeps it so (no batch input's dim 0
    divides by its size), and the batch sizes that would use it; None when the batch divides
    (then the solver left the axis idle because splitting did not pay)."""
    batches = sorted({v.type.shape[0] for v in plan.graph.inputs
                      if v.role is Role.INPUT and v.type.rank >= 1})  # fmt: skip
    if not batches:
        return None
    mesh = plan.stage_mesh
    lines = []
    for axis in idle_axes(plan):
        size = mesh.axis_size(axis)
        if any(b % size == 0 for b in batches):
            continue
        batch = batches[-1]
        near = sorted({(batch // size) * size or size, (batch // size + 1) * size} - {0})
        lines.append(
            f"mesh axis {axis!r} (size {size}) splits nothing in this plan: the batch "
            f"({batch}) does not divide by {size} and no other split paid, so its devices repeat "
            f"the others' work; use a batch divisible by {size} (e.g. "
            f"{' or '.join(map(str, near))}) or a mesh whose axis sizes divide the batch"
        )
    return "; ".join(lines) or None


def _sharded_bytes(plan: Plan, role: Role) -> tuple[dict[str, float], float]:
    """Per mesh axis, the bytes of ``role`` inputs split over it; and the role's total bytes."""
    per_axis: dict[str, float] = defaultdict(float)
    total = 0.0
    for value in plan.graph.inputs:
        layout = plan.shardings.get(value.name)
        if value.role is not role or layout is None:
            continue
        total += value.type.nbytes
        for axis in layout.used_axes:
            per_axis[axis] += value.type.nbytes
    return per_axis, total


def _zero_axes(plan: Plan) -> tuple[list[str], float, float]:
    """Axes optimizer states are split over where their parameter is not (a sharded update),
    the bytes of such states, and all optimizer-state bytes."""
    owners = _state_owners(plan)
    params = {v.origin.path: v for v in plan.graph.inputs if v.role is Role.PARAMETER}
    axes: set[str] = set()
    sharded = total = 0.0
    for value in plan.graph.inputs:
        layout = plan.shardings.get(value.name)
        if value.role is not Role.OPTIMIZER_STATE or layout is None:
            continue
        total += value.type.nbytes
        owner = params.get(owners.get(value.name, ""))
        owner_layout = plan.shardings.get(owner.name) if owner is not None else None
        extra = layout.used_axes - (owner_layout.used_axes if owner_layout else set())
        if extra:
            axes |= extra
            sharded += value.type.nbytes
    return _ordered(plan.mesh, axes), sharded, total


def halo_axes(plan: Plan) -> list[str]:
    """Mesh axes some convolution's or pooling window's spatial rows are split over
    (``ir/halo.py``)."""
    axes: set[str] = set()
    for i, op in enumerate(plan.graph.ops):
        if op.kind in HALO_KINDS:
            operands = [plan.operand_shardings[(i, j)] for j in range(len(op.operands))]
            axes.update(a for c in halo_collectives(op, operands, plan.mesh) for a in c.axes)
    return _ordered(plan.mesh, axes)


def strategy_words(plan: Plan) -> str:
    """``batch over dp×tp, parameters replicated, ZeRO-style sharded update over dp×tp, ...``."""
    mesh = plan.mesh
    batch = batch_axes(plan)
    parts = [f"batch over {_axes_text(batch)}" if batch else "batch not split"]
    if rows := halo_axes(plan):
        parts.append(f"convolution rows over {_axes_text(rows)} (halo exchanges)")
    params, param_total = _sharded_bytes(plan, Role.PARAMETER)
    fsdp = [a for a in _ordered(mesh, set(params)) if a in batch]
    tensor = [a for a in _ordered(mesh, set(params)) if a not in batch]
    if not param_total:
        parts.append("no parameters")
    elif not params:
        parts.append("parameters replicated")
    if fsdp:
        share = max(params[a] for a in fsdp) / param_total
        parts.append(
            f"parameters sharded over {_axes_text(fsdp)} (FSDP-style, {share:.0%} of bytes)"
        )
    if tensor:
        share = max(params[a] for a in tensor) / param_total
        parts.append(f"tensor parallel over {_axes_text(tensor)} ({share:.0%} of parameter bytes)")
    zero, zero_bytes, state_total = _zero_axes(plan)
    if zero:
        share = zero_bytes / state_total
        note = f" ({share:.0%} of optimizer-state bytes)" if share < 0.995 else ""
        parts.append(f"ZeRO-style sharded update over {_axes_text(zero)}{note}")
    elif state_total and not _sharded_bytes(plan, Role.OPTIMIZER_STATE)[0]:
        parts.append("optimizer states replicated")
    if plan.pipeline is not None:
        pipe = plan.pipeline
        parts.append(f"{len(pipe.stages)} pipeline stages over {pipe.axis}")
    modes: dict[str, int] = defaultdict(int)
    for mode in plan.recompute.values():
        modes[mode] += 1
    recompute = ", ".join(f"{mode} on {n} layer{'s' * (n != 1)}" for mode, n in modes.items())
    parts.append(f"recompute {recompute or 'none'}")
    parts += [f"{axis} idle (splits nothing)" for axis in idle_axes(plan)]
    return ", ".join(parts)


MEMORY_BOUND_SHARE = 0.8
"""A plan whose peak is at least this share of the limit, or that recomputes, is memory-bound:
its summary says what was traded for memory (``memory_trade``)."""


def memory_trade(plan: Plan) -> str | None:
    """What a memory-bound plan gave up for memory: which layers recompute, which persistent
    states are sharded over which axes, and the headroom left under the limit. None when the
    plan is not memory-bound (no recomputation, peak under ``MEMORY_BOUND_SHARE`` of the limit)."""
    from .report import format_bytes

    limit = plan.memory_limit
    peak = plan.peak_memory_bytes
    if not limit or (not plan.recompute and peak < MEMORY_BOUND_SHARE * limit):
        return None
    parts = []
    by_mode: dict[str, list[str]] = defaultdict(list)
    for layer, mode in plan.recompute.items():
        by_mode[mode].append(layer)
    for mode, layers in sorted(by_mode.items()):
        parts.append(f"{mode} recomputation of {fold_layers(layers)}")
    if not parts:
        parts.append("no recomputation")
    for role, words in ((Role.PARAMETER, "parameters"), (Role.OPTIMIZER_STATE, "optimizer states")):
        per_axis, total = _sharded_bytes(plan, role)
        if not total:
            continue
        axes = _ordered(plan.mesh, {a for a, n in per_axis.items() if n})
        if axes:
            share = max(per_axis[a] for a in axes) / total
            parts.append(f"{words} sharded over {_axes_text(axes)} ({share:.0%} of bytes)")
        else:
            parts.append(f"{words} replicated")
    parts.append(
        f"headroom {format_bytes(max(limit - peak, 0))} ({max(limit - peak, 0) / limit:.1%})"
    )
    return ", ".join(parts)


def stage_memory_text(plan: Plan) -> str:
    """A pipelined plan's memory per device: the fullest stage's peak, every stage's, and the
    per-device limit. (``plan.peak_memory_bytes`` and ``plan.memory_limit`` are the sub-mesh
    solve's view of the whole model under the stage count times the budget, ``pipeline.py``.)"""
    from .report import format_bytes

    stages = plan.pipeline.stages
    fullest = max(stages, key=lambda s: s.memory_bytes)
    each = " | ".join(format_bytes(s.memory_bytes) for s in stages)
    text = f"{format_bytes(fullest.memory_bytes)} peak on stage {fullest.index} (stages {each})"
    if plan.memory_limit:
        text += f", limit {format_bytes(plan.memory_limit / len(stages))}"
    return text


def fold_layers(names: list[str]) -> str:
    """``model.layers.0`` .. ``model.layers.31`` -> ``model.layers.0-31`` (runs of indices)."""
    by_pattern: dict[str, list[int]] = defaultdict(list)
    plain: list[str] = []
    for name in names:
        pattern, index = _pattern(name)
        if index is None:
            plain.append(name)
        else:
            by_pattern[pattern].append(index)
    out = list(plain)
    for pattern, indices in sorted(by_pattern.items()):
        indices = sorted(set(indices))
        runs, start = [], indices[0]
        for prev, cur in itertools.pairwise([*indices, None]):
            if cur is None or cur != prev + 1:
                runs.append(f"{start}-{prev}" if prev != start else f"{start}")
                start = cur
        text = ",".join(runs)
        out.append(pattern.format(text if len(runs) == 1 else "{" + text + "}"))
    count = len(names)
    return f"{', '.join(out)} ({count} layer{'s' * (count != 1)})"


# -- alike layers folded ------------------------------------------------------------------------
def _pattern(path: str) -> tuple[str, int | None]:
    """``model.layers.3.mlp.w`` -> (``model.layers.{}.mlp.w``, 3); the first index only."""
    match = _INDEX.search(path)
    if match is None:
        return path.replace("{", "{{").replace("}", "}}"), None
    head = path[: match.start()].replace("{", "{{").replace("}", "}}")
    tail = path[match.end() :].replace("{", "{{").replace("}", "}}")
    return head + "{}" + tail, int(match.group(1))


def index_ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


@dataclass
class LayoutRow:
    """One kind of parameter: its layout, its optimizer states' layout, the layers it covers."""

    pattern: str
    type_text: str
    layout: str
    update: str
    indices: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        if not self.indices:
            return self.pattern.format()
        folded = self.pattern.format(index_ranges(self.indices))
        return folded + (f" ×{len(self.indices)}" if len(self.indices) > 1 else "")


def _tail(path: str) -> str:
    """``params['layers'][0]['wq']`` -> ``['layers'][0]['wq']``: the pytree path below the
    argument, which a JAX optimizer state (``opt_state['mu']['layers'][0]['wq']``) ends with."""
    start = path.find("[")
    return path[start:] if start > 0 else ""


def _state_owners(plan: Plan) -> dict[str, str]:
    """Optimizer state value name -> the parameter path it belongs to, where one is known:
    ``model.w#exp_avg`` (torch) or the same pytree path under another argument (JAX)."""
    params = [v for v in plan.graph.inputs if v.role is Role.PARAMETER]
    by_path = {v.origin.path: v for v in params}
    by_tail = {_tail(v.origin.path): v for v in params if _tail(v.origin.path)}
    owners = {}
    for value in plan.graph.inputs:
        if value.role is not Role.OPTIMIZER_STATE:
            continue
        path = value.origin.path
        owner = by_path.get(path.partition("#")[0]) if "#" in path else None
        if owner is None:
            tails = [t for t in by_tail if path.endswith(t) and path != by_tail[t].origin.path]
            owner = by_tail[max(tails, key=len)] if tails else None
        if owner is not None and owner.type.shape == value.type.shape:
            owners[value.name] = owner.origin.path
    return owners


def layout_rows(plan: Plan) -> list[LayoutRow]:
    """Parameters (and unowned optimizer states), alike layers folded into one row each."""
    owners = _state_owners(plan)
    states: dict[str, set[str]] = defaultdict(set)
    unowned = []
    for value in plan.graph.inputs:
        if value.role is Role.OPTIMIZER_STATE and value.name in plan.shardings:
            if value.name in owners:
                states[owners[value.name]].add(str(plan.shardings[value.name]))
            else:
                unowned.append(value)
    rows: dict[tuple[str, str, str, str], LayoutRow] = {}
    for value in plan.graph.inputs:
        layout = plan.shardings.get(value.name)
        params_or_state = value.role is Role.PARAMETER or value in unowned
        if not params_or_state or layout is None:
            continue
        path = value.origin.path or f"%{value.name}"
        update = " / ".join(sorted(states.get(path, ()))) or ("(state)" if value in unowned else "")
        pattern, index = _pattern(path)
        key = (pattern, str(value.type), str(layout), update)
        row = rows.setdefault(key, LayoutRow(pattern, str(value.type), str(layout), update))
        if index is not None:
            row.indices.append(index)
    return list(rows.values())


# -- the costliest reshards, alike layers folded ------------------------------------------------
@dataclass
class ReshardGroup:
    example: Reshard
    where: str
    count: int = 0
    time: float = 0.0


def _consumer_op(graph: Graph, reshard: Reshard):
    kind, _, rest = reshard.consumer.partition(":")
    index = rest.split(":")[0]
    if kind == "op" and index.isdigit() and int(index) < len(graph.ops):
        return graph.ops[int(index)]
    return None


def _where(graph: Graph, reshard: Reshard) -> tuple[str, str]:
    """(consumer kind, module or parameter path with the layer index folded) of a reshard."""
    kind, _, rest = reshard.consumer.partition(":")
    op = _consumer_op(graph, reshard)
    if op is not None:
        kind, path = op.kind, op.origin.module or op.origin.path
    elif kind == "alias" and rest.isdigit() and int(rest) in graph.output_aliases:
        path = graph.inputs[graph.output_aliases[int(rest)]].origin.path
    else:
        path = ""
    return kind, _pattern(path)[0].format("*") if path else ""


def reshard_groups(plan: Plan) -> list[ReshardGroup]:
    """Reshards grouped by (consumer kind and module with the layer index folded, layouts,
    collectives), costliest group first."""
    groups: dict[tuple, ReshardGroup] = {}
    for reshard in plan.reshards:
        if not reshard.collectives:
            continue
        kind, where = _where(plan.graph, reshard)
        signature = tuple((c.kind, c.axes, c.bytes) for c in reshard.collectives)
        key = (kind, where, reshard.src, reshard.dst, signature)
        group = groups.setdefault(key, ReshardGroup(reshard, where))
        group.count += reshard.count
        group.time += reshard.time
    return sorted(groups.values(), key=lambda g: (-g.time, -g.count))


# -- rendering ----------------------------------------------------------------------------------
LABEL_WIDTH = 15


def _row(label: str, text: str, width: int) -> list[str]:
    """``label`` then ``text`` wrapped under itself, between comma-separated items."""
    lines = [""]
    for item in text.split(", "):
        candidate = f"{lines[-1]}, {item}" if lines[-1] else item
        if len(candidate) + LABEL_WIDTH + 1 > width and lines[-1]:
            lines[-1] += ","
            lines.append(item)
        else:
            lines[-1] = candidate
    return [f"{label:<{LABEL_WIDTH}}{lines[0]}"] + [" " * LABEL_WIDTH + line for line in lines[1:]]


def _clip(line: str, width: int) -> str:
    return line if len(line) <= width else line[: width - 1] + "…"


def _collectives_by_kind(plan: Plan) -> str:
    from .report import format_seconds

    count: dict[str, int] = defaultdict(int)
    time: dict[str, float] = defaultdict(float)
    for reshard in plan.reshards:
        for c in reshard.collectives:
            count[c.kind] += reshard.count
            time[c.kind] += reshard.count * c.time
    for _, pair in table_exchanges(plan):  # table-wise lookups' scatters and gathers
        for c in pair:
            count[c.kind] += 1
            time[c.kind] += c.time
    kinds = sorted(count, key=lambda k: (-time[k], k))
    return ", ".join(f"{k} ×{count[k]} {format_seconds(time[k])}" for k in kinds)


def _owners_text(plan: Plan) -> str:
    """Each table-wise table and the position along its axes that holds it."""
    return (
        ", ".join(f"{o.module} on {'x'.join(o.axes)}={o.owner}" for o in plan.table_owners)
        + " (whole there; lookups scattered by all-to-all)"
    )


def header_lines(plan: Plan, width: int) -> list[str]:
    """Graph, mesh, step time and its split, memory by kind, strategy, solver."""
    from .report import _exposed, _pipeline_text, format_bytes, format_seconds

    mesh, solver = plan.mesh, plan.solver
    lines = _row("graph", f"@{plan.graph.name}: {len(plan.graph.inputs)} inputs, "
                 f"{len(plan.graph.ops)} ops", width)  # fmt: skip
    lines += _row("mesh", f"{mesh} = {mesh.size} devices, cluster {mesh.cluster}", width)
    lines += _row(
        "step time",
        f"{format_seconds(plan.step_time)} modelled (compute {format_seconds(plan.compute_time)}, "
        f"communication {format_seconds(plan.comm_time)}{_exposed(plan)})",
        width,
    )
    if plan.pipeline is not None:
        lines += _row("pipeline", _pipeline_text(plan), width)
    by_kind = _collectives_by_kind(plan)
    if by_kind:
        lines += _row("collectives", by_kind, width)
    breakdown = ", ".join(f"{kind} {format_bytes(n)}" for kind, n in sorted(plan.memory.items()))
    peak = format_bytes(plan.peak_memory_bytes)
    if plan.pipeline is not None:  # per device is per stage; the sub-mesh solve saw them all
        lines += _row("memory/device", stage_memory_text(plan), width)
    else:
        lines += _row("memory/device", f"{peak} peak ({breakdown or 'no breakdown'})", width)
        if plan.memory_limit:
            lines[-1] += f", limit {format_bytes(plan.memory_limit)}"
            if (trade := memory_trade(plan)) is not None:
                lines += _row("memory trade", trade, width)
    lines += _row("strategy", strategy_words(plan), width)
    if plan.table_owners:
        lines += _row("table-wise", _owners_text(plan), width)
    if plan.idle is not None:  # solver/idle.py: devices repeating the same work, and why
        text = textwrap.wrap(plan.idle.summary(), max(width - LABEL_WIDTH, 40))
        lines += [f"{'idle devices':<{LABEL_WIDTH}}{text[0]}"]
        lines += [" " * LABEL_WIDTH + line for line in text[1:]]
    wall = format_seconds(solver.wall_time) if solver.wall_time > 0 else "solve time not saved"
    lines += _row(
        "solver",
        f"{solver.status}, objective {format_seconds(solver.objective)}, gap {solver.gap:.2%}, "
        f"{wall}, {solver.num_variables} variables, {solver.num_choices} choices",
        width,
    )
    return lines


def _layout_lines(plan: Plan, width: int) -> list[str]:
    rows = layout_rows(plan)
    if not rows:
        return ["Layouts: the graph has no parameters"]
    shown = rows[:MAX_LAYOUT_ROWS]
    names = [r.name for r in shown]
    layouts = [_sharding_short_text(r.layout) for r in shown]
    updates = [_sharding_short_text(r.update) for r in shown]
    w_name = max(len("parameter"), *(len(n) for n in names))
    w_type = max(len("type"), *(len(r.type_text) for r in shown))
    w_layout = max(len("layout"), *(len(x) for x in layouts))
    has_update = any(updates)
    title = "Layouts (alike layers once"
    title += "; update: the optimizer states' layout)" if has_update else ")"
    head = f"  {'parameter':<{w_name}}  {'type':<{w_type}}  {'layout':<{w_layout}}"
    lines = [title, (head + ("  update" if has_update else "")).rstrip()]
    for name, row, layout, update in zip(names, shown, layouts, updates, strict=True):
        line = f"  {name:<{w_name}}  {row.type_text:<{w_type}}  {layout:<{w_layout}}  {update}"
        lines.append(_clip(line.rstrip(), width))
    if len(rows) > len(shown):
        lines.append(f"  ... {len(rows) - len(shown)} more kinds (the full report lists them)")
    return lines


def _sharding_short_text(text: str) -> str:
    return text.replace('"', "")


def _reshard_lines(plan: Plan, width: int) -> list[str]:
    from .report import format_bytes, format_seconds

    groups = reshard_groups(plan)
    if not groups:
        return ["Reshards: none with collectives; every value is consumed where it is produced"]
    total = sum(g.time for g in groups)
    count = sum(g.count for g in groups)
    lines = [
        f"Costliest reshards ({count} with collectives, {format_seconds(total)} before overlap;"
        f" alike layers grouped)"
    ]
    for group in groups[:MAX_RESHARD_ROWS]:
        r = group.example
        collectives = " + ".join(
            f"{c.kind}[{','.join(c.axes)}] {format_bytes(c.bytes)}" for c in r.collectives
        )
        kind = r.consumer.partition(":")[0]
        op = _consumer_op(plan.graph, r)
        if op is not None:
            target = f"{op.kind} in {group.where}" if group.where else op.kind
        elif kind == "alias":
            target = f"updated {group.where or 'input'}"
        else:
            target = r.consumer.replace(":", " ")
        head = f"  {format_seconds(group.time):>8} ×{group.count:<4} {collectives}"
        line = f"{head}: %{r.value} -> {target}"
        lines.append(_clip(line, width))
    if len(groups) > MAX_RESHARD_ROWS:
        lines.append(f"  ... {len(groups) - MAX_RESHARD_ROWS} more groups (plan.reshards)")
    return lines


def format_summary(plan: Plan, width: int) -> str:
    """The one-screen summary as plain text (deterministic for a given plan and width)."""
    lines = header_lines(plan, width)
    lines += ["", *_layout_lines(plan, width), "", *_reshard_lines(plan, width)]
    if (note := sub_axis_note(plan)) is not None:
        lines += ["", note]
    lines += ["", "Every value, op and reshard: plan.report(full=True), or --full in the CLI."]
    return "\n".join(lines) + "\n"


def sub_axis_note(plan: Plan) -> str | None:
    """The summary line for a plan whose layouts use Shardy sub-axes (``"x":(1)2``), or None:
    what each frontend does with them (``frontend/jax/emit.py``, ``frontend/torch/emit.py``)."""
    names = sorted(n for n, s in plan.shardings.items() if s.has_sub_axes)
    if not names:
        return None
    shown = ", ".join("%" + n for n in names[:3]) + (", ..." if len(names) > 3 else "")
    return (
        f"Sub-axes: {len(names)} layout{'s' if len(names) > 1 else ''} ({shown}) split a dim "
        "over part of a mesh axis "
        '("x":(1)2). plan.jit leaves them to XLA (no NamedSharding holds a sub-axis) and gives '
        "inputs and outputs their whole-axis prefix; torch refuses them."
    )
