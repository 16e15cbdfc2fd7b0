"""A ``lax.conv_general_dilated`` net with its rows split (GSPMD's windowed split,
``ir/halo.py``) under ``plan.jit``: XLA's SPMD partitioner inserts the halo exchanges itself
(collective-permutes), the step matches the unsharded one, and the compiled collectives are
the plan's - its reshards plus the halo exchanges of the forward, input-gradient and
weight-gradient convolutions (issue 36)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import shardplan as sp
from jax import lax
from shardplan.costmodel.conv import HALO_KINDS, halo_collectives
from shardplan.frontend.jax.capture import capture
from shardplan.frontend.jax.emit import make_jax_mesh
from shardplan.frontend.jax.hlo import collectives, compare
from shardplan.frontend.jax.paths import distinct_collectives

pytestmark = [pytest.mark.jax]

DILATIONS = (1, 2, 1)
"""A same-padded 3x3, a dilated 3x3 (halo of 2 rows each way) and another 3x3."""


SIZE = 64
"""Rows (and columns) of the images the step tests run on."""


def _conv(x, w, d):  # type: ignore[no-untyped-def]
    return lax.conv_general_dilated(
        x, w, (1, 1), ((d, d), (d, d)), rhs_dilation=(d, d),
        dimension_numbers=("NCHW", "OIHW", "NCHW"),
    )  # fmt: skip


def _step(params, x):  # type: ignore[no-untyped-def]
    """One SGD step of a segmentation-style stack: per-pixel squared error of the last map."""

    def loss_fn(p):  # type: ignore[no-untyped-def]
        h = x
        for w, d in zip(p, DILATIONS, strict=True):
            h = jax.nn.relu(_conv(h, w, d))
        return jnp.mean(h**2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return [p - 0.1 * g for p, g in zip(params, grads, strict=True)], loss


def _args(channels: int, size: int, abstract: bool = False):  # type: ignore[no-untyped-def]
    shapes = [(channels, 3, 3, 3)] + [(channels, channels, 3, 3)] * (len(DILATIONS) - 1)
    if abstract:
        params = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
        return params, jax.ShapeDtypeStruct((1, 3, size, size), jnp.float32)
    rng = np.random.default_rng(0)
    params = [jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for s in shapes]
    return params, jnp.asarray(rng.normal(size=(1, 3, size, size)), jnp.float32)


class _FlaxSegmentation(nn.Module):
    """The same stack in Flax Linen (NHWC, HWIO kernels, SAME padding, biases)."""

    channels: int = 16

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for d in DILATIONS:
            x = nn.relu(nn.Conv(self.channels, (3, 3), kernel_dilation=(d, d))(x))
        return x


def _flax_step(model: nn.Module):  # type: ignore[no-untyped-def]
    def step(params, x):  # type: ignore[no-untyped-def]
        def loss_fn(p):  # type: ignore[no-untyped-def]
            return jnp.mean(model.apply({"params": p}, x) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    return step


def _spatial_splits(plan: sp.Plan) -> list[int]:
    """Convolutions whose lhs is split along a spatial dim (dims 2, 3 of NCHW)."""
    return [
        i
        for i, op in enumerate(plan.graph.ops)
        if op.kind == "convolution"
        and any(plan.operand_shardings[(i, 0)].dims[d] for d in op.attrs["lhs_dims"][2:])
    ]


def _halos(plan: sp.Plan) -> list:
    """The halo collective-permutes of every convolution and pooling window."""
    return [
        c
        for i, op in enumerate(plan.graph.ops)
        if op.kind in HALO_KINDS
        for c in halo_collectives(op, _operands(plan, i), plan.mesh)
    ]


def _operands(plan: sp.Plan, i: int) -> list[sp.Sharding]:
    return [plan.operand_shardings[(i, j)] for j in range(len(plan.graph.ops[i].operands))]


def _pinned_rows(step, args, axis_dim: int, rows_of=(SIZE,)) -> sp.Plan:  # type: ignore[no-untyped-def]
    """``step`` planned on 4 ``cpu-test`` devices with the rows (dim ``axis_dim``) of every
    batch-1 value ``rows_of`` rows long (the activations and their gradients) pinned split."""
    graph, _ = capture(step, *args)
    rows = sp.Sharding(tuple(("x",) if d == axis_dim else () for d in range(4)))
    pins = {
        v.name: rows
        for v in graph.values()
        if v.type.rank == 4 and v.type.shape[0] == 1 and v.type.shape[axis_dim] in rows_of
    }  # not a broadcast bias [1, 1, 1, C]
    return sp.plan(step, *args, mesh=sp.Mesh({"x": 4}, cluster="cpu-test"), pins=pins)


def _check_jit(step, args, plan: sp.Plan) -> None:  # type: ignore[no-untyped-def]
    """``plan.jit`` equals the unsharded step (rtol 1e-4); the compiled HLO's collectives are
    the plan's reshards and halo collective-permutes (kind, bytes, mesh axes)."""
    compiled = plan.jit(step, make_jax_mesh(plan)).lower(*args).compile()
    got, want = compiled(*args), jax.jit(step)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    found = collectives(compiled.as_text(), plan.mesh)
    assert any(c.kind == "collective-permute" for c in found)
    compare([*distinct_collectives(plan.reshards), *_halos(plan)], found, plan.mesh)


