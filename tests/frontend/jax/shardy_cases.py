"""Small JAX functions with seeded inputs, for the Shardy agreement harness (issue 17).

Each case is one op kind (or a small model) with some inputs seeded and the rest open, on a
1-D or 2-D mesh of 8 CPU devices. ``CASES`` is the suite ``test_shardy_agreement.py`` runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from shardplan.frontend.jax.agreement import Case

D1 = (("x", 8),)
D2 = (("dp", 2), ("tp", 4))
D42 = (("dp", 4), ("tp", 2))


def _softmax(x):
    return jax.nn.softmax(x, axis=-1)


def _layernorm(x, g):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * g


def _mlp(x, w1, w2):
    return jax.nn.gelu(x @ w1) @ w2


def _attention(x, wq, wk, wv, wo, heads=4):
    b, s, d = x.shape
    q = (x @ wq).reshape(b, s, heads, d // heads)
    k = (x @ wk).reshape(b, s, heads, d // heads)
    v = (x @ wv).reshape(b, s, heads, d // heads)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d)
    return out @ wo


def _gpt_block(x, g, wq, wk, wv, wo, w1, w2):
    h = x + _attention(_layernorm(x, g), wq, wk, wv, wo)
    return h + _mlp(_layernorm(h, g), w1, w2)


def _gqa(x, wq, wk, wv, wo, heads=8, kv=2):
    b, s, d = x.shape
    hd = d // heads
    q = (x @ wq).reshape(b, s, kv, heads // kv, hd)
    k = (x @ wk).reshape(b, s, kv, hd)
    v = (x @ wv).reshape(b, s, kv, hd)
    scores = jnp.einsum("bqgrd,bkgd->bgrqk", q, k)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bgrqk,bkgd->bqgrd", probs, v).reshape(b, s, d)
    return out @ wo


def _scan_mlp(x, ws):
    def body(h, w):
        return jnp.tanh(h @ w), None

    out, _ = jax.lax.scan(body, x, ws)
    return out


def _scan_carry(x, w):
    def body(h, _):
        return jnp.tanh(h @ w), None

    out, _ = jax.lax.scan(body, x, None, length=3)
    return out


def _constrained(x, w1, w2):
    h = jnp.tanh(x @ w1)
    h = jax.lax.with_sharding_constraint(h, P(None, "tp"))
    return h @ w2


def _cases() -> list[Case]:
    c: list[Case] = []

    def add(name, fn, shapes, seeds, mesh=D2, priorities=None):  # type: ignore[no-untyped-def]
        c.append(Case(name, fn, tuple(shapes), dict(seeds), mesh, dict(priorities or {})))

    # elementwise and broadcasting
    for mesh, spec in ((D1, P("x")), (D2, P("dp", "tp")), (D2, P(("dp", "tp")))):
        tag = "1d" if mesh is D1 else "2d"
        add(f"tanh-{tag}-{spec}", jnp.tanh, [(16, 32)], {0: spec}, mesh)
        add(f"add-fwd-{tag}-{spec}", jnp.add, [(16, 32), (16, 32)], {0: spec}, mesh)
    add(
        "add-both-seeded",
        jnp.add,
        [
            (16, 32),
            (16, 32),
        ],
        {0: P("dp"), 1: P(None, "tp")},
    )
    add("mul-bcast-row", lambda x, b: x * b, [(16, 32), (32,)], {0: P("dp", "tp")})
    add("mul-bcast-back", lambda x, b: x * b, [(16, 32), (32,)], {1: P("tp")})
    add("where", lambda x, y: jnp.where(x > 0, x, y), [(16, 32), (16, 32)], {1: P("tp")})
    # matmul / einsum
    add("matmul-batch-1d", jnp.matmul, [(64, 32), (32, 16)], {0: P("x")}, D1)
    add("matmul-col-1d", jnp.matmul, [(64, 32), (32, 16)], {1: P(None, "x")}, D1)
    add("matmul-contract-1d", jnp.matmul, [(64, 32), (32, 16)], {1: P("x")}, D1)
    add("matmul-dp-tp", jnp.matmul, [(64, 32), (32, 16)], {0: P("dp"), 1: P(None, "tp")})
    add("matmul-out-back", lambda x, w: jnp.tanh(x @ w), [(64, 32), (32, 16)], {1: P("tp")})
    add("matmul-lhs-both", jnp.matmul, [(64, 32), (32, 16)], {0: P("dp", "tp")})
    add(
        "bmm",
        lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
        [(8, 16, 32), (8, 32, 16)],
        {0: P("dp", None, "tp")},
    )
    add(
        "einsum-outer",
        lambda a, b: jnp.einsum("i,j->ij", a, b),
        [(16,), (32,)],
        {0: P("dp"), 1: P("tp")},
    )
    add("mlp-dp", _mlp, [(64, 32), (32, 128), (128, 32)], {0: P("dp")})
    add("mlp-megatron", _mlp, [(64, 32), (32, 128), (128, 32)], {1: P(None, "tp")})
    add("mlp-dp-tp", _mlp, [(64, 32), (32, 128), (128, 32)], {0: P("dp"), 1: P(None, "tp")})
    add("mlp-w2-row", _mlp, [(64, 32), (32, 128), (128, 32)], {2: P("tp")})
    # reductions
    add("sum-kept-dim", lambda x: x.sum(1), [(16, 32)], {0: P("dp", "tp")})
    add("sum-sharded-dim", lambda x: x.sum(0), [(16, 32)], {0: P("dp", "tp")})
    add("max-1d", lambda x: x.max(-1), [(16, 32)], {0: P(None, "x")}, D1)
    add("softmax-rows", _softmax, [(16, 32)], {0: P("dp")})
    add("softmax-cols", _softmax, [(16, 32)], {0: P(None, "tp")})
    add("layernorm", _layernorm, [(16, 32), (32,)], {0: P("dp")})
    add("layernorm-gamma", _layernorm, [(16, 32), (32,)], {1: P("tp")})
    add("argmax", lambda x: jnp.argmax(x, -1), [(16, 32)], {0: P("dp", "tp")})
    add("cumsum", lambda x: jnp.cumsum(x, 1), [(16, 32)], {0: P("dp", "tp")})
    # layout ops
    add("transpose", lambda x: x.T, [(16, 32)], {0: P("dp", "tp")})
    add("transpose-3d", lambda x: x.transpose(2, 0, 1), [(8, 16, 32)], {0: P("dp", None, "tp")})
    add("reshape-split", lambda x: x.reshape(16, 4, 8), [(16, 32)], {0: P("dp", "tp")})
    add("reshape-merge", lambda x: x.reshape(16, 32), [(16, 4, 8)], {0: P("dp", "tp")})
    add("reshape-merge-minor", lambda x: x.reshape(16, 32), [(16, 4, 8)], {0: P("dp", None, "tp")})
    add("reshape-flatten-1d", lambda x: x.reshape(-1), [(16, 32)], {0: P("x")}, D1)
    add("expand-dims", lambda x: x[:, None, :], [(16, 32)], {0: P("dp", "tp")})
    add("squeeze", lambda x: x[:, 0, :], [(16, 1, 32)], {0: P("dp", None, "tp")})
    add("broadcast", lambda x: jnp.broadcast_to(x, (8, 16, 32)), [(16, 32)], {0: P("dp", "tp")})
    add(
        "concat-free-dim",
        lambda a, b: jnp.concatenate([a, b], 1),
        [(16, 32), (16, 32)],
        {0: P("dp")},
    )
    add(
        "concat-other-operand",
        lambda a, b: jnp.concatenate([a, b], 1),
        [(16, 32), (16, 32)],
        {1: P("dp")},
    )
    add("slice-free-dim", lambda x: x[:, :16], [(16, 32)], {0: P("dp")})
    add("pad-free-dim", lambda x: jnp.pad(x, ((0, 0), (0, 8))), [(16, 32)], {0: P("dp")})
    add("rev-free-dim", lambda x: x[::-1, :] * 2, [(16, 32)], {0: P(None, "tp")})
    add("iota-add", lambda x: x + jnp.arange(32.0), [(16, 32)], {0: P("dp", "tp")})
    # gathers
    add(
        "take-rows",
        lambda t, i: jnp.take(t, i.astype(jnp.int32), axis=0),
        [(128, 32), (16,)],
        {0: P(None, "tp")},
    )
    add(
        "take-ids-dp",
        lambda t, i: jnp.take(t, i.astype(jnp.int32), axis=0),
        [(128, 32), (16,)],
        {1: P("dp")},
    )
    # models
    add("attention-dp", _attention, [(8, 16, 32)] + [(32, 32)] * 4, {0: P("dp")})
    add("attention-heads", _attention, [(8, 16, 32)] + [(32, 32)] * 4, {1: P(None, "tp")})
    add(
        "gpt-block-dp",
        _gpt_block,
        [(8, 16, 32), (32,), *[(32, 32)] * 4, (32, 128), (128, 32)],
        {0: P("dp")},
    )
    add(
        "gpt-block-megatron",
        _gpt_block,
        [(8, 16, 32), (32,), *[(32, 32)] * 4, (32, 128), (128, 32)],
        {0: P("dp"), 6: P(None, "tp")},
    )
    add("gqa-dp", _gqa, [(8, 16, 64), (64, 64), (64, 16), (64, 16), (64, 64)], {0: P("dp")})
    add(
        "gqa-kv-heads",
        _gqa,
        [(8, 16, 64), (64, 64), (64, 16), (64, 16), (64, 64)],
        {0: P("dp"), 2: P(None, "tp")},
    )
    add("scan-stacked-w-1d", _scan_mlp, [(16, 32), (3, 32, 32)], {0: P("x")}, D1)
    add("scan-stacked-w-2d", _scan_mlp, [(16, 32), (3, 32, 32)], {0: P("dp")})
    add("scan-carry-w", _scan_carry, [(16, 32), (32, 32)], {0: P("dp")})
    # constraints inside the function
    add("constraint-only", _constrained, [(64, 32), (32, 128), (128, 32)], {})
    add("constraint-and-dp", _constrained, [(64, 32), (32, 128), (128, 32)], {0: P("dp")})
    # the cases the issue names as open questions: resized sharded dims, sub-axes, conflicts,
    # loop carries tied to pinned weights
    add("slice-sharded-dim", lambda x: x[:8, :], [(16, 32)], {0: P("dp", "tp")})
    add(
        "concat-sharded-dim",
        lambda a, b: jnp.concatenate([a, b], 0),
        [(16, 32), (16, 32)],
        {0: P("dp", "tp")},
    )
    add("pad-sharded-dim", lambda x: jnp.pad(x, ((0, 16), (0, 0))), [(16, 32)], {0: P("dp")})
    add(
        "dynamic-slice-sharded",
        lambda x: jax.lax.dynamic_slice_in_dim(x, 4, 8, 0),
        [(16, 32)],
        {0: P("dp", "tp")},
    )
    add("reshape-sub-axis", lambda x: x.reshape(8, 64), [(16, 32)], {0: P(None, "tp")})
    add("reshape-split-sharded", lambda x: x.reshape(4, 4, 32), [(16, 32)], {0: P(("dp", "tp"))})
    add("conflict-elementwise", jnp.add, [(16, 32), (16, 32)], {0: P("tp"), 1: P(None, "tp")})
    add("conflict-matmul", jnp.matmul, [(64, 32), (32, 16)], {0: P("tp"), 1: P(None, "tp")})
    add("scan-carry-from-pinned-w", _scan_carry, [(16, 32), (32, 32)], {1: P(None, "tp")})
    add("scan-stacked-w-pinned", _scan_mlp, [(16, 32), (3, 32, 32)], {1: P(None, None, "tp")})
    add(
        "fori-loop",
        lambda x, w: jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w), x),
        [(16, 32), (32, 32)],
        {0: P("dp")},
    )
    add(
        "dynamic-update-slice",
        lambda x, u: jax.lax.dynamic_update_slice_in_dim(x, u, 0, 1),
        [(16, 32), (16, 8)],
        {0: P("dp")},
    )
    add("sort-rows", lambda x: jnp.sort(x, axis=-1), [(16, 32)], {0: P("dp", "tp")})
    add("top-k", lambda x: jax.lax.top_k(x, 4)[0], [(16, 32)], {0: P("dp")})
    add(
        "scatter-add-rows",
        lambda t, u: t.at[jnp.arange(4)].add(u),
        [(128, 32), (4, 32)],
        {0: P(None, "tp")},
    )
    add("reshape-sub-axis-1d", lambda x: x.reshape(4, 4) * 2, [(16,)], {0: P("x")}, D1)
    add("reshape-sub-axis-2d", lambda x: x.reshape(4, 64), [(8, 32)], {0: P(("dp", "tp"))})
    add("conflict-dims-add", jnp.add, [(16, 32), (16, 32)], {0: P("dp"), 1: P(None, "dp")})
    add(
        "conflict-matmul-tp", jnp.matmul, [(64, 32), (32, 16)], {0: P(None, "tp"), 1: P(None, "tp")}
    )
    add(
        "fori-loop-pinned-w",
        lambda x, w: jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w), x),
        [(16, 32), (32, 32)],
        {1: P(None, "tp")},
    )
    add(
        "gpt-block-1d",
        _gpt_block,
        [(8, 16, 32), (32,), *[(32, 32)] * 4, (32, 128), (128, 32)],
        {0: P("x")},
        D1,
    )
    add(
        "take-vocab-sharded",
        lambda t, i: jnp.take(t, i.astype(jnp.int32), axis=0),
        [(128, 32), (16,)],
        {0: P("tp")},
    )
    add(
        "einsum-bcast-batch",
        lambda a, b: jnp.einsum("bsd,de->bse", a, b),
        [(8, 16, 32), (32, 64)],
        {0: P("dp", "tp")},
    )
    add("gqa-1d", _gqa, [(8, 16, 64), (64, 64), (64, 16), (64, 16), (64, 64)], {0: P("x")}, D1)
    add("mlp-1d-megatron", _mlp, [(64, 32), (32, 128), (128, 32)], {1: P(None, "x")}, D1)
    add(
        "conflict-matmul-rows-small-lhs",
        jnp.matmul,
        [(16, 32), (32, 256)],
        {0: P("tp"), 1: P("tp")},
    )
    add(
        "conflict-matmul-cols-big-lhs",
        jnp.matmul,
        [(64, 32), (32, 64)],
        {0: P(None, "tp"), 1: P(None, "tp")},
    )
    # the same models on a (4, 2) mesh
    add("mlp-dp-tp-42", _mlp, [(64, 32), (32, 128), (128, 32)], {0: P("dp"), 1: P(None, "tp")}, D42)
    add(
        "gpt-block-megatron-42",
        _gpt_block,
        [(8, 16, 32), (32,), *[(32, 32)] * 4, (32, 128), (128, 32)],
        {0: P("dp"), 6: P(None, "tp")},
        D42,
    )
    add(
        "gqa-kv-heads-42",
        _gqa,
        [(8, 16, 64), (64, 64), (64, 16), (64, 16), (64, 64)],
        {0: P("dp"), 2: P(None, "tp")},
        D42,
    )
    add("attention-heads-42", _attention, [(8, 16, 32)] + [(32, 32)] * 4, {1: P(None, "tp")}, D42)
    add(
        "scan-stacked-w-pinned-42",
        _scan_mlp,
        [(16, 32), (3, 32, 32)],
        {1: P(None, None, "tp")},
        D42,
    )
    add(
        "concat-sharded-dim-42",
        lambda a, b: jnp.concatenate([a, b], 0),
        [(16, 32), (16, 32)],
        {0: P(("dp", "tp"))},
        D42,
    )
    _priority_cases(add)
    _region_cases(add)
    _sub_axis_cases(add)
    return c


def _region(body, in_specs, out_specs):  # type: ignore[no-untyped-def]
    """A ``shard_map`` over the harness's mesh (``jax.set_mesh`` around lowering and capture)."""
    return jax.shard_map(body, in_specs=in_specs, out_specs=out_specs)


