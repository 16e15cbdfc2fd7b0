"""A one-block decoder with grouped-query attention, in pure JAX: a third model for the emission
matrix (``test_emission_matrix.py``) next to the examples' MLP and GPT.

Key/value heads are fewer than query heads and repeated (``jnp.repeat``) to meet them, so a
head split of k/v reaches the attention through a broadcast-like reshape; the update is SGD with
momentum (well conditioned: no Adam sign step to amplify reduction-order noise).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class GQAConfig:
    vocab: int = 64
    d_model: int = 32
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 64
    seq: int = 8
    batch: int = 8
    lr: float = 0.1
    momentum: float = 0.9

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def param_shapes(c: GQAConfig) -> dict[str, tuple[int, ...]]:
    kv = c.n_kv_heads * c.head_dim
    return {
        "embed": (c.vocab, c.d_model),
        "attn_norm": (c.d_model,),
        "wq": (c.d_model, c.d_model),
        "wk": (c.d_model, kv),
        "wv": (c.d_model, kv),
        "wo": (c.d_model, c.d_model),
        "mlp_norm": (c.d_model,),
        "w_up": (c.d_model, c.d_ff),
        "w_down": (c.d_ff, c.d_model),
        "unembed": (c.d_model, c.vocab),
    }


def _rms(x: jax.Array, gain: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * gain


def loss_fn(c: GQAConfig, p: dict, batch: dict) -> jax.Array:
    b, s = batch["tokens"].shape
    x = jnp.take(p["embed"], batch["tokens"], axis=0)
    h = _rms(x, p["attn_norm"])
    q = (h @ p["wq"]).reshape(b, s, c.n_heads, c.head_dim)
    k = (h @ p["wk"]).reshape(b, s, c.n_kv_heads, c.head_dim)
    v = (h @ p["wv"]).reshape(b, s, c.n_kv_heads, c.head_dim)
    group = c.n_heads // c.n_kv_heads
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bshd,bthd->bhst", q, k) / c.head_dim**0.5
    causal = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
    probs = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    x = x + jnp.einsum("bhst,bthd->bshd", probs, v).reshape(b, s, c.d_model) @ p["wo"]
    x = x + jax.nn.gelu(_rms(x, p["mlp_norm"]) @ p["w_up"]) @ p["w_down"]
    logp = jax.nn.log_softmax(x @ p["unembed"], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, batch["labels"][..., None], axis=-1))


def make(c: GQAConfig | None = None):
    """The training step and example ``(params, opt_state, batch)``."""
    c = c or GQAConfig()

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(c, p, batch))(params)
        mu = jax.tree.map(lambda m, g: c.momentum * m + g, opt_state["mu"], grads)
        params = jax.tree.map(lambda p, m: p - c.lr * m, params, mu)
        return params, {"mu": mu}, loss

    keys = jax.random.split(jax.random.key(1), 12)
    params = {}
    for key, (name, shape) in zip(keys, param_shapes(c).items(), strict=False):
        if len(shape) == 1:
            params[name] = jnp.ones(shape)
        else:
            params[name] = jax.random.normal(key, shape) / shape[0] ** 0.5
    tokens = jax.random.randint(keys[-1], (c.batch, c.seq + 1), 0, c.vocab)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    opt_state = {"mu": jax.tree.map(jnp.zeros_like, params)}
    return train_step, (params, opt_state, batch)
