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
from shardplan.frontend.jax.pending import explicit_dot, sum_axes

pytestmark = pytest.mark.jax

MESH = sp.Mesh({"dp": 4, "tp": 2})
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
            z = sum_axes(pending, TARGET.partial, MESH, pin)
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
