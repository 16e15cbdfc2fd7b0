"""Pricing table-wise lookups: the pooled rows' exchange, the owner's work and memory.

A table-wise table (``ir/table_wise.py``) is looked up on its owner for the bags of the
owner's share of the batch; the pooled block (``bags x dim``, those bags) is scattered to the
owner's group along the table's axes, each device receiving the slice of its own bags, and in
backward the bags' gradient is gathered back the same way. Both are one all-to-all on that
group in which only the owner sends (forward) or receives (backward): priced as an all-to-all
whose local tensor is the owner's block, which is what the owner moves ((n-1)/n of it over its
links: ``collectives._all_to_all_volume``). TorchRec batches every table's exchange into one
all-to-all; the emitters here issue one per lookup, and so does this price.

The ids are not exchanged: jagged ids are read whole by every device, as for row-wise tables
(``solver/table_strategies.py``), so the owner has them already.
"""

from __future__ import annotations

from ..ir import Mesh, Op, Sharding
from ..ir.table_wise import TableOwner
from .collectives import Collective, make_collective


def owner_bags(result: Sharding, owner: TableOwner, mesh: Mesh) -> tuple[str, ...]:
    """The axes the owner's share of the bags is split over: the result's bag axes but the
    table's own (along those the owner computes every bag and scatters them)."""
    return tuple(a for a in result.dims[0] if a not in owner.axes)


def block_bytes(op: Op, result: Sharding, owner: TableOwner, mesh: Mesh) -> int:
    """Bytes of the owner's pooled block for one lookup ``op`` (its first result)."""
    pooled = op.results[0].type
    split = mesh.group_size(owner_bags(result, owner, mesh))
    return pooled.nbytes // split


def exchanges(op: Op, result: Sharding, owner: TableOwner, mesh: Mesh) -> tuple[Collective, ...]:
    """The forward scatter and the backward gather of one table-wise lookup (module docstring)."""
    nbytes = block_bytes(op, result, owner, mesh)
    scatter = make_collective("all-to-all", nbytes, owner.axes, mesh)
    return (scatter, scatter)  # the gather back moves the same block the other way
