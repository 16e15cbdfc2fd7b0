"""The JAX calling conventions (issue 37, point 5): Flax NNX functional and in-place steps,
Equinox modules with function fields, Flax Linen mutable state, optax states. Each one either
plans and matches the unsharded step (``plan.jit`` numerics, rtol 1e-4, with some array split)
or is refused with a one-line error that says what to write instead."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import jax_cnn
import numpy as np
import optax
import pytest
import shardplan as sp
from flax import nnx
from shardplan.frontend.jax.capture import capture
from shardplan.frontend.jax.emit import make_jax_mesh
from shardplan.frontend.jax.hlo import check_plan_collectives
from shardplan.ir import FrontendError, Role

pytestmark = [pytest.mark.jax]

MESH = {"dp": 8}


def _fsdp_plan(step, args):
    """A plan with ``sp.strategies.fsdp`` pins (a tiny model's free plan may replicate)."""
    graph, _ = capture(step, *args)
    mesh = sp.Mesh(MESH, cluster="cpu-test")
    by_name = {v.name: v for v in graph.inputs}
    pins = {by_name[n].origin.path: s for n, s in sp.strategies.fsdp().pins(graph, mesh).items()}
    plan = sp.plan(step, *args, mesh=mesh, pins=pins)
    assert any(s.used_axes for s in plan.parameter_shardings().values()), "nothing split"
    return plan


def _assert_same(got, want):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


class NnxNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(8, 32, use_bias=False, rngs=rngs)  # BatchNorm follows
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.l2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.bn(self.l1(x))))


def _nnx_objects():
    graphdef, state = nnx.split(nnx.eval_shape(lambda: NnxNet(nnx.Rngs(0))))
    model = nnx.merge(graphdef, jax_cnn.filled(state))  # no jax.random: see jax_cnn.filled
    return model, nnx.Optimizer(model, optax.adam(1e-2, eps=1e-4), wrt=nnx.Param)


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


X, Y = jnp.asarray(np.random.default_rng(1).normal(size=(32, 8)), jnp.float32), jnp.ones((32, 4))


def test_nnx_split_merge_step_plans_with_roles_from_variable_types():
    """The state is one argument named ``state``: roles come from nnx.Param / BatchStat /
    OptState, so the weights are parameters and the optimizer's moments optimizer state."""
    graphdef, state = nnx.split(_nnx_objects())

    def step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(_loss)(model, x, y)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    graph, _ = capture(step, state, X, Y)
    roles = {v.origin.path: v.role for v in graph.inputs}
    assert roles["state[0]['l1']['kernel'].value"] is Role.PARAMETER
    assert roles["state[0]['bn']['mean'].value"] is Role.OPTIMIZER_STATE  # BatchStat
    mu = "state[1]['opt_state'][0]['mu']['l1']['kernel'].value"
    assert roles[mu] is Role.OPTIMIZER_STATE
    assert roles["x"] is Role.INPUT
    plan = _fsdp_plan(step, (state, X, Y))
    got = plan.jit(step, make_jax_mesh(plan))(state, X, Y)
    _assert_same(got, jax.jit(step)(state, X, Y))


def test_an_in_place_nnx_jit_step_is_refused_with_the_functional_form():
    model, optimizer = _nnx_objects()
    before = np.asarray(model.l1.kernel.get_value())

    @nnx.jit
    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(_loss)(model, x, y)
        optimizer.update(model, grads)
        return loss

    with pytest.raises(FrontendError, match=r"in place .*nnx\.split") as info:
        sp.plan(train_step, model, optimizer, X, Y, mesh=sp.Mesh(MESH, cluster="cpu-test"))
    assert "\n" not in str(info.value)
    after = model.l1.kernel.get_value()  # the trace left the user's model as it was
    assert isinstance(after, jax.Array)
    assert np.array_equal(np.asarray(after), before)


