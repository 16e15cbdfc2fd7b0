"""Table-wise tables placed on owners after the layout solve, and the plan priced that way.

The layout ILP solves a table-wise table as a data-parallel one (``table_strategies``: the
table whole, its lookups' bags split over the data axes). ``place_tables`` then gives each
such table an owner along its axes (``ir/table_wise.py``) and prices what changes:

- owners: tables in decreasing state bytes (table and optimizer states; lookups then index
  break ties), each onto the least loaded position by bytes (Graham's longest processing time
  first: within 4/3 of the best makespan, exact for alike tables that divide evenly);
- compute: the owner runs a table's lookups (forward and backward) for every bag of its
  share, ``n`` times a data-parallel device's share (``n`` positions along the axes); the step
  gets the busiest position's lookups instead of the data-parallel share of all;
- communication: the pooled rows' scatter and the gradient's gather per lookup
  (``costmodel/table_wise.py``), counted exposed (the pooled rows are read at once); the
  table gradient's pending sum over the axes is gone (the owner has the whole gradient), so
  its all-reduce (or reduce-scatter) shrinks to the other axes or vanishes;
- memory: the table and its optimizer states on the owner only: the busiest position's bytes
  instead of every table's (its gradient and the update's temporaries as the solve counted
  them, ``_KINDS``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..costmodel.cluster import cluster_of
from ..costmodel.op_times import plan_op_times
from ..costmodel.reshard import pricer
from ..costmodel.table_wise import exchanges
from ..ir import Graph, Role, Sharding, Value
from ..ir.errors import StrategyError
from ..ir.table_wise import TableOwner
from .plan import Plan, Reshard

LOOKUP, BACKWARD = "embedding_bag", "embedding_bag_backward"


@dataclasses.dataclass(frozen=True, slots=True)
class _Table:
    """One table-wise table of the graph: its weight, states, lookups and their backwards."""

    module: str
    weight: Value
    states: tuple[Value, ...]
    lookups: tuple[int, ...]
    backwards: tuple[int, ...]

    @property
    def state_bytes(self) -> int:
        return self.weight.type.nbytes + sum(v.type.nbytes for v in self.states)


def _tables(graph: Graph, modules: Mapping[str, tuple[str, ...]]) -> list[_Table]:
    weights = {
        v.origin.path.rpartition(".")[0]: v
        for v in graph.inputs
        if v.role is Role.PARAMETER and v.origin.path.rpartition(".")[0] in modules
    }
    out = []
    for module in modules:
        weight = weights[module]
        states = tuple(
            v for v in graph.inputs
            if v.role is Role.OPTIMIZER_STATE and v.origin.path.split("#")[0] == weight.origin.path
        )  # fmt: skip
        lookups = tuple(
            i for i, op in enumerate(graph.ops) if op.kind == LOOKUP and op.operands[0] is weight
        )
        backwards = tuple(
            i for i, op in enumerate(graph.ops)
            if op.kind == BACKWARD and op.origin.module == module
        )  # fmt: skip
        out.append(_Table(module, weight, states, lookups, backwards))
    return out


def assign_owners(sizes: list[tuple[int, float]], positions: int) -> list[int]:
    """An owner position per table, from its ``(bytes, lookups)``: longest first onto the
    least loaded position (module docstring); ties by position, so the answer is fixed."""
    loads = [(0, 0.0)] * positions
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i][0], -sizes[i][1], i)):
        best = min(range(positions), key=lambda p: (loads[p], p))
        owners[i] = best
        loads[best] = (loads[best][0] + sizes[i][0], loads[best][1] + sizes[i][1])
    return owners


def _check(plan: Plan, table: _Table, axes: tuple[str, ...]) -> None:
    """The solved layouts are a data-parallel table's over ``axes``, as the pins asked."""
    stored = plan.shardings[table.weight.name]
    for i in table.lookups:
        op = plan.graph.ops[i]
        result = plan.shardings[op.results[0].name]
        consumed = plan.operand_shardings[(i, 0)]
        trailing = result.dims[0][-len(axes) :] == axes  # the owner's share: the other axes
        ids = [plan.operand_shardings[(i, j)] for j in range(1, len(op.operands))]
        if any(layout.used_axes for layout in ids):
            raise StrategyError(
                f"table-wise table {table.module!r}: its lookup reads the ids split "
                f"({', '.join(map(str, ids))}); the owner pools every bag of its share and needs "
                "them whole: give the ids whole (jagged ids with offsets are pinned whole)"
            )
        if stored.used_axes or consumed.used_axes or not trailing or result.partial:
            raise StrategyError(
                f"table-wise table {table.module!r}: the plan stores it {stored}, reads it "
                f"{consumed} and pools {result}; table-wise needs the table whole and its bags "
                f"split over {list(axes)} (minor-most): pin it with "
                "sp.strategies.embedding(table_wise=...)"
            )


