"""The sharding rule of a write into a slice of a buffer: ``dynamic_update_slice``.

``dynamic_update_slice(operand, update, *starts) -> out``: ``out`` is ``operand`` with the
block ``update`` written at ``starts``. XLA emits it for ``lax.dynamic_update_slice`` (a KV
cache's slots). Start indices are operands.

Dims the update covers whole pass through operand, update and result. A dim it covers in part
needs replication (which rows a device holds would change with the write); the update's own
part of that dim gets its own need-replication factor. Start indices are scalars without dims.
"""

from __future__ import annotations

from .registry import register_rule
from .rule_helpers import Attrs, Types, _letter_stream, _make
from .rules import ShardingRule


def dynamic_update_slice(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """Whole dims pass through; partly updated dims need replication (module docstring)."""
    operand, update = ins[0], ins[1]
    letters = _letter_stream()
    sizes: dict[str, int] = {}
    need: set[str] = set()
    operand_dims, update_dims = [], []
    for size, part in zip(operand.shape, update.shape, strict=True):
        f = next(letters)
        sizes[f] = size
        operand_dims.append((f,))
        if part == size:
            update_dims.append((f,))
            continue
        g = next(letters)
        sizes[g] = part
        need.update((f, g))
        update_dims.append((g,))
    operands = [operand_dims, update_dims] + [[] for _ in ins[2:]]
    return _make(operands, [list(operand_dims)], sizes, need)


register_rule("dynamic_update_slice", dynamic_update_slice, flops="none")
