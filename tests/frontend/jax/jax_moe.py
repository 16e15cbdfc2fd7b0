"""A GShard-style mixture-of-experts layer in pure JAX (a test model, no framework).

Router (a linear layer + softmax), top-k choice, one-hot dispatch with a per-group capacity
(slot = running count of the expert's choices in token order; past the capacity a token is
dropped), dispatch and combine as einsums over a ``[G, S, E, C]`` mask (GShard, Lepikhin et al.
2020, Algorithm 1), and an expert FFN batched over ``E``:

    x[G,S,h] -> dispatch "gsec,gsh->egch" -> FFN "egch,ehf->egcf", "egcf,efh->egch"
      -> combine "gsec,egch->gsh" -> mean-squared loss

``make()`` returns an SGD training step and its arguments. With ``experts_on`` (a jax mesh and
its axis names for the expert and group dims) the dispatched ``[E, G, C, h]`` buffer and the
experts' output carry GShard's annotation (``with_sharding_constraint``: experts over one axis,
groups over the other), which capture reads as pins; without it the planner chooses freely.

Every op it captures to (dot_general, argmax, one_hot as iota + eq, cumsum, reductions) has a
generic IR rule; expert parallelism is the planner splitting ``e`` of the expert weights and
the dispatched ``[E, G, C, h]`` buffer, which turns the ``g -> e`` reshard between dispatch and
FFN into an all-to-all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec


@dataclass(frozen=True)
class MoEConfig:
    groups: int = 8
    tokens: int = 16
    """Tokens per group."""
    hidden: int = 32
    ffn: int = 64
    experts: int = 8
    top_k: int = 2
    capacity_factor: float = 2.0
    lr: float = 1e-2

    @property
    def capacity(self) -> int:
        return min(
            self.tokens, math.ceil(self.capacity_factor * self.tokens * self.top_k / self.experts)
        )


def dispatch_mask(probs: jax.Array, config: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """probs[G,S,E] -> (dispatch[G,S,E,C] 0/1, combine[G,S,E,C] gate weights); dropped: 0."""
    # GShard's top-2: argmax, mask the winner out, argmax again (k times). XLA's TopK would do,
    # but on CPU its SPMD partitioner gathers the batch dims it could keep split. The gate
    # weights are read back through the one-hot mask, so no gradient flows through argmax.
    left, picks = jax.lax.stop_gradient(probs), []
    for _ in range(config.top_k):
        picks.append(jax.nn.one_hot(jnp.argmax(left, axis=-1), config.experts, dtype=probs.dtype))
        left = jnp.where(picks[-1] > 0, -jnp.inf, left)
    chosen = jnp.concatenate([p[:, :, None] for p in picks], axis=2)  # [G,S,K,E]
    weights = (chosen * probs[:, :, None, :]).sum(-1)
    weights = weights / weights.sum(-1, keepdims=True)
    g, s, k, e = chosen.shape
    flat = chosen.reshape(g, s * k, e)
    position = (jnp.cumsum(flat, axis=1) - 1.0) * flat  # slot of each (token, choice)
    slot = jax.nn.one_hot(position.reshape(g, s, k, e), config.capacity, dtype=probs.dtype)
    dispatch = (chosen[..., None] * slot).sum(2)  # [G,S,E,C]; position >= C: all-zero one_hot
    combine = (weights[..., None, None] * chosen[..., None] * slot).sum(2)
    return dispatch, combine


def moe_layer(
    params: dict[str, jax.Array], x: jax.Array, config: MoEConfig, annotate=lambda a: a
) -> jax.Array:
    probs = jax.nn.softmax(jnp.einsum("gsh,he->gse", x, params["router"]), axis=-1)
    dispatch, combine = dispatch_mask(probs, config)
    xe = annotate(jnp.einsum("gsec,gsh->egch", dispatch, x))
    hidden = jax.nn.gelu(jnp.einsum("egch,ehf->egcf", xe, params["w_in"]))
    ye = annotate(jnp.einsum("egcf,efh->egch", hidden, params["w_out"]))
    return jnp.einsum("gsec,egch->gsh", combine, ye)


def make(config: MoEConfig | None = None, experts_on=None):
    """The SGD step ``(params, batch) -> (new_params, loss)`` and its example arguments.

    ``experts_on=(jax_mesh, expert_axis, group_axis)`` annotates the expert buffers GShard-style.
    Arguments are numpy draws (no jax RNG program to compile on a busy CPU)."""
    config = config or MoEConfig()
    annotate = lambda a: a  # noqa: E731
    if experts_on is not None:
        jax_mesh, expert_axis, group_axis = experts_on
        spec = NamedSharding(jax_mesh, PartitionSpec(expert_axis, group_axis, None, None))
        annotate = partial(jax.lax.with_sharding_constraint, shardings=spec)

    def loss_fn(params, batch):
        y = moe_layer(params, batch["x"], config, annotate)
        return jnp.mean((y - batch["y"]) ** 2)

    def step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return jax.tree.map(lambda p, g: p - config.lr * g, params, grads), loss

    rng = np.random.default_rng(0)
    e, h, f = config.experts, config.hidden, config.ffn
    params = {
        "router": rng.standard_normal((h, e), dtype=np.float32) / h**0.5,
        "w_in": rng.standard_normal((e, h, f), dtype=np.float32) / h**0.5,
        "w_out": rng.standard_normal((e, f, h), dtype=np.float32) / f**0.5,
    }
    shape = (config.groups, config.tokens, h)
    batch = {k: rng.standard_normal(shape, dtype=np.float32) for k in ("x", "y")}
    return step, jax.tree.map(jnp.asarray, (params, batch))
