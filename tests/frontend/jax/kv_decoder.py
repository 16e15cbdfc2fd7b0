"""A small grouped-query decoder in pure JAX with an explicit KV-cache pytree (issue 19).

The cache is one ``{"k", "v"}`` pair per layer, each ``[batch, kv_heads, context, head_dim]``
(or, with the layers under ``lax.scan``, one pair stacked over the layers),
passed as the argument ``cache`` (``sp.plan`` reads that key as ``Role.KV_CACHE``) and returned
updated: a step writes its keys/values at slots ``start .. start + tokens - 1`` with
``lax.dynamic_update_slice`` and attends over every slot up to its own position. A decode step
is one token per sequence at ``start = context - 1`` (the cache then holds ``context`` tokens);
a prefill writes the prompt at slot 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class DecoderConfig:
    vocab: int = 64
    d_model: int = 32
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 64
    layers: int = 2
    batch: int = 4
    context: int = 16
    prompt: int = 8

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def _rms(x: jax.Array, gain: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * gain


def init_params(c: DecoderConfig, rng: np.random.Generator) -> dict:
    kv = c.n_kv_heads * c.head_dim
    shapes = {
        "attn_norm": (c.d_model,), "wq": (c.d_model, c.d_model), "wk": (c.d_model, kv),
        "wv": (c.d_model, kv), "wo": (c.d_model, c.d_model), "mlp_norm": (c.d_model,),
        "w_up": (c.d_model, c.d_ff), "w_down": (c.d_ff, c.d_model),
    }  # fmt: skip

    def draw(shape: tuple[int, ...], scale: float) -> jax.Array:  # numpy: no compile per shape
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * scale)

    def weight(shape: tuple[int, ...]) -> jax.Array:
        return jnp.ones(shape, jnp.float32) if len(shape) == 1 else draw(shape, shape[0] ** -0.5)

    return {
        "embed": draw((c.vocab, c.d_model), 1.0),
        "layers": [{n: weight(s) for n, s in shapes.items()} for _ in range(c.layers)],
        "final_norm": jnp.ones((c.d_model,), jnp.float32),
        "unembed": draw((c.d_model, c.vocab), 1 / 8),
    }


def init_cache(c: DecoderConfig, rng: np.random.Generator) -> list[dict]:
    """A cache already holding ``context - 1`` tokens' keys/values (random: a decode step
    must read every slot)."""
    shape = (c.batch, c.n_kv_heads, c.context, c.head_dim)
    return [
        {kind: jnp.asarray(rng.standard_normal(shape, dtype=np.float32)) for kind in "kv"}
        for _ in range(c.layers)
    ]


def _block(c: DecoderConfig, layer: dict, kv: dict, x: jax.Array, start: int):
    """One decoder block: writes its keys/values into ``kv`` at ``start`` and attends over
    every slot up to each token's position."""
    b, s, _ = x.shape
    group = c.n_heads // c.n_kv_heads
    seen = jnp.arange(c.context)[None, :] <= (start + jnp.arange(s))[:, None]  # [s, context]
    h = _rms(x, layer["attn_norm"])
    q = (h @ layer["wq"]).reshape(b, s, c.n_heads, c.head_dim)
    k = (h @ layer["wk"]).reshape(b, s, c.n_kv_heads, c.head_dim).transpose(0, 2, 1, 3)
    v = (h @ layer["wv"]).reshape(b, s, c.n_kv_heads, c.head_dim).transpose(0, 2, 1, 3)
    keys = jax.lax.dynamic_update_slice(kv["k"], k, (0, 0, start, 0))
    values = jax.lax.dynamic_update_slice(kv["v"], v, (0, 0, start, 0))
    kr, vr = jnp.repeat(keys, group, axis=1), jnp.repeat(values, group, axis=1)
    scores = jnp.einsum("bshd,bhtd->bhst", q, kr) / c.head_dim**0.5
    probs = jax.nn.softmax(jnp.where(seen, scores, -1e9), axis=-1)
    attn = jnp.einsum("bhst,bhtd->bshd", probs, vr).reshape(b, s, c.d_model)
    x = x + attn @ layer["wo"]
    x = x + jax.nn.gelu(_rms(x, layer["mlp_norm"]) @ layer["w_up"]) @ layer["w_down"]
    return x, {"k": keys, "v": values}


def step(c: DecoderConfig, params: dict, cache, tokens: jax.Array, start: int, scan: bool):
    """One serving step: next-token logits ``[batch, vocab]`` and the updated cache (a list of
    per-layer pairs, or with ``scan`` one stacked pair under ``lax.scan``)."""
    x = jnp.take(params["embed"], tokens, axis=0)
    if scan:
        x, updated = jax.lax.scan(
            lambda h, lk: _block(c, lk[0], lk[1], h, start), x, (params["layers"], cache)
        )
    else:
        updated = []
        for layer, kv in zip(params["layers"], cache, strict=True):
            x, new = _block(c, layer, kv, x, start)
            updated.append(new)
    logits = _rms(x[:, -1], params["final_norm"]) @ params["unembed"]
    return logits, updated


def make(mode: str = "decode", c: DecoderConfig | None = None, scan: bool = False):
    """The step function of ``mode`` and its example ``(params, cache, tokens)``; ``scan``
    stacks the layers (and the cache: ``[layers, batch, kv_heads, context, head_dim]``)."""
    c = c or DecoderConfig()
    rng = np.random.default_rng(0)
    params, cache = init_params(c, rng), init_cache(c, rng)
    if scan:
        stack = lambda *rows: jnp.stack(rows)  # noqa: E731
        params["layers"] = jax.tree.map(stack, *params["layers"])
        cache = jax.tree.map(stack, *cache)
    tokens_shape = (c.batch, 1) if mode == "decode" else (c.batch, c.prompt)
    tokens = jnp.asarray(rng.integers(0, c.vocab, tokens_shape, dtype=np.int32))
    start = c.context - 1 if mode == "decode" else 0

    def serve_step(params, cache, tokens):
        return step(c, params, cache, tokens, start, scan)

    serve_step.__name__ = f"{mode}_step"
    return serve_step, (params, cache, tokens)