def test_an_nnx_module_that_is_only_read_plans():
    """A Module argument the step does not update (an eval step) is a plain pytree; in train
    mode the same forward updates BatchNorm's running stats in place, and is refused."""
    model, _ = _nnx_objects()

    def evaluate(model, x, y):
        return _loss(model, x, y)

    with pytest.raises(FrontendError, match=r"in place \(\[0\]\.bn\.mean"):
        capture(evaluate, model, X, Y)
    model.eval()
    graph, _ = capture(evaluate, model, X, Y)
    assert {v.role for v in graph.inputs if "kernel" in v.origin.path} == {Role.PARAMETER}


def test_an_equinox_module_with_function_fields_plans_like_filter_jit():
    shapes = eqx.filter_eval_shape(eqx.nn.MLP, 8, 4, 32, 2, key=jax.random.PRNGKey(0))
    arrays, static = eqx.partition(shapes, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    model = eqx.combine(jax_cnn.filled(arrays), static)  # holds jax.nn.relu
    tx = optax.adam(1e-2, eps=1e-4)
    opt_state = tx.init(eqx.filter(model, eqx.is_array))

    def loss_fn(model, x, y):
        return ((jax.vmap(model)(x) - y) ** 2).mean()  # an eqx.nn.MLP maps one vector

    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    plan = _fsdp_plan(step, (model, opt_state, X, Y))
    got = plan.jit(step, make_jax_mesh(plan))(model, opt_state, X, Y)
    want = eqx.filter_jit(step)(model, opt_state, X, Y)
    assert got[0].activation is jax.nn.relu  # the static part comes back
    _assert_same(eqx.filter(got, eqx.is_array), eqx.filter(want, eqx.is_array))


def test_linen_batch_stats_are_held_state_not_a_batch():
    step, args = jax_cnn.make_flax()
    graph, _ = capture(step, *args)
    roles = {v.origin.path: v.role for v in graph.inputs}
    assert roles["batch_stats['BatchNorm_0']['mean']"] is Role.OPTIMIZER_STATE
    assert roles["params['Conv_0']['kernel']"] is Role.PARAMETER
    assert roles["opt_state[0].mu['Conv_0']['kernel']"] is Role.OPTIMIZER_STATE
    assert roles["x"] is Role.INPUT
    assert len(graph.output_aliases) == len(graph.inputs) - 2  # params, stats, opt state


class EqxCNN(eqx.Module):
    """eqx.nn.Conv2d + MaxPool2d (its ``init`` is a Python float, its reduction a function:
    both static under ``eqx.filter_jit``) + a linear head, on one CHW image (vmapped)."""

    conv: eqx.nn.Conv2d
    pool: eqx.nn.MaxPool2d
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(3, 8, 3, padding=1, key=k1)
        self.pool = eqx.nn.MaxPool2d(2, 2)
        self.head = eqx.nn.Linear(8 * 4 * 4, 10, key=k2)

    def __call__(self, x):
        return self.head(self.pool(jax.nn.relu(self.conv(x))).reshape(-1))


def test_an_equinox_cnn_plans_data_parallel_and_runs_the_planned_collectives():
    shapes = eqx.filter_eval_shape(EqxCNN, jax.random.PRNGKey(0))
    arrays, static = eqx.partition(shapes, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    model = eqx.combine(jax_cnn.filled(arrays), static)
    tx = optax.sgd(0.1, momentum=0.9)
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 3, 8, 8)), jnp.float32)
    y = jnp.arange(16) % 10

    def step(model, opt_state, x, y):
        def loss_fn(m):
            logits = jax.vmap(m)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    args = (model, opt_state, x, y)
    pins = {"x": sp.Sharding.of("dp", None, None, None)}
    plan = sp.plan(step, *args, mesh=sp.Mesh(MESH, cluster="cpu-test"), pins=pins)
    convs = [i for i, op in enumerate(plan.graph.ops) if op.kind == "convolution"]
    assert any(plan.assignments.get(i) for i in convs)  # the batch splits the convs
    jitted = plan.jit(step, make_jax_mesh(plan))
    got = jitted(*args)
    assert got[0].pool.init == -jnp.inf  # static fields come back as they were
    _assert_same(
        eqx.filter(got, eqx.is_array), eqx.filter(eqx.filter_jit(step)(*args), eqx.is_array)
    )
    assert check_plan_collectives(plan, jitted, *args)
