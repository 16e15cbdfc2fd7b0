"""Why a tensor has its layout: ``plan.explain(name)`` and ``shardplan explain plan.json NAME``.

The question a user asks of a plan is local ("why is this weight replicated?"), so the answer is
a counterfactual on that one tensor, everything else as planned: each other layout the tensor
could have (its candidate strategies), priced with the same cost model the solver used —

- compute: the producing op's roofline time under the alternative strategy (op results only);
- communication: the collectives on every edge that touches the tensor (from its producer's
  operands, to each consumer's planned operand layout, back to a parameter's stored layout);
- memory: the tensor's bytes per device (persistent for parameters and optimizer states);

and the verdict names what decided it: a user pin, the memory budget (a faster alternative
does not fit), or the cost component by which the runner-up loses. A single-tensor change can
look cheaper than the plan's layout: the solver decides alike layers together, merges
followers with their leader and optimises overlap; the verdict then says so.
"""

from __future__ import annotations

import difflib
import math
import textwrap
from dataclasses import dataclass, field

from ..costmodel import cluster_of, reshard_time
from ..costmodel.fusion import fusion
from ..costmodel.op_times import _op_time
from ..ir import Op, Sharding, Value
from ..ir.errors import UnknownTensorError
from ..ir.moe import dedup_buffers, wire_type
from ..passes.enumerate_strategies import input_choices, op_choices, value_layouts
from .plan import Plan
from .report import format_bytes, format_seconds

MAX_ALTERNATIVES = 4
"""Alternatives listed (the cheapest first)."""


@dataclass(frozen=True, slots=True)
class Alternative:
    """One layout the tensor could have had, and what it would change (seconds, bytes)."""

    layout: Sharding
    compute: float
    """Change of the producing op's compute time (0 for a graph input)."""
    communication: float
    """Change of the collectives' time on the tensor's edges."""
    memory: int
    """Change of the tensor's bytes per device."""
    fits: bool
    """The plan's peak plus ``memory`` stays within the memory budget."""

    @property
    def time(self) -> float:
        return self.compute + self.communication


@dataclass(frozen=True, slots=True)
class Explanation:
    """The chosen layout of one tensor, the alternatives, and what decided between them."""

    name: str
    value: Value
    chosen: Sharding
    bytes_per_device: int
    alternatives: tuple[Alternative, ...]
    """Cheapest first (modelled time difference); at most ``MAX_ALTERNATIVES``."""
    decided_by: str
    repeats: int = 1
    """Alike layers that share this decision (the solver chooses them together)."""
    considered: int = field(default=0)
    """Distinct layouts priced."""

    @property
    def runner_up(self) -> Alternative | None:
        fitting = [a for a in self.alternatives if a.fits]
        return fitting[0] if fitting else None

    def __str__(self) -> str:
        v = self.value
        origin = v.origin.path or v.origin.module or ""
        origin = "" if origin == self.name else origin
        lines = [
            f"{self.name}: %{v.name} {v.type} ({v.role.value}{', ' + origin if origin else ''})",
            f"  chosen     {self.chosen}  ({format_bytes(self.bytes_per_device)} per device)",
        ]
        if self.repeats > 1:
            lines.append(f"  shared     with {self.repeats - 1} alike layers (one decision)")
        lines.append(
            f"  considered {self.considered} layouts; cheapest alternatives (Δ vs chosen):"
        )
        for a in self.alternatives:
            fits = "" if a.fits else "  exceeds the memory budget"
            lines.append(
                f"    {a.layout!s:<28} time {_signed(a.time)} (compute {_signed(a.compute)}, "
                f"communication {_signed(a.communication)}), memory "
                f"{_signed_bytes(a.memory)}{fits}"
            )
        if not self.alternatives:
            lines.append("    none: this is the only layout the tensor can have here")
        lines += textwrap.wrap(
            self.decided_by, 100, initial_indent="  decided by ", subsequent_indent=" " * 13
        )
        return "\n".join(lines)


