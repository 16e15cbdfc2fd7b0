"""A dot's pending sum bound explicitly (``frontend/jax/pending.py``) is reduced by XLA as the
plan says, where the bare dot is not (docs/costmodel.md, "Reductions: what XLA runs for a
dot's pending sum"). ``x^T y`` with the batch split over ``tp`` on (dp=4, tp=2), the product
wanted on ``[{}, {"tp"}]``: the plan's walk prices one reduce-scatter over tp."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import shardplan as sp
from jax.sharding import NamedSharding, PartitionSpec
from shardplan.costmodel.reshard import reshard
from shardplan.frontend.jax.emit import make_jax_mesh, partition_spec
from shardplan.frontend.jax.hlo import collectives
from shardplan.frontend.jax.paths import pinned_layouts
from shardplan.frontend.jax.pending import Pending, explicit_dot, sum_axes

pytestmark = pytest.mark.jax

MESH = sp.Mesh({"dp": 4, "tp": 2}, cluster="cpu-test")
BATCH = sp.Sharding.of("tp", None)
PRODUCT = sp.Sharding.of(None, None, partial=["tp"])
TARGET = sp.Sharding.of(None, "tp")
NUMBERS = (((0,), (0,)), ((), ()))


def _compile(explicit: bool):
    mesh = make_jax_mesh(MESH)

    def pin(x, sharding):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, partition_spec(sharding)))

    def step(x, y):
        if explicit:
            pending = explicit_dot(x, y, (BATCH, BATCH), PRODUCT, {"dimension_numbers": NUMBERS},
                                   MESH, pin)  # fmt: skip
            z = sum_axes(pending, TARGET.partial)
        else:
            z = jax.lax.dot_general(x, y, NUMBERS)
        return pin(z, TARGET)

    shard = NamedSharding(mesh, PartitionSpec("tp"))
    out = NamedSharding(mesh, partition_spec(TARGET))
    return jax.jit(step, in_shardings=(shard, shard), out_shardings=out)


@pytest.fixture(scope="module")
def operands():
    rng = np.random.default_rng(0)
    return rng.normal(size=(16, 64)).astype(np.float32), rng.normal(size=(16, 128)).astype(
        np.float32
    )


def _kinds(jitted, operands) -> list[tuple[str, int, tuple[str, ...] | None]]:
    hlo = jitted.lower(*operands).compile().as_text()
    return sorted((c.kind, c.bytes, c.axes) for c in collectives(hlo, MESH))


def test_explicit_pending_sum_is_the_planned_reduce_scatter(operands) -> None:
    planned = reshard(PRODUCT, TARGET, sp.TensorType((64, 128), "f32"), MESH)
    want = sorted((c.kind, c.bytes, tuple(c.axes)) for c in planned)
    assert want == [("reduce-scatter", 64 * 128 * 4 // 2, ("tp",))]
    jitted = _compile(explicit=True)
    assert _kinds(jitted, operands) == want
    x, y = operands
    np.testing.assert_allclose(np.asarray(jitted(x, y)), x.T @ y, rtol=1e-5, atol=1e-5)


def test_the_bare_dot_is_what_xla_chooses_itself(operands) -> None:
    """Why the emitter binds the dot explicitly: given only the target, XLA slices the product
    over dp, all-reduces the half over tp and permutes it (if XLA starts reduce-scattering
    here, the explicit form is no longer needed)."""
    half = 64 * 128 * 4 // 2
    assert _kinds(_compile(explicit=False), operands) == [
        ("all-reduce", half, ("tp",)),
        ("collective-permute", half, ("dp", "tp")),
    ]


def test_a_staged_reduction_on_three_axes_is_the_planned_one() -> None:
    """A pending sum over (dp, fsdp) reduced in three planned steps on (2, 2, 2): reduce-
    scatter over fsdp, all-to-all over tp, all-reduce over dp (the MLP's Megatron plan in the
    emission matrix). Pinning each layout of ``pinned_layouts(..., partial=True)`` on the
    explicit form gives exactly those collectives; a regrouping reshape of the pending dims, or
    a path without the partial layouts, made XLA gather tp and all-reduce the whole product."""
    mesh3 = sp.Mesh({"dp": 2, "fsdp": 2, "tp": 2}, cluster="cpu-test")
    jax_mesh = make_jax_mesh(mesh3)
    left, right = sp.Sharding.of(("dp", "fsdp"), "tp"), sp.Sharding.of(("dp", "fsdp"), None)
    product = sp.Sharding.of("tp", None, partial=["dp", "fsdp"])
    target = sp.Sharding.of(None, ("fsdp", "tp"))
    planned = reshard(product, target, sp.TensorType((128, 32), "f32"), mesh3)
    assert [(c.kind, tuple(c.axes)) for c in planned] == [
        ("reduce-scatter", ("fsdp",)),
        ("all-to-all", ("tp",)),
        ("all-reduce", ("dp",)),
    ]
    path = pinned_layouts(product, target, planned, mesh3, partial=True)
    assert any(s.partial for s in path)

    def pin(x, sharding):
        spec = NamedSharding(jax_mesh, partition_spec(sharding))
        return jax.lax.with_sharding_constraint(x, spec)

    def step(x, y):
        z = explicit_dot(x, y, (left, right), product, {"dimension_numbers": NUMBERS}, mesh3, pin)
        for layout in path:
            z = sum_axes(z, layout.partial)
            if isinstance(z, Pending):
                z.array = pin(z.array, z.expanded(layout.without_partial()))
            else:
                z = pin(z, layout)
        return z

    shardings = [NamedSharding(jax_mesh, partition_spec(s)) for s in (left, right)]
    jitted = jax.jit(step, in_shardings=shardings)
    rng = np.random.default_rng(1)
    x, y = (
        rng.normal(size=(64, 128)).astype(np.float32),
        rng.normal(size=(64, 32)).astype(np.float32),
    )
    hlo = jitted.lower(x, y).compile().as_text()
    got = sorted((c.kind, c.bytes, c.axes) for c in collectives(hlo, mesh3))
    assert got == sorted((c.kind, c.bytes, tuple(c.axes)) for c in planned)
    np.testing.assert_allclose(np.asarray(jitted(x, y)), x.T @ y, rtol=1e-4, atol=1e-4)