def test_batch_one_high_resolution_plans_a_spatial_split_with_halos():
    """One 3x1024x1024 image, 64 channels, on 8 H100s: every convolution - forward, input
    gradient and weight gradient (its rhs, the output gradient, split with the input rows) -
    runs on a slab of rows, as in the torch plan; the only collectives besides the halos
    reduce the kernel-sized weight gradients."""
    params, x = _args(64, 1024, abstract=True)
    plan = sp.plan(_step, params, x, mesh=sp.Mesh({"dp": 8}, cluster="h100-sxm"))
    convs = [i for i, op in enumerate(plan.graph.ops) if op.kind == "convolution"]
    assert len(convs) == 8  # 3 forward, 2 input gradients, 3 weight gradients
    assert _spatial_splits(plan) == convs
    assert _halos(plan)
    weight = 64 * 64 * 3 * 3 * 4
    assert all(c.kind == "all-reduce" and c.bytes <= weight for c in plan.collectives())


@pytest.mark.slow
def test_plan_jit_with_rows_split_matches_and_xla_inserts_the_planned_halos():
    """Rows pinned split over 4 devices (16 channels, 64x64): ``plan.jit`` matches and XLA's
    halo exchanges are the plan's (``_check_jit``)."""
    params, x = _args(16, SIZE)
    plan = _pinned_rows(_step, (params, x), 2)
    assert len(_spatial_splits(plan)) >= 6
    _check_jit(_step, (params, x), plan)


@pytest.mark.slow
def test_flax_linen_rows_split_matches_and_xla_inserts_the_planned_halos():
    """The Flax Linen version (NHWC: the rows are dim 1), rows pinned split over 4 devices."""
    model = _FlaxSegmentation()
    x = jnp.asarray(np.random.default_rng(1).normal(size=(1, SIZE, SIZE, 3)), jnp.float32)
    params = model.init(jax.random.PRNGKey(0), x)["params"]
    step = _flax_step(model)
    plan = _pinned_rows(step, (params, x), 1)
    assert len(_spatial_splits(plan)) >= 6
    _check_jit(step, (params, x), plan)


# -- a pool between the convolutions (a U-Net encoder step) -------------------------------------

POOLS = {
    "max 2x2": ((1, 1, 2, 2), (1, 1, 2, 2), "VALID"),  # U-Net: no window crosses a slab edge
    "max 3x3/2": ((1, 1, 3, 3), (1, 1, 2, 2), ((0, 0), (0, 0), (1, 1), (1, 1))),  # ResNet's stem
}


