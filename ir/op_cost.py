"""What one op costs before any sharding choice: its global FLOPs (from its factor sizes and
registered flop model) and the HBM bytes one device moves for it (views move none)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .registry import bytes_model, op_info
from .rule_helpers import Attrs, Types
from .rules import ShardingRule

VIEW_KINDS: frozenset[str] = frozenset(
    {"reshape", "transpose", "broadcast_in_dim", "broadcast", "scan_carry", "scan_loop"}
)
"""Layout-only ops: no kernel reads or writes HBM for them. PyTorch runs ``view``, ``t``,
``transpose``, ``permute`` and ``expand`` as stride changes (a copy is traced as its own
``clone``/``copy``), cuBLAS reads a transposed operand through its ``op(A)`` flag, and XLA turns
reshapes and transposes into bitcasts or fuses them into their consumer. A loop's carry stays in
its buffer from one iteration to the next (``scan_carry``, ``scan_loop``)."""


IN_PLACE_WRITES: dict[str, int] = {"index_copy": -1, "dynamic_update_slice": 1}
"""Ops that write a slice of their first operand's buffer in place -> the operand index of the
written rows. A KV-cache write is one: torch's ``index_copy_`` mutates the buffer, and XLA runs
a ``dynamic-update-slice`` in place in its operand's buffer (always for a donated or loop-carried
buffer), so only the update is read and written."""


def op_bytes(  # type: ignore[no-untyped-def]
    kind: str,
    ins: Types,
    outs: Types,
    in_shards,
    out_shards,
    on_chip_ins: Sequence[bool] = (),
    on_chip_outs: Sequence[bool] = (),
    attrs: Attrs | None = None,
    split: int = 1,
) -> float:
    """HBM bytes one device moves for an op: its local operands and results; 0 for views.

    ``in_shards``/``out_shards``: the number of shards of each operand/result (layouts).
    ``on_chip_ins``/``on_chip_outs``: operands read and results kept on chip by a fused kernel
    (``costmodel.fusion``); they move no HBM bytes. Empty: none.
    ``attrs``/``split``: the op's attributes and its strategy's split (the product of the axes
    its factors use), for a kind with its own model (``register_bytes``)."""
    model = bytes_model(kind)
    if model is not None:
        return float(model(ins, outs, in_shards, out_shards, attrs or {}, split))
    if kind in VIEW_KINDS:
        return 0.0
    if kind in IN_PLACE_WRITES:  # reads the new rows and writes them, not the buffer
        k = IN_PLACE_WRITES[kind]
        return 2.0 * (ins[k].nbytes // in_shards[k])
    if kind in ("scan_index", "scan_stack"):  # slices read and written: scan_index runs once
        return 2.0 * (ins[0].nbytes // in_shards[0])  # for all of them, scan_stack per iteration
    skip_in = on_chip_ins or (False,) * len(ins)
    skip_out = on_chip_outs or (False,) * len(outs)
    total = sum(t.nbytes // n for t, n, s in zip(ins, in_shards, skip_in, strict=True) if not s)
    return total + sum(
        t.nbytes // n for t, n, s in zip(outs, out_shards, skip_out, strict=True) if not s
    )


def op_flops(
    kind: str, rule: ShardingRule, ins: Types, outs: Types, attrs: Attrs | None = None
) -> float:
    """Global FLOPs of one op, from its factor sizes (sharding divides them evenly).

    A causal fused attention (``attrs["causal"]``) does half the dense work: the kernel skips
    the key blocks above the diagonal (FlashAttention's count)."""
    info = op_info(kind)
    model = info.flops if info else "elementwise"
    if callable(model):
        return float(model(ins, outs, attrs or {}))
    if model == "dot":
        return 2.0 * math.prod(rule.size_of.values())
    if model in ("attention", "attention_backward"):
        backward = model == "attention_backward"
        causal = 0.5 if attrs and attrs.get("causal") else 1.0
        return _attention_flops(ins, backward) * (2.5 if backward else 1.0) * causal
    if model == "none":
        return 0.0
    if model == "attr":  # counted at capture (a shard_map body: ``ir/regions.py``)
        return float((attrs or {}).get("flops", 0.0))  # type: ignore[arg-type]
    return float(sum(t.numel for t in outs))


def _attention_flops(ins: Types, backward: bool) -> float:
    """QK^T and PV: 2*b*h*s*t*(d+e) from q[b,h,s,d], k[b,h,t,d], v[b,h,t,e].

    The backward of an attention op lists grad_out first; its q/k/v follow (see
    attention_backward), so the shapes are found by rank-4 operands in order.
    """
    four = [t.shape for t in ins if t.rank == 4][int(backward) :]
    if len(four) < 3:
        return float(sum(t.numel for t in ins))
    q, k, v = four[:3]
    b, h, s, d = q
    return 2.0 * b * h * s * k[2] * (d + v[3])
