"""The emitter on hand-written plans (no solver): specs, meshes, numerics, pinned reshards."""

from __future__ import annotations

import jax
import jax_mlp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec
from shardplan import Mesh, Sharding
from shardplan.costmodel.collectives import Collective
from shardplan.frontend.jax.capture import capture
from shardplan.frontend.jax.emit import make_jax_mesh, partition_spec
from shardplan.frontend.jax.paths import distinct_collectives, pinned_layouts
from shardplan.solver.plan import Plan, Reshard, SolverStats

pytestmark = pytest.mark.jax


def _hand_plan(step, args, mesh: Mesh, layout) -> Plan:
    """A plan that fixes the inputs by ``layout(path, rank)`` and leaves the rest to XLA."""
    graph, context = capture(step, *args)
    shardings = {v.name: layout(v.origin.path, v.type.rank) for v in graph.inputs}
    outputs = [
        shardings[graph.inputs[graph.output_aliases[i]].name]
        if i in graph.output_aliases
        else Sharding.replicated(v.type.rank)
        for i, v in enumerate(graph.outputs)
    ]
    stats = SolverStats("TRIVIAL", 0.0, 0.0, 0.0, 0, 0)
    plan = Plan(graph, mesh, shardings, {}, [], 0.0, 0.0, 0, {}, stats, outputs)
    plan = plan.with_context(context)
    return plan


def _megatron(path: str, rank: int) -> Sharding:
    if path.endswith("['w1']") or path.endswith("['b1']"):
        return Sharding.of(*[None] * (rank - 1), "tp")
    if path.endswith("['w2']"):
        return Sharding.of("tp", None)
    if path.startswith("batch"):
        return Sharding.of("dp", None)
    return Sharding.replicated(rank)


def test_partition_spec_and_mesh():
    assert partition_spec(Sharding.of("dp", None, ("tp", "sp"))) == PartitionSpec(
        "dp", None, ("tp", "sp")
    )
    jax_mesh = make_jax_mesh(Mesh({"dp": 2, "tp": 4}, cluster="cpu-test"))
    assert dict(jax_mesh.shape) == {"dp": 2, "tp": 4}
    assert jax_mesh.axis_types == (AxisType.Auto, AxisType.Auto)


def test_in_shardings_mirror_the_argument_pytrees():
    step, args = jax_mlp.make()
    plan = _hand_plan(step, args, Mesh({"dp": 2, "tp": 4}, cluster="cpu-test"), _megatron)
    specs = plan.to_partition_specs()
    assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, PartitionSpec)) == (
        jax.tree.structure(args)
    )
    assert specs[0]["w1"] == PartitionSpec(None, "tp")
    named = plan.in_shardings(make_jax_mesh(plan))
    assert named[2]["x"].spec == PartitionSpec("dp", None)


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
def test_jit_matches_unsharded_numerics(shape):
    step, args = jax_mlp.make()
    plan = _hand_plan(
        step, args, Mesh(dict(zip(("dp", "tp"), shape, strict=True)), cluster="cpu-test"), _megatron
    )
    jax_mesh = make_jax_mesh(plan)
    got = plan.jit(step, jax_mesh)(*args)
    want = jax.jit(step)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert got[0]["w1"].sharding.spec == PartitionSpec(None, "tp")


def test_jit_defaults_to_the_planned_function_and_mesh():
    """``plan.jit()`` with no arguments: the captured function on ``make_jax_mesh(plan)``."""
    step, args = jax_mlp.make()
    plan = _hand_plan(step, args, Mesh({"dp": 2, "tp": 4}, cluster="cpu-test"), _megatron)
    got = plan.jit()(*args)
    want = jax.jit(step)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert got[0]["w1"].sharding.spec == PartitionSpec(None, "tp")
    assert plan.in_shardings()[2]["x"].spec == PartitionSpec("dp", None)


def test_pinned_layouts_replay_each_planned_step():
    src = Sharding.of("tp", None, None, partial=["dp"])
    dst = Sharding.of(None, None, None)
    steps = (Collective("all-reduce", ("dp",), 8192), Collective("all-gather", ("tp",), 32768))
    assert pinned_layouts(src, dst, steps) == [Sharding.of("tp", None, None), dst]
    move = (Collective("all-to-all", ("tp",), 1024), Collective("all-to-all", ("dp",), 1024))
    src2, dst2 = Sharding.of(None, None, "tp", "dp"), Sharding.of("tp", "dp", None, None)
    assert pinned_layouts(src2, dst2, move) == [Sharding.of("tp", None, None, "dp"), dst2]
    assert pinned_layouts(src2, dst2, ()) == [dst2]  # replay misses: pin the target only


def test_distinct_collectives_counts_a_shared_reshard_once():
    src, dst = Sharding.of(None, ("dp", "tp")), Sharding.replicated(2)
    gather = (Collective("all-gather", ("dp", "tp"), 512),)
    reshards = [Reshard("x", f"op:{i}:0", src, dst, gather) for i in (3, 7)]
    reshards.append(Reshard("y", "op:9:0", src, dst, gather))
    assert len(distinct_collectives(reshards)) == 2
