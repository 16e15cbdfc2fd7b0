"""``shard_map`` bodies are opaque regions at their declared specs (issue 17 part a)."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import shardplan as sp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from shardplan.frontend.jax.capture import capture
from shardplan.ir import Sharding, UnsupportedOpWarning
from shardplan.ir.op_cost import op_flops
from shardplan.ir.parser import parse_graph

pytestmark = pytest.mark.jax

MESH = sp.Mesh({"dp": 2, "tp": 4}, cluster="cpu-test")


def _jax_mesh():
    return jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)


def _body(h, b):
    """Per shard: h[8, 16] @ b[16, 64], tanh, then a sum over the tp shards."""
    return jax.lax.psum(jnp.tanh(h @ b), "tp")


def _fn(x, w, b):
    """A planned matmul into a hand-written region, and a planned matmul after it."""
    region = jax.shard_map(
        _body, mesh=_jax_mesh(), in_specs=(P("dp", "tp"), P(None, None)), out_specs=P("dp", None)
    )
    return region(x @ w, b) @ w.T


@functools.cache
def _args():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 32), dtype=np.float32)
    w = rng.standard_normal((32, 64), dtype=np.float32) / 8
    b = rng.standard_normal((16, 64), dtype=np.float32) / 8
    return jnp.asarray(x), jnp.asarray(w), jnp.asarray(b)


@pytest.fixture(scope="module")
def planned():
    return sp.plan(_fn, *_args(), mesh=MESH, time_limit=30)


def test_capture_makes_one_opaque_op_pinned_to_the_specs():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsupportedOpWarning)  # no unknown-op fallback
        graph, context = capture(_fn, *_args())
    (region,) = [op for op in graph.ops if op.kind == "shard_map"]
    assert not [op for op in graph.ops if op.kind == "tanh"]  # the body is not walked
    assert region.attrs["in_specs"] == "dp,tp|_,_"
    assert region.attrs["out_specs"] == "dp,_"
    pins = context.user_pins(MESH)
    h, b = region.operands
    assert pins[h.name].sharding == Sharding.of("dp", "tp")
    assert pins[b.name].sharding == Sharding.of(None, None)
    assert pins[region.result.name].sharding == Sharding.of("dp", None)
    assert pins[h.name].source.startswith("shard_map at test_shard_map.py:")
    # the body priced per shard: a [8,16]@[16,64] dot and a tanh on [8,64] (the psum is
    # communication), times the 8 shards the planner's split divides by
    per_shard = 2 * 8 * 64 * 16 + 8 * 64
    assert op_flops(region.kind, region.rule, [], [], region.attrs) == per_shard * 8
    again = parse_graph(str(graph))  # the region's rule and attributes print and parse back
    assert str(again) == str(graph)


def test_the_plan_keeps_the_region_layouts(planned):
    """The region reads its operand at its in spec; the tp axis only the operand has is the
    body's psum, priced as the all-reduce of the result into its out spec."""
    graph = planned.graph
    (region,) = [op for op in graph.ops if op.kind == "shard_map"]
    i = graph.ops.index(region)
    assert planned.operand_shardings.get((i, 0), planned.sharding_of(region.operands[0].name)) == (
        Sharding.of("dp", "tp")
    )
    assert planned.sharding_of(region.result.name) == Sharding.of("dp", None)
    reduced = [r for r in planned.reshards if r.value == region.result.name]
    assert [c.kind for r in reduced for c in r.collectives] == ["all-reduce"]


def test_plan_jit_runs_the_region_and_matches(planned):
    x, w, b = _args()
    with jax.set_mesh(_jax_mesh()):
        got = planned.jit(_fn)(x, w, b)
    want = _fn(x, w, b)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
