"""The embedding tables of a captured graph (its ``embedding_bag`` ops) as ``TableSpec`` values."""

from __future__ import annotations

from shardplan.costmodel.embedding import DTYPE_BYTES, TableSpec, TableSpecError
from shardplan.ir.graph import Graph


def tables_from_graph(graph: Graph) -> list[TableSpec]:
    """One ``TableSpec`` per table a forward ``embedding_bag`` op reads (shared tables once).

    Name: the table parameter's path (its origin), rows and dim from its type, the pooling
    factor from the op's ``pooling`` attribute (the example's ids per bag, or the user's).
    """
    out: dict[str, TableSpec] = {}
    for op in graph.ops:
        if op.kind != "embedding_bag":
            continue
        table = op.operands[0]
        name = table.origin.path or table.name
        if name in out:
            continue
        rows, dim = table.type.shape
        dtype = table.type.dtype if table.type.dtype in DTYPE_BYTES else "f32"
        pooling = float(op.attrs.get("pooling", 1.0))  # type: ignore[arg-type]
        out[name] = TableSpec(name, rows, dim, max(pooling, 1e-9), dtype)
    if not out:
        raise TableSpecError(
            f"graph @{graph.name} has no embedding_bag op: nothing for plan_tables to plan "
            "(pass TableSpec values, or a model with nn.EmbeddingBag tables)"
        )
    return list(out.values())