def _region_tanh(x):
    return _region(jnp.tanh, P("dp", "tp"), P("dp", "tp"))(x)


def _region_then_matmul(x, w):
    return _region(jnp.tanh, P("dp", None), P("dp", None))(x) @ w


def _matmul_into_region(x, w):
    return _region(lambda h: h * 2.0, P(None, "tp"), P(None, "tp"))(x @ w)


def _region_1d(x, y):
    return _region(jnp.tanh, P("x"), P("x"))(x) + y


def _region_cases(add) -> None:  # type: ignore[no-untyped-def]
    """``shard_map`` bodies are opaque: their in/out specs pin the tensors around them."""
    add("region-open-input", _region_tanh, [(16, 32)], {})
    add("region-then-matmul", _region_then_matmul, [(16, 32), (32, 64)], {})
    add("matmul-into-region", _matmul_into_region, [(16, 32), (32, 64)], {})
    add("region-1d", _region_1d, [(16, 32), (16, 32)], {}, D1)


def _two_paths(x, y, z):
    """Two seeds that meet only at an add through open tensors, and an open input ``z``."""
    return jnp.tanh(x) + jnp.tanh(y) + z


def _priority_cases(add) -> None:  # type: ignore[no-untyped-def]
    """Shardy's user priorities on conflicting seeds: the lower ``pN`` propagates first."""
    sq = [(16, 16)] * 3
    rows, cols = P("dp", None), P(None, "dp")
    for tag, prio in (
        ("x0-y1", {0: 0, 1: 1}),
        ("x1-y0", {0: 1, 1: 0}),
        ("y0", {1: 0}),
        ("x1", {0: 1}),
    ):
        add(f"prio-{tag}", _two_paths, sq, {0: rows, 1: cols}, priorities=prio)
    add("prio-1d-x1-y0", _two_paths, sq, {0: P("x"), 1: P(None, "x")}, D1, {0: 1, 1: 0})
    mlp = [(64, 32), (32, 128), (128, 32)]
    add("prio-mlp-w1-first", _mlp, mlp, {0: P("tp"), 1: P(None, "tp")}, priorities={0: 1, 1: 0})
    add("prio-mlp-x-first", _mlp, mlp, {0: P("tp"), 1: P(None, "tp")}, priorities={0: 0, 1: 1})