def _check_update(plan: Plan, table: _Table, axes: tuple[str, ...]) -> None:
    """The owner updates the table whole: no optimizer op reads its values split over ``axes``
    (a split update would mix the owner's gradient with the others' zeros)."""
    from .table_strategies import update_values

    names = {v.name for v in update_values(plan.graph, table.module, table.weight)}
    names |= {table.weight.name} | {v.name for v in table.states}
    names |= {plan.graph.ops[i].results[0].name for i in table.backwards}
    for i, op in enumerate(plan.graph.ops):
        for j, v in enumerate(op.operands):
            layout = plan.operand_shardings.get((i, j))
            if v.name in names and layout is not None and set(layout.used_axes) & set(axes):
                raise StrategyError(
                    f"table-wise table {table.module!r}: op {op.kind} in {op.origin.module} "
                    f"reads %{v.name} at {layout}, split over the table's axes {list(axes)}; "
                    "pin the table with sp.strategies.embedding(table_wise=...), which keeps "
                    "its update whole"
                )


def place_tables(plan: Plan, requests: Mapping[str, tuple[str, ...]]) -> Plan:
    """``plan`` with the tables ``requests`` names (module -> axes) placed table-wise."""
    tables = _tables(plan.graph, requests)
    owners: list[TableOwner] = []
    by_axes: dict[tuple[str, ...], list[_Table]] = {}
    for table in tables:
        _check(plan, table, requests[table.module])
        _check_update(plan, table, requests[table.module])
        by_axes.setdefault(requests[table.module], []).append(table)
    for axes, group in by_axes.items():
        sizes = [(t.state_bytes, _lookup_elements(plan.graph, t)) for t in group]
        picks = assign_owners(sizes, plan.mesh.group_size(axes))
        owners += [
            TableOwner(t.weight.name, t.module, axes, o) for t, o in zip(group, picks, strict=True)
        ]
    for owner in owners:
        owner.check(plan.mesh)
    split, gathered = _split_backwards(plan, tables)
    moved = dataclasses.replace(plan, operand_shardings=split[0], reshards=split[1])
    shardings, reshards, removed = _without_gradient_sums(moved, tables, requests)
    placed = dataclasses.replace(moved, shardings=shardings, reshards=reshards)
    return _priced(plan, placed, tables, tuple(owners), removed + gathered)


def _split_backwards(plan: Plan, tables: list[_Table]) -> tuple[tuple[dict, list], float]:
    """Each table-wise backward reads the bags' gradient split as its lookup's result (the
    gather to the owner replaces, e.g., an all-gather into it the solve chose for a
    data-parallel table): its reshard re-priced to there; the seconds that saves."""
    price = pricer(plan.mesh, cluster_of(plan.mesh))
    operands = dict(plan.operand_shardings)
    into: dict[str, Reshard | None] = {}
    for table in tables:
        result = plan.shardings[plan.graph.ops[table.lookups[0]].results[0].name]
        for i in table.backwards:
            operands[(i, 0)] = result
            grad = plan.graph.ops[i].operands[0]
            src = plan.shardings[grad.name]
            moves = price.collectives(src, result, grad.type)
            if moves is None:
                raise StrategyError(f"table-wise backward of {table.module!r}: the bags' "
                                    f"gradient {src} cannot move to {result}")  # fmt: skip
            consumer = f"op:{i}:0"
            into[consumer] = Reshard(grad.name, consumer, src, result, moves) if moves else None
    existing = {r.consumer for r in plan.reshards}
    kept = [into.get(r.consumer, r) for r in plan.reshards]
    kept += [r for c, r in into.items() if r is not None and c not in existing]
    saved = sum(r.time for r in plan.reshards) - sum(r.time for r in kept if r is not None)
    return (operands, [r for r in kept if r is not None]), saved


def _lookup_elements(graph: Graph, table: _Table) -> float:
    return sum(
        float(graph.ops[i].attrs.get("bags", 0)) * float(graph.ops[i].attrs.get("pooling", 1.0))
        for i in table.lookups
    )


def _without_gradient_sums(
    plan: Plan, tables: list[_Table], requests: Mapping[str, tuple[str, ...]]
) -> tuple[dict[str, Sharding], list[Reshard], float]:
    """Each table gradient's pending sum over its table's axes dropped (the owner's is whole),
    its reshards re-priced from there; the seconds of collectives that removes."""
    mesh = plan.mesh
    price = pricer(mesh, cluster_of(mesh))
    shardings = dict(plan.shardings)
    changed: dict[str, tuple[Sharding, Value]] = {}
    for table in tables:
        for i in table.backwards:
            grad = plan.graph.ops[i].results[0]
            bags = plan.operand_shardings[(i, 0)].dims[0]  # the other bag axes stay pending
            shardings[grad.name] = Sharding(
                shardings[grad.name].dims, frozenset(set(bags) - set(requests[table.module]))
            )
            changed[grad.name] = (shardings[grad.name], grad)
    reshards, removed = [], 0.0
    for r in plan.reshards:
        if r.value not in changed:
            reshards.append(r)
            continue
        src, grad = changed[r.value]
        moves = price.collectives(src, r.dst, grad.type) or ()
        removed += r.time - r.count * sum(c.time for c in moves)
        if src != r.dst:
            reshards.append(dataclasses.replace(r, src=src, collectives=tuple(moves)))
    added = _new_reductions(plan, changed, {r.consumer for r in plan.reshards}, price)
    return shardings, reshards + added, removed - sum(r.time for r in added)