def _pooled_step(pool: str):  # type: ignore[no-untyped-def]
    """``_step`` with a max pool after the first convolution (the rest at half the rows)."""
    window, strides, padding = POOLS[pool]

    def step(params, x):  # type: ignore[no-untyped-def]
        def loss_fn(p):  # type: ignore[no-untyped-def]
            h = jax.nn.relu(_conv(x, p[0], DILATIONS[0]))
            h = lax.reduce_window(h, -jnp.inf, lax.max, window, strides, padding)
            for w, d in zip(p[1:], DILATIONS[1:], strict=True):
                h = jax.nn.relu(_conv(h, w, d))
            return jnp.mean(h**2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return [p - 0.1 * g for p, g in zip(params, grads, strict=True)], loss

    return step


def _window_ops(plan: sp.Plan) -> dict[str, sp.Sharding]:
    """The pooled operand's planned layout of the max pool and of its backward."""
    return {
        op.kind: plan.operand_shardings[(i, int(op.kind == "select_and_scatter_add"))]
        for i, op in enumerate(plan.graph.ops)
        if op.kind in ("reduce_window_max", "select_and_scatter_add")
    }


def test_a_max_pool_between_convolutions_keeps_the_rows_split():
    """One 3x1024x1024 image, 64 channels, a 2x2 max pool after the first convolution, on 8
    H100s: the pool and its backward split a spatial dim with the convolutions (2x2 windows
    at stride 2 need no halo), so nothing moves but the convolutions' halos and the weight
    gradients' all-reduces (before, the plan all-to-alled 8 MiB activations to a channel
    split three times around the pool)."""
    params, x = _args(64, 1024, abstract=True)
    plan = sp.plan(_pooled_step("max 2x2"), params, x, mesh=sp.Mesh({"dp": 8}, cluster="h100-sxm"))
    convs = [i for i, op in enumerate(plan.graph.ops) if op.kind == "convolution"]
    assert _spatial_splits(plan) == convs
    pools = _window_ops(plan)
    assert len(pools) == 2
    assert all(any(layout.dims[d] for d in (2, 3)) for layout in pools.values()), pools
    weight = 64 * 64 * 3 * 3 * 4
    assert all(c.kind == "all-reduce" and c.bytes <= weight for c in plan.collectives())


@pytest.mark.slow
@pytest.mark.parametrize("pool", POOLS)
def test_plan_jit_with_rows_split_through_a_max_pool_matches(pool):
    """Rows pinned split over 4 devices (16 channels, 128x128, the rows halved by the pool):
    ``plan.jit`` matches and XLA's collectives are the plan's. The 2x2 pool and its backward
    run on the row slabs with no exchange; the overlapping 3x3 pool at stride 2 fetches one
    row from the previous slab (the halo the plan prices) and its backward, whose windows
    cross the slab edges, moves to a channel split as planned."""
    step, size = _pooled_step(pool), 128
    params, x = _args(16, size)
    plan = _pinned_rows(step, (params, x), 2, rows_of=(size, size // 2))
    assert len(_spatial_splits(plan)) == 8
    pools = _window_ops(plan)
    assert pools["reduce_window_max"].dims[2] == ("x",)
    pool_op = next(i for i, op in enumerate(plan.graph.ops) if op.kind == "reduce_window_max")
    halo = halo_collectives(plan.graph.ops[pool_op], _operands(plan, pool_op), plan.mesh)
    if pool == "max 2x2":
        assert pools["select_and_scatter_add"].dims[2] == ("x",)
        assert halo == []
    else:  # one row of the local [1, 16, 32, 128] slab to the next device
        assert [(c.kind, c.bytes) for c in halo] == [("collective-permute", 16 * 128 * 4)]
    _check_jit(step, (params, x), plan)
