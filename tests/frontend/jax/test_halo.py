"""A ``lax.conv_general_dilated`` net with its rows split (GSPMD's windowed split,
``ir/halo.py``) under ``plan.jit``: XLA's SPMD partitioner inserts the halo exchanges itself
(collective-permutes), the step matches the unsharded one, and the compiled collectives are
the plan's - its reshards plus the halo exchanges of the forward, input-gradient and
weight-gradient convolutions (issue 36)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import shardplan as sp
from jax import lax
from shardplan.costmodel.conv import halo_collectives
from shardplan.frontend.jax.capture import capture
from shardplan.frontend.jax.emit import make_jax_mesh
from shardplan.frontend.jax.hlo import collectives, compare
from shardplan.frontend.jax.paths import distinct_collectives

pytestmark = [pytest.mark.jax]

DILATIONS = (1, 2, 1)
"""A same-padded 3x3, a dilated 3x3 (halo of 2 rows each way) and another 3x3."""


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


def _spatial_splits(plan: sp.Plan) -> list[int]:
    """Convolutions whose lhs is split along a spatial dim (dims 2, 3 of NCHW)."""
    return [
        i
        for i, op in enumerate(plan.graph.ops)
        if op.kind == "convolution"
        and any(plan.operand_shardings[(i, 0)].dims[d] for d in op.attrs["lhs_dims"][2:])
    ]


def _halos(plan: sp.Plan) -> list:
    return [
        c
        for i, op in enumerate(plan.graph.ops)
        if op.kind == "convolution"
        for c in halo_collectives(op, [plan.operand_shardings[(i, j)] for j in (0, 1)], plan.mesh)
    ]


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
    """Rows pinned split over 4 devices (16 channels, 64x64): ``plan.jit``'s step equals the
    unsharded one (rtol 1e-4), and the collectives in the compiled HLO are the plan's
    reshards and halo collective-permutes (kind, bytes, mesh axes)."""
    params, x = _args(16, 64)
    graph, _ = capture(_step, params, x)
    mesh = sp.Mesh({"x": 4}, cluster="cpu-test")
    rows = sp.Sharding.of(None, None, "x", None)
    pins = {v.name: rows for v in graph.values() if v.type.rank == 4 and v.type.shape[0] == 1}
    plan = sp.plan(_step, params, x, mesh=mesh, pins=pins)
    assert len(_spatial_splits(plan)) >= 6
    compiled = plan.jit(_step, make_jax_mesh(plan)).lower(params, x).compile()
    got, want = compiled(params, x), jax.jit(_step)(params, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    found = collectives(compiled.as_text(), plan.mesh)
    assert any(c.kind == "collective-permute" for c in found)
    compare([*distinct_collectives(plan.reshards), *_halos(plan)], found, plan.mesh)