def _new_reductions(plan: Plan, changed: dict, moved: set[str], price) -> list[Reshard]:  # type: ignore[no-untyped-def]
    """Reshards a gradient now needs where the solve had none: its pending sum over the other
    bag axes (placed along some of them only) reduced into each op that reads it whole."""
    out = []
    for i, op in enumerate(plan.graph.ops):
        for j, v in enumerate(op.operands):
            consumer = f"op:{i}:{j}"
            if v.name not in changed or consumer in moved:
                continue
            src, grad = changed[v.name]
            dst = plan.operand_shardings[(i, j)]
            if src != dst:
                moves = price.collectives(src, dst, grad.type) or ()
                out.append(Reshard(v.name, consumer, src, dst, tuple(moves)))
    return out


def table_exchanges(plan: Plan) -> list:
    """Every table-wise lookup's scatter and gather (``costmodel.table_wise.exchanges``), as
    ``(op index, collectives)`` in graph order."""
    owners = {o.table: o for o in plan.table_owners}
    out = []
    for i, op in enumerate(plan.graph.ops):
        owner = owners.get(op.operands[0].name) if op.kind == LOOKUP else None
        if owner is not None:
            out.append((i, exchanges(op, plan.shardings[op.results[0].name], owner, plan.mesh)))
    return out


def _priced(original: Plan, plan: Plan, tables: list[_Table], owners: tuple[TableOwner, ...],
            removed: float) -> Plan:  # fmt: skip
    """Costs and memory of ``plan`` (``original`` re-laid out) with its tables on ``owners``
    (module docstring)."""
    placed = dataclasses.replace(plan, table_owners=plan.table_owners + owners)
    added = sum(c.time for _, pair in table_exchanges(placed) for c in pair)
    added -= sum(c.time for _, pair in table_exchanges(plan) for c in pair)
    exposed = plan.comm_time if plan.exposed_comm_time is None else plan.exposed_comm_time
    memory, peak = _memory(plan, tables, owners)
    return dataclasses.replace(
        placed,
        compute_time=_compute(original, placed, tables, owners),
        comm_time=plan.comm_time - removed + added,
        exposed_comm_time=max(0.0, exposed - removed) + added,
        memory=memory,
        peak_memory_bytes=peak,
        memory_profile=None,
    )


def _compute(original: Plan, placed: Plan, tables: list[_Table],
             owners: tuple[TableOwner, ...]) -> float:  # fmt: skip
    """The step's compute with each table's lookups and backwards on its owner: the solve's
    seconds of them taken out, the busiest position's (``n`` x the data-parallel share of the
    bags, ``n`` positions along the axes) put in."""
    before, after = plan_op_times(original), plan_op_times(placed)
    shared, busiest = 0.0, {}
    for table, owner in zip(tables, owners, strict=True):
        ops = table.lookups + table.backwards
        shared += sum(before[i] for i in ops)
        key = (owner.axes, owner.owner)
        work = sum(after[i] for i in ops) * placed.mesh.group_size(owner.axes)
        busiest[key] = busiest.get(key, 0.0) + work
    return original.compute_time - shared + max(busiest.values(), default=0.0)


_KINDS = ("parameters", "optimizer_states")
"""Memory kinds a table holds whole (its weight, its optimizer states). Its gradient and the
update's temporaries are left as the solve counted them: those are the ones live at the
peak, not every table's (on the tiny DLRM the solve counts 22 KiB of gradients for 34 KiB
of tables), so taking every table's out would undercount."""


def _memory(plan: Plan, tables: list[_Table], owners: tuple[TableOwner, ...]) -> tuple:
    """Memory by kind and the peak with each table's bytes on its owner only: every table's
    bytes taken out, the busiest position's put in (kinds the solve did not count stay out)."""

    def sizes(t: _Table) -> tuple[int, int]:
        return (t.weight.type.nbytes, sum(v.type.nbytes for v in t.states))

    held: dict[tuple, list[int]] = {}
    every = [0, 0]
    for table, owner in zip(tables, owners, strict=True):
        mine = held.setdefault((owner.axes, owner.owner), [0, 0])
        for k, n in enumerate(sizes(table)):
            mine[k] += n
            every[k] += n
    counted = [kind in plan.memory for kind in _KINDS]
    most = max(held.values(), key=lambda b: sum(n for n, c in zip(b, counted, strict=True) if c),
               default=[0, 0])  # fmt: skip
    memory = dict(plan.memory)
    peak = plan.peak_memory_bytes
    for kind, total, mine, seen in zip(_KINDS, every, most, counted, strict=True):
        if seen:
            memory[kind] += mine - total
            peak += mine - total
    return memory, peak