def _signed(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "impossible"
    return ("+" if seconds >= 0 else "-") + format_seconds(abs(seconds))


def _signed_bytes(n: int) -> str:
    return ("+" if n >= 0 else "-") + format_bytes(abs(n))


# -- finding the tensor -------------------------------------------------------------------------
def find_value(plan: Plan, name: str) -> Value:
    """A value by name (``%t_25`` or ``t_25``) or by origin path (a parameter's FQN)."""
    values = {v.name: v for v in plan.graph.values()}
    key = name[1:] if name.startswith("%") else name
    if key in values:
        return values[key]
    by_path = {v.origin.path: v for v in plan.graph.inputs if v.origin.path}
    if name in by_path:
        return by_path[name]
    close = difflib.get_close_matches(name, [*by_path, *values], n=3)
    hint = f"did you mean {', '.join(close)}?" if close else "give a value name or a parameter path"
    raise UnknownTensorError(f"the plan has no tensor named {name!r}; {hint}")


# -- pricing one tensor's edges -----------------------------------------------------------------
class _Pricer:
    """Prices edges of one tensor under the plan's other layouts (seconds per step)."""

    def __init__(self, plan: Plan) -> None:
        self.plan, self.mesh = plan, plan.stage_mesh
        self.cluster = cluster_of(plan.mesh)
        self.position = {op: i for i, op in enumerate(plan.graph.ops)}
        self.buffers = dedup_buffers(plan.graph)

    def move(self, src: Sharding, dst: Sharding, value: Value, count: int = 1) -> float:
        if src == dst:
            return 0.0
        moved = wire_type(value.type, self.buffers.get(value), src, dst, self.mesh)
        return count * reshard_time(src, dst, moved, self.mesh, self.cluster)

    def to_consumers(self, value: Value, layout: Sharding) -> float:
        """Collectives from ``layout`` to every consumer's planned operand layout, and to the
        layout a graph output leaves in (an updated parameter: its stored layout)."""
        total = 0.0
        for use in value.uses:
            i = self.position[use.op]
            wanted = self.plan.operand_shardings[(i, use.index)]
            total += self.move(layout, wanted, value, use.op.repeat)
        graph = self.plan.graph
        for j, out in enumerate(graph.outputs):
            if out is not value:
                continue
            if j in graph.output_aliases:
                wanted = self.plan.shardings[graph.inputs[graph.output_aliases[j]].name]
            elif j < len(self.plan.output_shardings):
                wanted = self.plan.output_shardings[j]
            else:
                wanted = layout.without_partial()
            total += self.move(layout, wanted, value)
        return total

    def stored_back(self, value: Value, layout: Sharding) -> float:
        """An updated parameter's way back to its stored layout (the output alias edge)."""
        graph, total = self.plan.graph, 0.0
        index = graph.inputs.index(value) if value.producer is None else -1
        for j, k in graph.output_aliases.items():
            if k == index:
                out = graph.outputs[j]
                total += self.move(self.plan.shardings[out.name], layout, out)
        return total

    def bytes(self, value: Value, layout: Sharding) -> int:
        return value.type.nbytes // layout.shard_count(self.mesh)


def _input_alternatives(plan: Plan, value: Value, pricer: _Pricer) -> list[Alternative]:
    chosen = plan.shardings[value.name]
    base = pricer.to_consumers(value, chosen) + pricer.stored_back(value, chosen)
    budget = plan.memory_limit or math.inf
    out = []
    if value.pinned:  # a pin leaves one strategy; price the layouts it excluded
        layouts = value_layouts(value.type, pricer.mesh)
    else:
        layouts = [s.results[0] for s in input_choices(value, pricer.mesh)]
    for layout in layouts:
        if layout == chosen:
            continue
        comm = pricer.to_consumers(value, layout) + pricer.stored_back(value, layout) - base
        memory = pricer.bytes(value, layout) - pricer.bytes(value, chosen)
        out.append(
            Alternative(layout, 0.0, comm, memory, plan.peak_memory_bytes + memory <= budget)
        )
    return out


def _op_alternatives(plan: Plan, value: Value, pricer: _Pricer) -> list[Alternative]:
    """Per distinct layout of ``value``, the cheapest strategy of its producer that makes it."""
    op: Op = value.producer  # type: ignore[assignment]
    i, k = pricer.position[op], op.results.index(value)
    fused = fusion(plan.graph).of(op)
    operands = [plan.operand_shardings[(i, j)] for j in range(len(op.operands))]
    results = [plan.shardings[r.name] for r in op.results]
    base = _op_price(plan, op, operands, results, pricer, fused)
    chosen = plan.shardings[value.name]
    budget = plan.memory_limit or math.inf
    best: dict[Sharding, Alternative] = {}
    for strategy in op_choices(op, pricer.mesh):
        layout = strategy.results[k]
        if layout == chosen:
            continue
        compute, comm = _op_price(plan, op, strategy.operands, strategy.results, pricer, fused)
        memory = pricer.bytes(value, layout) - pricer.bytes(value, chosen)
        candidate = Alternative(
            layout, compute - base[0], comm - base[1], memory,
            plan.peak_memory_bytes + max(memory, 0) <= budget,
        )  # fmt: skip
        if layout not in best or candidate.time < best[layout].time:
            best[layout] = candidate
    return list(best.values())


def _op_price(plan, op, operands, results, pricer: _Pricer, fused) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(compute, communication) of ``op`` at these layouts, its results sent to their readers."""
    compute = op.repeat * _op_time(
        op, tuple(operands), tuple(results), pricer.mesh, pricer.cluster, fused
    )
    comm = sum(
        pricer.move(plan.shardings[v.name], operands[j], v, op.repeat)
        for j, v in enumerate(op.operands)
    )
    comm += sum(pricer.to_consumers(r, results[k]) for k, r in enumerate(op.results))
    return compute, comm


# -- the verdict --------------------------------------------------------------------------------
def _verdict(value: Value, alternatives: list[Alternative], repeats: int) -> str:
    if value.pinned and value.sharding is not None:
        return "a user pin (the layout was given, not chosen)"
    if not alternatives:
        return "the shape and mesh: no other layout divides this tensor"
    faster_over = [a for a in alternatives if not a.fits and a.time < 0]
    fitting = [a for a in alternatives if a.fits]
    if faster_over and (not fitting or fitting[0].time >= 0):
        return (
            f"the memory budget: {faster_over[0].layout} would be "
            f"{format_seconds(-faster_over[0].time)} faster but needs "
            f"{format_bytes(faster_over[0].memory)} more per device than fits"
        )
    if not fitting:
        return "the memory budget: no other layout fits"
    runner = fitting[0]
    if runner.time < 0:
        shared = f"{repeats} alike layers decided together, " if repeats > 1 else ""
        return (
            f"the solver's whole-graph objective ({shared}followers merged with their leader, "
            f"overlap counted): alone, {runner.layout} would save {format_seconds(-runner.time)}"
        )
    parts = {"communication": runner.communication, "compute": runner.compute}
    if abs(runner.time) < 1e-9:
        if runner.memory > 0:
            return (
                f"memory: {runner.layout} costs the same time but holds "
                f"{format_bytes(runner.memory)} more per device"
            )
        if runner.memory < 0:
            return (
                f"where the collectives run: {runner.layout} costs the same collective time "
                f"(at another point of the step) and holds {format_bytes(-runner.memory)} less; "
                "the solver's overlap-aware edge prices (how much of a collective compute "
                "hides), not the plain collective time, favour the planned layout"
            )
        return "a tie: the runner-up costs the same (the solver's deterministic order decided)"
    cost = max(parts, key=lambda p: parts[p])
    return (
        f"{cost} cost: the runner-up {runner.layout} costs {format_seconds(parts[cost])} more "
        f"{cost} per step"
    )


def explain(plan: Plan, name: str) -> Explanation:
    """Why ``name`` (a value name or parameter path) has its layout in ``plan``."""
    value = find_value(plan, name)
    pricer = _Pricer(plan)
    if value.producer is None:
        alternatives = _input_alternatives(plan, value, pricer)
    else:
        alternatives = _op_alternatives(plan, value, pricer)
    alternatives.sort(key=lambda a: (not a.fits, a.time, a.memory, str(a.layout)))
    repeats = _repeats(plan, value)
    return Explanation(
        name, value, plan.shardings[value.name], pricer.bytes(value, plan.shardings[value.name]),
        tuple(alternatives[:MAX_ALTERNATIVES]), _verdict(value, alternatives, repeats), repeats,
        len(alternatives) + 1,
    )  # fmt: skip


def _repeats(plan: Plan, value: Value) -> int:
    """How many alike layers share this tensor's decision (1 if it is not in a layer stack)."""
    from .summary import _pattern

    path = value.origin.path if value.producer is None else (value.producer.origin.module or "")
    pattern, index = _pattern(path)
    if index is None:
        return 1
    if value.producer is None:
        return sum(
            1
            for v in plan.graph.inputs
            if v.role is value.role and _pattern(v.origin.path)[0] == pattern
        )
    return len({_pattern(op.origin.module or "")[1] for op in plan.graph.ops
                if _pattern(op.origin.module or "")[0] == pattern})  # fmt: skip


__all__ = ["Alternative", "Explanation", "UnknownTensorError", "explain", "find_value"]