def _round_trip(x):
    """(8,16) -> (2,4,16) -> sin -> (8,16): dim 0 on tp=4 splits into sub-axes and merges back."""
    return jnp.sin(x.reshape(2, 4, 16)).reshape(8, 16)


def _merge_into(x, y):
    """An open (2,4,16) merged to (8,16) and added to a seeded (8,16): sub-axes go backward."""
    return jnp.cos(x).reshape(8, 16) + y


def _heads_round_trip(x):
    """Attention's head split: (16,32) -> (2,8,4,8) -> transpose -> tanh -> back to (16,32)."""
    h = jnp.tanh(x.reshape(2, 8, 4, 8).transpose(0, 2, 1, 3))
    return h.transpose(0, 2, 1, 3).reshape(16, 32)


def _open_through_split(x, y):
    """A seeded and an open (8,16), both split to (2,4,16) and multiplied: the open input
    gets the seed's layout back through its own split (sub-axes in between)."""
    return jnp.sin(x.reshape(2, 4, 16)) * y.reshape(2, 4, 16)


def _split_dot(x, w):
    """(8,16) split to (2,4,16), a dot with an open weight, merged back to (8,32)."""
    return jnp.einsum("abk,kn->abn", x.reshape(2, 4, 16), w).reshape(8, 32)


