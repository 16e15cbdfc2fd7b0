"""Hand-written layouts of embedding tables (recommendation models), as strategy pins.

``sp.strategies.embedding`` names, per table, how it is split over the mesh; everything else
(dense layers, the batch, optimizer states) follows a base strategy (plain data parallel by
default)::

    strategy = sp.strategies.embedding(
        row_wise=["emb.0", "emb.1"],     # rows (vocabulary) split: masked local lookups,
        column_wise=["emb.2"],           #   the pooled result a pending sum (reduce-scatter)
        data_parallel=["emb.3"],         # columns split; or the table whole, bags split
        table_wise=["emb.4"],            # the table whole on one device of ``axes`` (owner)
        axes=("dp", "tp"),               # the mesh axes tables split over (default: all)
        base=sp.strategies.dp(),         # the rest
    )
    plan = sp.evaluate(model, dense, ids, offsets, mesh=mesh, strategy=strategy).plan

A table is named by its module path (``"emb.0"``, an ``fnmatch`` pattern like ``"emb.*"``
for several), or given with its own axes as ``{"emb.0": ("tp",)}``. Its optimizer states
are laid out like it. The ids and offsets of a jagged lookup are pinned whole (every device
reads them: the bags a device pools are picked by data; ``ir/embedding_bag.py``); tables not
named follow ``base``. ``nn.EmbeddingBag`` and ``nn.Embedding`` tables both count.

A table-wise table (``ir/table_wise.py``; bag lookups only) is pinned as a data-parallel one
(the table whole, its lookups' bags split over the data axes, which must include its axes);
after the solve, ``finish`` gives each such table an owner along its axes, balanced by bytes
(``solver/table_wise.py``), and prices it there: the lookups on the owner, the pooled rows'
exchange, no gradient all-reduce, the table's state on the owner only.

Errors name the table and the fix: a name no table has, a table named twice, a split that
does not divide the table, and a row-wise max-pooling table (a max over some rows is no part
of a sum: split its columns instead).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterable, Mapping

from ..ir import Graph, Mesh, Role, Sharding, Value
from .plan import Plan
from .strategies import ParallelStrategy, StrategyError, dp
from .table_wise import place_tables

LOOKUPS = ("embedding_bag", "embedding")
"""Op kinds whose operand 0 is a table (``embedding``'s is too: torch's ``aten.embedding``)."""
KINDS = ("row_wise", "column_wise", "data_parallel", "table_wise")
WHOLE = ("data_parallel", "table_wise")
"""Kinds whose table is whole (in the SPMD layouts) and whose lookups split their bags."""
TableSpec = Iterable[str] | Mapping[str, Iterable[str]]


@dataclasses.dataclass(frozen=True, slots=True)
class TableStrategy(ParallelStrategy):
    """A base strategy plus a layout per named table (module docstring)."""

    tables: tuple[tuple[str, str, tuple[str, ...] | None], ...] = ()
    """(name or pattern, kind, axes or None for the strategy's ``axes``) per entry."""
    table_axes: tuple[str, ...] | None = None
    """Mesh axes tables split over by default (None: every axis of size > 1)."""

    def check(self, mesh: Mesh) -> None:
        ParallelStrategy.check(self, mesh)
        for name, _, axes in self.tables:
            for axis in axes or self.table_axes or ():
                if axis not in mesh.axis_names:
                    raise StrategyError(
                        f"{self.name}: table {name!r} splits over {axis!r}, not an axis of the "
                        f"mesh {mesh} (axes {list(mesh.axis_names)})"
                    )

    def pins(self, graph: Graph, mesh: Mesh) -> dict[str, Sharding]:
        pins = ParallelStrategy.pins(self, graph, mesh)
        tables = table_lookups(graph)
        chosen = self._assign(tables)
        for module, kind in chosen.items():
            name, axes = kind
            table, modes = tables[module]
            layout = self._layout(module, table, name, axes, modes, mesh)
            pins[table.name] = layout
            for v in graph.inputs:
                if v.role is Role.OPTIMIZER_STATE and v.origin.path.split("#")[0] == (
                    table.origin.path
                ):
                    pins[v.name] = layout if v.type == table.type else pins.get(v.name, layout)
        for module, (kind, _) in chosen.items():
            if kind == "table_wise":  # the owner updates the table whole: no sliced update
                for v in update_values(graph, module, tables[module][0]):
                    pins[v.name] = Sharding.replicated(v.type.rank)
        for v in whole_index_inputs(graph):
            pins[v.name] = Sharding.replicated(v.type.rank)
        data = self.data_axes(mesh)
        for op in graph.ops:  # each lookup runs as its table's kind says, not only its storage
            module = op.operands[0].origin.path.rpartition(".")[0] if op.operands else ""
            kind = chosen.get(module, ("",))[0]
            if op.kind != "embedding_bag" or not kind:
                continue
            if kind == "table_wise" and op.attrs.get("per_sample_weights"):
                raise StrategyError(
                    f"{self.name}: table {module!r} is looked up with per-sample weights, which "
                    "table-wise placement does not run; name it in row_wise or data_parallel"
                )
            if kind in WHOLE:  # each device pools (or receives) its own bags
                pins[op.results[0].name] = _on_bags(op.results[0], data, mesh)
            else:
                pins[op.results[0].name] = _pooled(pins[op.operands[0].name], kind)
        return pins

    def table_wise(self, graph: Graph, mesh: Mesh) -> dict[str, tuple[str, ...]]:
        """Table-wise table module -> the mesh axes it is placed along (mesh order)."""
        chosen = self._assign(table_lookups(graph))
        data = self.data_axes(mesh)
        out = {}
        for module, (kind, axes) in chosen.items():
            if kind != "table_wise":
                continue
            along = axes if axes is not None else self.table_axes
            if along is None:
                along = tuple(a for a in data if mesh.axis_size(a) > 1)
            if not along or not set(along) <= set(data):
                raise StrategyError(
                    f"{self.name}: table-wise table {module!r} is placed along "
                    f"{list(along)}, which must be one or more of the data axes {list(data)} "
                    "(its lookups' bags split over them); name data axes in axes=..."
                )
            out[module] = tuple(a for a in mesh.axis_names if a in along)
        return out

    def finish(self, plan: Plan) -> Plan:
        """The solved plan with its table-wise tables placed on owners (``place_tables``)."""
        requests = self.table_wise(plan.graph, plan.mesh)
        return place_tables(plan, requests) if requests else plan

    def _assign(self, tables: dict) -> dict[str, tuple[str, tuple[str, ...] | None]]:
        """Table module -> (kind, axes), every entry matching at least one table, once."""
        chosen: dict[str, tuple[str, tuple[str, ...] | None]] = {}
        for pattern, kind, axes in self.tables:
            matched = [m for m in tables if m == pattern or fnmatch.fnmatchcase(m, pattern)]
            if not matched:
                raise StrategyError(
                    f"{self.name}: no embedding table in module {pattern!r}; the graph's "
                    f"tables are {sorted(tables) or 'none'}"
                )
            for module in matched:
                if module in chosen and chosen[module][0] != kind:
                    raise StrategyError(
                        f"{self.name}: table {module!r} is named {chosen[module][0]} and {kind}; "
                        "give each table one layout"
                    )
                chosen[module] = (kind, axes)
        return chosen

    def _layout(self, module: str, table: Value, kind: str, axes: tuple[str, ...] | None,
                modes: set[str], mesh: Mesh) -> Sharding:  # fmt: skip
        if kind == "table_wise" and modes - {"sum", "mean"}:
            raise StrategyError(
                f"{self.name}: table {module!r} is looked up with {sorted(modes - {'sum', 'mean'})}"
                "; table-wise placement runs sum and mean nn.EmbeddingBag lookups only: name it "
                "in row_wise, column_wise or data_parallel"
            )
        if kind in WHOLE:
            return Sharding.replicated(table.type.rank)
        split = axes if axes is not None else self.table_axes
        if split is None:
            split = tuple(a for a in mesh.axis_names if mesh.axis_size(a) > 1)
        dim = 0 if kind == "row_wise" else 1
        if dim == 0 and "max" in modes:
            raise StrategyError(
                f"{self.name}: table {module!r} pools with max, which cannot be row-wise (a max "
                "over some rows is no part of a sum); name it in column_wise or data_parallel"
            )
        size = table.type.shape[dim]
        if size % mesh.group_size(split):
            raise StrategyError(
                f"{self.name}: table {module!r} has {size} {'rows' if dim == 0 else 'columns'}, "
                f"not a multiple of {mesh.group_size(split)} ({' x '.join(split)}); split it "
                "over fewer axes (axes=... or {name: axes})"
            )
        dims: list[tuple[str, ...]] = [(), ()]
        dims[dim] = tuple(split)
        return Sharding(tuple(dims))


def _pooled(table: Sharding, kind: str) -> Sharding:
    """A lookup's pooled ``[bags, dim]`` result for a table at ``table``: row-wise, a pending
    sum over the rows' axes (each device pools the ids it owns); column-wise, the columns split."""
    rows, columns = table.dims
    if kind == "row_wise":
        return Sharding(((), ()), partial=frozenset(rows))
    return Sharding(((), tuple(columns)))


def _on_bags(out: Value, axes: tuple[str, ...], mesh: Mesh) -> Sharding:
    """A pooled result split over its bags on ``axes`` (whole when they do not divide)."""
    if not axes or out.type.shape[0] % mesh.group_size(axes):
        return Sharding.replicated(out.type.rank)
    return Sharding((tuple(axes),) + ((),) * (out.type.rank - 1))


def table_lookups(graph: Graph) -> dict[str, tuple[Value, set[str]]]:
    """Table module path -> (its weight, the pooling modes it is looked up with)."""
    out: dict[str, tuple[Value, set[str]]] = {}
    for op in graph.ops:
        if op.kind not in LOOKUPS or not op.operands:
            continue
        table = op.operands[0]
        if table.role is not Role.PARAMETER:
            continue
        module = table.origin.path.rpartition(".")[0]
        entry = out.setdefault(module, (table, set()))
        entry[1].add(str(op.attrs.get("mode", "lookup")))
    return out


def update_values(graph: Graph, module: str, table: Value) -> list[Value]:
    """The optimizer's values of a table's update: those of the table's shape it makes from
    the table, its optimizer states and its gradient (the backward of its lookups)."""
    todo = [
        op.results[0]
        for op in graph.ops
        if op.kind == "embedding_bag_backward" and op.origin.module == module
    ]
    todo += [v for v in graph.inputs if v.origin.path.split("#")[0] == table.origin.path]
    seen: set[str] = set()
    out: list[Value] = []
    while todo:
        v = todo.pop()
        for user in v.users:
            if user.origin.module != "optimizer":
                continue
            for r in user.results:
                if r.name not in seen and r.type.shape == table.type.shape:
                    seen.add(r.name)
                    out.append(r)
                    todo.append(r)
    return out


def whole_index_inputs(graph: Graph) -> list[Value]:
    """Graph inputs the ids, offsets or weights of jagged bag lookups are made from (directly,
    or through views and sums: a torchrec ``KeyedJaggedTensor``'s lengths become offsets)."""
    seen: set[str] = set()
    out: list[Value] = []
    todo = [
        v
        for op in graph.ops
        if op.kind == "embedding_bag" and not op.attrs.get("fixed_bag")
        for v in op.operands[1:]
    ]
    while todo:
        v = todo.pop()
        if v.name in seen:
            continue
        seen.add(v.name)
        if v.producer is None:
            if v.role is Role.INPUT:
                out.append(v)
        else:
            todo.extend(v.producer.operands)
    return out


def _entries(kind: str, spec: TableSpec) -> list[tuple[str, str, tuple[str, ...] | None]]:
    if isinstance(spec, str):
        raise StrategyError(f"{kind}= takes a list of table modules, not the string {spec!r}")
    if isinstance(spec, Mapping):
        return [(name, kind, _axes(kind, name, axes)) for name, axes in spec.items()]
    return [(str(name), kind, None) for name in spec]


def _axes(kind: str, name: str, axes: object) -> tuple[str, ...]:
    if isinstance(axes, str):
        return (axes,)
    if not isinstance(axes, (tuple, list)) or not all(isinstance(a, str) for a in axes):
        raise StrategyError(f"{kind}[{name!r}] takes mesh axis names, e.g. ('tp',), not {axes!r}")
    return tuple(axes)


def embedding(
    row_wise: TableSpec = (),
    column_wise: TableSpec = (),
    data_parallel: TableSpec = (),
    table_wise: TableSpec = (),
    axes: Iterable[str] | str | None = None,
    base: ParallelStrategy | None = None,
) -> TableStrategy:
    """Tables laid out by hand over a base strategy (module docstring)."""
    base = base if base is not None else dp()
    if isinstance(base, TableStrategy):
        raise StrategyError("base= takes a dense strategy (sp.strategies.dp(), fsdp(), ...)")
    entries = []
    for kind, spec in zip(KINDS, (row_wise, column_wise, data_parallel, table_wise), strict=True):
        entries += _entries(kind, spec)
    if not entries:
        raise StrategyError(
            "sp.strategies.embedding() names no table; give row_wise=, column_wise=, "
            "data_parallel= or table_wise= module paths (e.g. row_wise=['emb.0'])"
        )
    table_axes = (axes,) if isinstance(axes, str) else tuple(axes) if axes is not None else None
    short = {"row_wise": "row", "column_wise": "col", "data_parallel": "dp", "table_wise": "tw"}
    label = ";".join(f"{short[k]}:{n}" for n, k, _ in entries)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    fields["name"] = f"tables[{label}]+{base.name}"
    return TableStrategy(**fields, tables=tuple(entries), table_axes=table_axes)
