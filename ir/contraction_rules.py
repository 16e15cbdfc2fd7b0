"""Rule builders of contracting and indexing ops: dot_general, matmul and einsum, embedding
lookups, fused (grouped-query) attention, indexed writes and the general gather."""

from __future__ import annotations

from .rule_helpers import (
    Attrs,
    Types,
    _broadcast_map,
    _letter_stream,
    _letters,
    _make,
    replicated_rule,
)
from .rules import ShardingRule
from .types import TensorType


def dot_general(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """XLA dot_general: batch pairs, lhs free, rhs free -> result; contracting pairs reduce.

    Attributes: ``lhs_contracting``, ``rhs_contracting``, ``lhs_batch``, ``rhs_batch`` (tuples).
    """
    lhs, rhs = ins[0], ins[1]
    lc, rc = (
        list(attrs.get("lhs_contracting", (lhs.rank - 1,))),
        list(attrs.get("rhs_contracting", (0,))),
    )  # type: ignore[arg-type]
    lb, rb = list(attrs.get("lhs_batch", ())), list(attrs.get("rhs_batch", ()))  # type: ignore[arg-type]
    letters = _letter_stream()
    lhs_f: list[str] = [""] * lhs.rank
    rhs_f: list[str] = [""] * rhs.rank
    sizes: dict[str, int] = {}
    out: list[str] = []
    for dl, dr in zip(lb, rb, strict=True):
        f = next(letters)
        lhs_f[dl], rhs_f[dr], sizes[f] = f, f, lhs.shape[dl]
        out.append(f)
    for dl, dr in zip(lc, rc, strict=True):
        f = next(letters)
        lhs_f[dl], rhs_f[dr], sizes[f] = f, f, lhs.shape[dl]
    for factors, t in ((lhs_f, lhs), (rhs_f, rhs)):
        for d in range(t.rank):
            if not factors[d]:
                f = next(letters)
                factors[d], sizes[f] = f, t.shape[d]
                out.append(f)
    result = [(f,) if sizes[f] == s else () for f, s in zip(out, outs[0].shape, strict=True)]
    return _make([[(f,) for f in lhs_f], [(f,) for f in rhs_f]], [result], sizes)


def matmul(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """numpy/torch matmul ``[...,m,k] @ [...,k,n]`` with broadcast batch dims (incl. 1-D cases)."""
    lhs, rhs, out = ins[0], ins[1], outs[0]
    letters = _letters(out.rank + 1)
    k = letters[-1]
    sizes = dict(zip(letters, out.shape, strict=False))
    sizes[k] = lhs.shape[-1]
    lhs_dims = _broadcast_map(
        TensorType(lhs.shape[:-1] + (1,) * (rhs.rank > 1), lhs.dtype), out, letters
    )
    if rhs.rank == 1:
        rhs_dims: list[tuple[str, ...]] = [(k,)]
        lhs_dims = [*_broadcast_map(TensorType(lhs.shape[:-1], lhs.dtype), out, letters), (k,)]
    else:
        # a 1-D lhs drops the m dim from the result, so rhs's k dim has no result dim to face
        rows = (1,) if lhs.rank > 1 else ()
        rhs_dims = _broadcast_map(
            TensorType((*rhs.shape[:-2], *rows, rhs.shape[-1]), rhs.dtype), out, letters
        )
        rhs_dims[-2:-1] = [(k,)]
    if lhs.rank == 1:
        lhs_dims = [(k,)]
    else:
        lhs_dims[-1] = (k,)
        if rhs.rank > 1:
            lhs_dims[-2] = (letters[out.rank - 2],) if lhs.shape[-2] == out.shape[-2] else ()
    return _make([lhs_dims, rhs_dims], [[(f,) for f in letters[: out.rank]]], sizes)


def einsum(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """``equation`` attribute in einsum notation, e.g. ``"bsh,hf->bsf"``."""
    equation = str(attrs["equation"]).replace(" ", "")
    return ShardingRule.from_spec(equation, [t.shape for t in ins], [t.shape for t in outs])


def embedding(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """table[v,h] indexed by ids[...] -> out[...,h]; a vocab split leaves partial sums."""
    table, ids = ins[0], ins[1]
    letters = _letters(ids.rank + 2)
    v, h, batch = letters[0], letters[1], letters[2:]
    sizes = {v: table.shape[0], h: table.shape[1], **dict(zip(batch, ids.shape, strict=True))}
    result = [(f,) for f in batch] + [(h,)]
    return _make([[(v,), (h,)], [(f,) for f in batch]], [result], sizes)


def embedding_backward(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """grad[...,h], ids[...] -> table_grad[v,h]: tokens reduce; a device may own a vocab slice."""
    ids, out = ins[1], outs[0]
    letters = _letters(ids.rank + 2)
    v, h, batch = letters[0], letters[1], letters[2:]
    sizes = {v: out.shape[0], h: out.shape[1], **dict(zip(batch, ids.shape, strict=True))}
    grad_dims = [(f,) for f in batch] + [(h,)]
    return _make([grad_dims, [(f,) for f in batch]], [[(v,), (h,)]], sizes)


def _heads(q_heads: int, kv_heads: int) -> tuple[dict[str, int], tuple[str, ...]]:
    """Factor sizes and the query head dim for (grouped-query) attention.

    Query head ``i`` reads key/value head ``i // r`` (``r = q_heads / kv_heads``, PyTorch's
    ``enable_gqa`` and JAX's grouped layout), so the query head dim is the compound ``(h, r)``:
    splitting ``h`` keeps every group with its key/value head. ``r`` needs replication.
    """
    if q_heads == kv_heads or kv_heads <= 0 or q_heads % kv_heads:
        return {"h": q_heads}, ("h",)
    return {"h": kv_heads, "r": q_heads // kv_heads}, ("h", "r")


def attention(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """Fused attention q[b,h,s,d], k[b,h,t,d], v[b,h,t,e] -> o[b,h,s,e] (+ lse[b,h,s]).

    Batch, heads and queries split freely; keys (softmax axis) and the contracted head dim d need
    replication; the value head dim e passes through. A causal mask needs no extra factor.
    Grouped-query attention (fewer key/value heads) splits heads by key/value group.
    """
    q, k, v = ins[0], ins[1], ins[2]
    heads, qh = _heads(q.shape[1], k.shape[1])
    sizes = dict(b=q.shape[0], s=q.shape[2], d=q.shape[3], t=k.shape[2], e=v.shape[3], **heads)
    operands = [[("b",), qh, ("s",), ("d",)], [("b",), ("h",), ("t",), ("d",)]]
    operands.append([("b",), ("h",), ("t",), ("e",)])
    operands += [[("b",), qh, ("s",), ("t",)][: t.rank] for t in ins[3:]]  # mask
    results = [[("b",), qh, ("s",), ("e",)]] + [[("b",), qh, ("s",)] for _ in outs[1:]]
    return _make(operands, results, sizes, {"d", "t", "r"})


def attention_backward(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """(grad_o, q, k, v, o, lse) -> (grad_q, grad_k, grad_v).

    Batch and heads split freely. The query sequence ``s`` may split too (context
    parallelism): each device takes its queries' rows with every key and value (``t`` needs
    replication, so K/V arrive all-gathered), its dQ rows are final, and its dK/dV are its
    queries' share of a sum over all queries: ``s`` is *summed* into results 1 and 2, which
    come out partial over its axes (a reduce-scatter or all-reduce follows).
    """
    g, q, k = ins[0], ins[1], ins[2]
    heads, qh = _heads(q.shape[1], k.shape[1])
    sizes = dict(b=q.shape[0], s=q.shape[2], d=q.shape[3], t=k.shape[2], e=g.shape[3], **heads)
    by_name = {
        "g": [("b",), qh, ("s",), ("e",)], "q": [("b",), qh, ("s",), ("d",)],
        "k": [("b",), ("h",), ("t",), ("d",)], "v": [("b",), ("h",), ("t",), ("e",)],
        "o": [("b",), qh, ("s",), ("e",)], "lse": [("b",), qh, ("s",)],
    }  # fmt: skip
    order = ["g", "q", "k", "v", "o", "lse"]
    operands = [by_name[order[i]] if i < len(order) else [] for i in range(len(ins))]
    results = [by_name["q"], by_name["k"], by_name["v"]][: len(outs)]
    summed = (("s", tuple(range(1, len(results)))),) if len(results) > 1 else ()
    need = {"d", "t", "e", "r"} | (set() if summed else {"s"})
    return _make(operands, results, sizes, need, summed)


def index_copy(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """``index_copy(buffer, index, rows)`` along ``dim`` (a KV-cache write): every other dim of
    the buffer, the rows and the result is one factor; ``dim`` itself may not be split (which
    slots are written is data), nor the index."""
    buf, index, rows = ins
    dim = int(attrs.get("dim", 0)) % buf.rank  # type: ignore[call-overload]
    letters = _letters(buf.rank + 2)
    sizes = {letters[d]: buf.shape[d] for d in range(buf.rank)}
    new, idx = letters[buf.rank], letters[buf.rank + 1]
    sizes[new], sizes[idx] = rows.shape[dim], index.shape[0] if index.rank else 1
    full = [(letters[d],) for d in range(buf.rank)]
    row_dims = [(new,) if d == dim else (letters[d],) for d in range(buf.rank)]
    index_dims = [(idx,)] if index.rank else []
    need = {letters[dim], new, idx}
    return _make([full, index_dims, row_dims], [full], sizes, need)


def gather_rows(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """General gather/index fallback: data dims need replication, index dims pass through."""
    return replicated_rule(ins, outs)