def _split_add(x, y):
    """(16,) on x=8 split to (2,8) and added to an open (2,8), then flattened again."""
    return (x.reshape(2, 8) + y).reshape(16)


def _three_way(x):
    """x=8 over a dim split three ways (2,2,2): x:(1)2, x:(2)2, x:(4)2, merged back."""
    return jnp.sin(x.reshape(2, 2, 2, 16)).reshape(8, 16)


def _two_axes(x):
    """dp=4 x tp=2 over a dim of 64 split (2,32): dp splits, tp follows on the minor dim."""
    return jnp.cos(x.reshape(2, 32, 8)).reshape(64, 8)


def _strided_add(x, y):
    """(8,16) on (dp, tp) viewed as (16,8): tp's minor half reaches the new minor dim only
    (its major half would sit under an unsplit factor), then meets an open (16,8)."""
    return x.reshape(16, 8) + y


def _attention_2_heads(x, wq, wk, wv, wo):
    return _attention(x, wq, wk, wv, wo, heads=2)


def _sub_axis_cases(add) -> None:  # type: ignore[no-untyped-def]
    """Reshapes that split or merge a dim inside a mesh axis: Shardy's sub-axes ``"x":(1)2``.
    Sub-axes never appear at a jit boundary (Shardy strips them), so each case either merges
    them back into whole axes or reads a stripped layout (docs/design.md)."""
    add("subaxis-round-trip", _round_trip, [(8, 16)], {0: P("tp", "dp")})
    add("subaxis-round-trip-42", _round_trip, [(8, 16)], {0: P("dp")}, D42)
    add("subaxis-split-out", lambda x: jnp.sin(x.reshape(2, 4, 16)), [(8, 16)], {0: P("tp", "dp")})
    add("subaxis-merge-open-in", _merge_into, [(2, 4, 16), (8, 16)], {1: P("tp")})
    add("subaxis-heads-42", _heads_round_trip, [(16, 32)], {0: P("dp", "tp")}, D42)
    add("subaxis-heads-2d-minor", _heads_round_trip, [(16, 32)], {0: P(("tp", "dp"))})
    add("subaxis-open-in", _open_through_split, [(8, 16), (8, 16)], {0: P("tp", "dp")})
    add("subaxis-split-dot", _split_dot, [(8, 16), (16, 32)], {0: P("tp")})
    add("subaxis-1d", _split_add, [(16,), (2, 8)], {0: P("x")}, D1)
    add("subaxis-three-way-1d", _three_way, [(8, 16)], {0: P("x")}, D1)
    add("subaxis-two-axes-42", _two_axes, [(64, 8)], {0: P(("dp", "tp"))}, D42)
    add("subaxis-strided-add", _strided_add, [(8, 16), (16, 8)], {0: P("dp", "tp")})
    # attention with fewer heads (2) than tp (4): tp straddles the head and head-dim factors
    attn = [(8, 16, 32)] + [(32, 32)] * 4
    add("subaxis-attention-wq", _attention_2_heads, attn, {1: P(None, "tp")})
    qkv = {0: P("dp"), 1: P(None, "tp"), 2: P(None, "tp"), 3: P(None, "tp")}
    add("subaxis-attention-qkv", _attention_2_heads, attn, qkv)
    add("subaxis-attention-1d", _attention_2_heads, attn, {1: P(None, "x")}, D1)


CASES = _cases()
