"""The emitter's pins along a planned reshard make XLA run exactly the priced collectives.

For each (source, target) layout pair the cost model's walk (``costmodel.reshard``) prices a
collective sequence; ``paths.pinned_layouts`` gives the layouts the emitter pins in between.
Here a jitted identity takes an array at the source layout, pins that chain with
``with_sharding_constraint`` and returns it at the target; the collectives XLA compiles must be
the priced ones (kind, bytes per device, mesh axes). The pairs are the reshards where pinning
only the layouts after each collective let XLA take another route: a slice to a tiling that is
no sub-tiling of the source, which XLA makes a slice of its major free axis plus a permute.
"""

from __future__ import annotations

import itertools
import random

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from shardplan.costmodel import reshard
from shardplan.frontend.jax.emit import make_jax_mesh, partition_spec
from shardplan.frontend.jax.hlo import collectives, compare
from shardplan.frontend.jax.paths import pinned_layouts
from shardplan.ir import Mesh, Sharding, TensorType

pytestmark = pytest.mark.jax

MESH_2X4 = Mesh({"dp": 2, "tp": 4}, cluster="cpu-test")
MESH_222 = Mesh({"dp": 2, "fsdp": 2, "tp": 2}, cluster="cpu-test")

CASES = [
    # GPT-1 Megatron on (2, 4): gather tp, move dp (XLA alone: one slice + permute)
    (MESH_2X4, Sharding.of(("dp", "tp"), None), Sharding.of("tp", "dp")),
    (MESH_2X4, Sharding.of("dp", None), Sharding.of("tp", "dp")),
    # (2, 2, 2): a slice of fsdp next to a free dp, then a permute (XLA alone: slices dp)
    (MESH_222, Sharding.of("tp", None), Sharding.of(("fsdp", "tp"), None)),
    (MESH_222, Sharding.of(None, "tp"), Sharding.of(None, ("fsdp", "tp"))),
    (MESH_222, Sharding.of(("fsdp", "tp"), None), Sharding.of("tp", None)),
    (MESH_222, Sharding.of(("dp", "fsdp"), None), Sharding.of(("fsdp", "tp"), None)),
    (MESH_222, Sharding.of("dp", None), Sharding.of("tp", ("dp", "fsdp"))),
    (MESH_222, Sharding.of(("dp", "tp"), None), Sharding.of("fsdp", "dp")),
]


def _layouts(mesh: Mesh) -> list[Sharding]:
    """Every layout of a rank-2 tensor on ``mesh``: each axis on dim 0, dim 1 or neither, in
    every order within a dim."""
    out = set()
    for assign in itertools.product((None, 0, 1), repeat=len(mesh.axis_names)):
        dims = [[a for a, d in zip(mesh.axis_names, assign, strict=True) if d == k] for k in (0, 1)]
        for first in itertools.permutations(dims[0]):
            for second in itertools.permutations(dims[1]):
                out.add(Sharding((first, second), frozenset()))
    return sorted(out, key=str)


def _sampled(mesh: Mesh, count: int) -> list[tuple[Mesh, Sharding, Sharding]]:
    """A fixed sample of layout pairs that need a collective (seeded: the same every run; 60
    random pairs per mesh, 2x4 and 2x2x2, all agreed when this was written)."""
    layouts = _layouts(mesh)
    type_ = TensorType((64, 32), "f32")
    pairs = [(a, b) for a in layouts for b in layouts if reshard(a, b, type_, mesh)]
    return [(mesh, a, b) for a, b in random.Random(0).sample(pairs, count)]


CASES += _sampled(MESH_222, 6) + _sampled(MESH_2X4, 2)


@pytest.mark.parametrize(("mesh", "src", "dst"), CASES, ids=lambda x: str(x).replace(" ", ""))
def test_pinned_chain_compiles_to_the_priced_collectives(mesh, src, dst):
    type_ = TensorType((64, 32), "f32")
    priced = reshard(src, dst, type_, mesh)
    assert priced, "a case that needs no collective checks nothing"
    jax_mesh = make_jax_mesh(mesh)
    layouts = pinned_layouts(src, dst, priced, mesh)
    assert layouts[-1] == dst

    def chain(x):
        for layout in layouts:
            x = jax.lax.with_sharding_constraint(x, NamedSharding(jax_mesh, partition_spec(layout)))
        return x

    jitted = jax.jit(
        chain,
        in_shardings=NamedSharding(jax_mesh, partition_spec(src)),
        out_shardings=NamedSharding(jax_mesh, partition_spec(dst)),
    )
    x = jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32)
    compiled = jitted.lower(x).compile()
    compare(priced, collectives(compiled.as_text(), mesh), mesh)
    assert (compiled(x) == x).all()
