"""A GPT-style decoder training step in pure JAX (embedding, causal attention, RMSNorm, SwiGLU,
cross-entropy, AdamW by hand), planned by shardplan on 8 simulated CPU devices.

Run as a script: ``python examples/jax_gpt.py [--scan]``. Tests and benches import ``make()``.
With ``scan_layers=True`` the layers are stacked and run under ``lax.scan``, as real JAX LLMs do.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # must happen before jax is imported
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from dataclasses import dataclass

import jax
import jax.numpy as jnp

Params = dict


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 128
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 128
    seq: int = 16
    batch: int = 8
    scan_layers: bool = False
    dtype: str = "float32"
    lr: float = 1e-3
    weight_decay: float = 0.1
    adam_eps: float = 1e-8

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def _layer_shapes(c: GPTConfig) -> dict[str, tuple[int, ...]]:
    return {
        "attn_norm": (c.d_model,),
        "wq": (c.d_model, c.d_model),
        "wk": (c.d_model, c.d_model),
        "wv": (c.d_model, c.d_model),
        "wo": (c.d_model, c.d_model),
        "mlp_norm": (c.d_model,),
        "w_gate": (c.d_model, c.d_ff),
        "w_up": (c.d_model, c.d_ff),
        "w_down": (c.d_ff, c.d_model),
    }


def param_shapes(c: GPTConfig) -> Params:
    """Shapes only: lets a 7B-shaped model be planned from ShapeDtypeStructs."""
    layer = _layer_shapes(c)
    if c.scan_layers:
        layers: object = {k: (c.n_layers, *s) for k, s in layer.items()}
    else:
        layers = [dict(layer) for _ in range(c.n_layers)]
    return {
        "embed": (c.vocab, c.d_model),
        "layers": layers,
        "final_norm": (c.d_model,),
        "unembed": (c.d_model, c.vocab),
    }


def init_params(c: GPTConfig, key: jax.Array) -> Params:
    shapes = param_shapes(c)
    leaves, tree = jax.tree.flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
    keys = jax.random.split(key, len(leaves))
    dtype = jnp.dtype(c.dtype)

    def init(k, shape):
        if len(shape) == 1 or (c.scan_layers and len(shape) == 2 and shape[0] == c.n_layers):
            return jnp.ones(shape, dtype)  # norm gains
        return (jax.random.normal(k, shape) / shape[-2] ** 0.5).astype(dtype)

    return jax.tree.unflatten(tree, [init(k, s) for k, s in zip(keys, leaves, strict=True)])


def rms_norm(x: jax.Array, gain: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (x32 * rms).astype(x.dtype) * gain


def attention(c: GPTConfig, p: Params, x: jax.Array) -> jax.Array:
    b, s, _ = x.shape
    q = (x @ p["wq"]).reshape(b, s, c.n_heads, c.head_dim)
    k = (x @ p["wk"]).reshape(b, s, c.n_heads, c.head_dim)
    v = (x @ p["wv"]).reshape(b, s, c.n_heads, c.head_dim)
    scores = jnp.einsum("bshd,bthd->bhst", q, k) / c.head_dim**0.5
    causal = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
    out = jnp.einsum("bhst,bthd->bshd", probs, v).reshape(b, s, c.d_model)
    return out @ p["wo"]


def block(c: GPTConfig, p: Params, x: jax.Array) -> jax.Array:
    x = x + attention(c, p, rms_norm(x, p["attn_norm"]))
    h = rms_norm(x, p["mlp_norm"])
    return x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]


def loss_fn(c: GPTConfig, params: Params, batch: dict[str, jax.Array]) -> jax.Array:
    x = jnp.take(params["embed"], batch["tokens"], axis=0)
    if c.scan_layers:
        x, _ = jax.lax.scan(lambda h, p: (block(c, p, h), None), x, params["layers"])
    else:
        for p in params["layers"]:
            x = block(c, p, x)
    logits = rms_norm(x, params["final_norm"]) @ params["unembed"]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, batch["labels"][..., None], axis=-1)
    return -jnp.mean(picked)


def adamw(c: GPTConfig, params: Params, grads: Params, opt_state: Params):
    """AdamW written by hand (b1=0.9, b2=0.95, decoupled weight decay on matrices)."""
    count = opt_state["count"] + 1
    mu = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, opt_state["mu"], grads)
    nu = jax.tree.map(lambda v, g: 0.95 * v + 0.05 * g * g, opt_state["nu"], grads)
    bias1 = 1 - 0.9 ** count.astype(jnp.float32)
    bias2 = 1 - 0.95 ** count.astype(jnp.float32)

    def update(p, m, v):
        step = (m / bias1) / (jnp.sqrt(v / bias2) + c.adam_eps)
        decay = c.weight_decay * p if p.ndim >= 2 else 0.0
        return (p - c.lr * (step + decay)).astype(p.dtype)

    new_params = jax.tree.map(update, params, mu, nu)
    return new_params, {"count": count, "mu": mu, "nu": nu}


def make_train_step(c: GPTConfig):
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(c, p, batch))(params)
        params, opt_state = adamw(c, params, grads, opt_state)
        return params, opt_state, loss

    return train_step


def make(config: GPTConfig | None = None, abstract: bool = False):
    """The step and example ``(params, opt_state, batch)``; ``abstract`` gives ShapeDtypeStructs."""
    c = config or GPTConfig()
    if abstract:
        to_struct = lambda s: jax.ShapeDtypeStruct(s, jnp.dtype(c.dtype))  # noqa: E731
        params = jax.tree.map(to_struct, param_shapes(c), is_leaf=lambda s: isinstance(s, tuple))
        f32 = lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32)  # noqa: E731
        opt_state = {
            "count": jax.ShapeDtypeStruct((), jnp.int32),
            "mu": jax.tree.map(f32, params),
            "nu": jax.tree.map(f32, params),
        }
        tokens = jax.ShapeDtypeStruct((c.batch, c.seq), jnp.int32)
        return make_train_step(c), (params, opt_state, {"tokens": tokens, "labels": tokens})
    key_params, key_tokens = jax.random.split(jax.random.key(0))
    params = init_params(c, key_params)
    zeros = lambda p: jnp.zeros(p.shape, jnp.float32)  # noqa: E731
    opt_state = {
        "count": jnp.zeros((), jnp.int32),
        "mu": jax.tree.map(zeros, params),
        "nu": jax.tree.map(zeros, params),
    }
    tokens = jax.random.randint(key_tokens, (c.batch, c.seq + 1), 0, c.vocab, jnp.int32)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    return make_train_step(c), (params, opt_state, batch)


def main() -> None:
    import shardplan as sp
    from checks import jax_check

    # Adam's eps well above |gradient|: with 1e-8 the first update is sign(g) where |g| ~ 1e-8,
    # which no other reduction order reproduces, and the check below compares updated weights.
    step, args = make(GPTConfig(scan_layers="--scan" in sys.argv, adam_eps=1e-4))
    mesh = sp.Mesh({"dp": 2, "tp": 4}, cluster="cpu-test")
    plan = sp.plan(step, *args, mesh=mesh)
    print(plan)
    jax_check(plan, step, args, steps=3)


if __name__ == "__main__":
    main()
