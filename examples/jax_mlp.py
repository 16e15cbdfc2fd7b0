"""A two-layer MLP training step in pure JAX, planned by shardplan on 8 simulated CPU devices.

Run as a script: ``python examples/jax_mlp.py``. Tests and the CLI import ``make()``.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # must happen before jax is imported
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class MLPConfig:
    batch: int = 64
    d_in: int = 32
    hidden: int = 128
    d_out: int = 16
    lr: float = 1e-2
    momentum: float = 0.9


def init_params(config: MLPConfig, key: jax.Array) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (config.d_in, config.hidden)) / config.d_in**0.5,
        "b1": jnp.zeros((config.hidden,)),
        "w2": jax.random.normal(k2, (config.hidden, config.d_out)) / config.hidden**0.5,
        "b2": jnp.zeros((config.d_out,)),
    }


def loss_fn(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    h = jax.nn.relu(batch["x"] @ params["w1"] + params["b1"])
    pred = h @ params["w2"] + params["b2"]
    return jnp.mean((pred - batch["y"]) ** 2)


def make_train_step(config: MLPConfig):
    """SGD with momentum; returns (new_params, new_opt_state, loss)."""

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        mu = jax.tree.map(lambda m, g: config.momentum * m + g, opt_state["mu"], grads)
        params = jax.tree.map(lambda p, m: p - config.lr * m, params, mu)
        return params, {"mu": mu}, loss

    return train_step


def make(config: MLPConfig | None = None, abstract: bool = False):
    """The step and example arguments ``(params, opt_state, batch)``.

    With ``abstract=True`` the arguments are ``jax.ShapeDtypeStruct``s (nothing is allocated).
    """
    config = config or MLPConfig()
    key_params, key_x, key_y = jax.random.split(jax.random.key(0), 3)
    params = init_params(config, key_params)
    opt_state = {"mu": jax.tree.map(jnp.zeros_like, params)}
    batch = {
        "x": jax.random.normal(key_x, (config.batch, config.d_in)),
        "y": jax.random.normal(key_y, (config.batch, config.d_out)),
    }
    args = (params, opt_state, batch)
    if abstract:
        args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    return make_train_step(config), args


def main() -> None:
    import shardplan as sp
    from checks import jax_check

    step, args = make()
    mesh = sp.Mesh({"dp": 2, "tp": 4}, cluster="cpu-test")
    plan = sp.plan(step, *args, mesh=mesh)
    print(plan)
    jax_check(plan, step, args, steps=3)


if __name__ == "__main__":
    main()
