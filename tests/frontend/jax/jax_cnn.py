"""Tiny CNN training steps for the JAX tests (issue 36): a Flax Linen CNN with BatchNorm
(``batch_stats`` updated as mutable state, optax Adam) and a plain ``lax.conv_general_dilated``
net in NCHW (hand-written SGD with momentum). ``make_*`` return ``(step, args)``."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax


class FlaxCNN(nn.Module):
    """conv (no bias: BatchNorm follows) -> BN -> relu -> max-pool -> strided conv -> relu ->
    avg-pool -> dense."""

    channels: tuple[int, int] = (8, 16)
    classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        x = nn.Conv(self.channels[0], (3, 3), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.max_pool(nn.relu(x), (2, 2), (2, 2))
        x = nn.relu(nn.Conv(self.channels[1], (3, 3), strides=(2, 2))(x))
        x = nn.avg_pool(x, (2, 2), (2, 2))
        return nn.Dense(self.classes)(x.reshape(x.shape[0], -1))


def make_flax(batch: int = 16, size: int = 16, channels: tuple[int, int] = (8, 16), abstract=False):
    """The Flax CNN's training step ``(params, batch_stats, opt_state, x, y) -> (params,
    batch_stats, opt_state, loss)`` and example arguments (ShapeDtypeStructs if ``abstract``)."""
    model = FlaxCNN(channels)
    tx = optax.adam(1e-2, eps=1e-4)  # eps >> |g|: see test_emission_matrix.py

    def step(params, batch_stats, opt_state, x, y):
        def loss_fn(p):
            logits, new = model.apply(
                {"params": p, "batch_stats": batch_stats}, x, mutable=["batch_stats"]
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return loss, new["batch_stats"]

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state, loss

    x = jax.ShapeDtypeStruct((batch, size, size, 3), jnp.float32)
    variables = jax.eval_shape(model.init, jax.random.PRNGKey(0), x)
    if abstract:
        opt_state = jax.eval_shape(tx.init, variables["params"])
        y = jax.ShapeDtypeStruct((batch,), jnp.int32)
        return step, (variables["params"], variables["batch_stats"], opt_state, x, y)
    variables = filled(variables)
    x, y = filled(x, seed=1), jnp.arange(batch) % 10
    return step, (variables["params"], variables["batch_stats"], tx.init(variables["params"]), x, y)


def filled(tree, seed: int = 0):
    """Concrete arrays for a tree of ShapeDtypeStructs from numpy's generator: XLA on CPU
    takes seconds to compile ``jax.random`` (threefry), which would dominate these tests.
    Scales and variances are ones, means and biases zeros, the rest N(0, 1/fan_in)."""
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        name = jax.tree_util.keystr(path)
        if any(k in name for k in ("scale", "var")):
            return jnp.ones(leaf.shape, leaf.dtype)
        if any(k in name for k in ("mean", "bias")):
            return jnp.zeros(leaf.shape, leaf.dtype)
        fan_in = max(1, int(np.prod(leaf.shape[:-1]))) if len(leaf.shape) > 1 else 1
        return jnp.asarray(rng.normal(size=leaf.shape) / np.sqrt(fan_in), leaf.dtype)

    return jax.tree_util.tree_map_with_path(fill, tree)


def _conv(x, w, stride=1):
    return lax.conv_general_dilated(
        x, w, (stride, stride), ((1, 1), (1, 1)), dimension_numbers=("NCHW", "OIHW", "NCHW")
    )


def lax_forward(params, x):
    """Two NCHW convs (the second depthwise-free, strided), sum-pooling and a linear head."""
    h = jax.nn.relu(_conv(x, params["w1"]) + params["b1"][None, :, None, None])
    h = jax.nn.relu(_conv(h, params["w2"], stride=2))
    h = lax.reduce_window(h, 0.0, lax.add, (1, 1, 2, 2), (1, 1, 2, 2), "VALID") / 4.0
    return h.reshape(h.shape[0], -1) @ params["head"]


def make_lax(batch: int = 16, size: int = 16, channels: tuple[int, int] = (8, 16)):
    """SGD with momentum over the plain lax net: ``(params, opt_state, x, y) -> (params,
    opt_state, loss)``."""
    c1, c2 = channels

    rng = np.random.default_rng(0)
    params = {
        "w1": rng.normal(size=(c1, 3, 3, 3)) * 0.3,
        "b1": np.zeros((c1,)),
        "w2": rng.normal(size=(c2, c1, 3, 3)) * 0.1,
        "head": rng.normal(size=(c2 * (size // 4) ** 2, 10)) * 0.1,
    }
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    opt_state = {"momentum": jax.tree.map(jnp.zeros_like, params)}
    x = jnp.asarray(rng.normal(size=(batch, 3, size, size)), jnp.float32)

    def step(params, opt_state, x, y):
        def loss_fn(p):
            logits = lax_forward(p, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        mom = jax.tree.map(lambda m, g: 0.9 * m + g, opt_state["momentum"], grads)
        params = jax.tree.map(lambda p, m: p - 0.1 * m, params, mom)
        return params, {"momentum": mom}, loss

    return step, (params, opt_state, x, jnp.arange(batch) % 10)


def make_grouped(batch: int = 16, channels: int = 16, groups: int = 4, size: int = 8):
    """A grouped conv then a depthwise one (NCHW), plain SGD: their weight gradients are
    ``batch_group_count`` convs, their input gradients ``feature_group_count`` ones."""
    rng = np.random.default_rng(2)
    params = {
        "grouped": rng.normal(size=(channels, 8 // groups, 3, 3)) * 0.2,
        "depthwise": rng.normal(size=(channels, 1, 3, 3)) * 0.2,
    }
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    x = jnp.asarray(rng.normal(size=(batch, 8, size, size)), jnp.float32)

    def loss_fn(p, x):
        nchw = ("NCHW", "OIHW", "NCHW")
        h = lax.conv_general_dilated(
            x, p["grouped"], (1, 1), "SAME", feature_group_count=groups, dimension_numbers=nchw
        )
        h = lax.conv_general_dilated(
            jnp.tanh(h), p["depthwise"], (1, 1), "SAME", feature_group_count=channels,
            dimension_numbers=nchw,
        )  # fmt: skip
        return (h**2).mean()

    def step(params, x):
        loss, grads = jax.value_and_grad(loss_fn)(params, x)
        return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), loss

    return step, (params, x)
