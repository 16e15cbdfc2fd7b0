"""Plans whose layouts use Shardy sub-axes (``"x":(1)2``): ``plan.jit`` runs them.

A sub-axis layout comes from propagation through a reshape that splits a dimension inside a mesh
axis (``passes/propagate.py``). The planner's own strategies use whole axes, so the test puts
the propagated layouts into a solved plan, as a plan that follows propagation would hold them.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import shardplan as sp
from shardplan.frontend.jax.emit import make_jax_mesh, out_shardings, partition_spec
from shardplan.ir import Sharding
from shardplan.passes.propagate import propagate

pytestmark = pytest.mark.jax

MESH = sp.Mesh({"dp": 2, "tp": 4}, cluster="cpu-test")


def _heads(x, w):
    """(8,16) split to (2,4,16) inside the tp axis, scaled per head, and the split output."""
    h = jnp.sin(x.reshape(2, 4, 16)) * w
    return h.reshape(8, 16) @ jnp.ones((16, 16), x.dtype), h


@pytest.fixture(scope="module")
def planned():
    """The plan of ``_heads`` with x pinned on tp, and every layout propagation gives a
    sub-axis put into it (the split activations and the output ``h``)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((8, 16), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((2, 4, 16), dtype=np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = sp.plan(_heads, x, w, mesh=MESH, pins={"x": Sharding.of("tp", None)}, time_limit=10)
    graph = plan.graph
    saved = {v.name: v.sharding for v in graph.values()}
    propagate(graph)
    subs = {v.name: v.sharding for v in graph.values() if v.sharding and v.sharding.has_sub_axes}
    for value in graph.values():
        value.sharding = saved[value.name]
    names = plan.frontend_context.outputs
    outputs = [subs.get(n, plan.sharding_of(n)) for n in names]
    operands = dict(plan.operand_shardings)
    for (i, k), layout in plan.operand_shardings.items():  # consumed as produced: no reshard
        name = graph.ops[i].operands[k].name
        if name in subs and layout == plan.sharding_of(name):
            operands[i, k] = subs[name]
    sub_plan = dataclasses.replace(
        plan,
        shardings={**plan.shardings, **subs},
        operand_shardings=operands,
        output_shardings=outputs,
    )
    return sub_plan, subs, (x, w), plan


def test_propagation_gives_the_split_values_sub_axes(planned) -> None:
    _, subs, _, _ = planned
    split = Sharding((("tp:(1)2",), ("tp:(2)2",), ()))
    assert len(subs) >= 3  # sin's input and output, the product, the output h
    assert all(s == split for s in subs.values())


def test_jit_leaves_sub_axes_to_xla_with_equal_numerics(planned) -> None:
    plan, subs, args, solved = planned
    assert "Sub-axes:" in str(plan)
    assert "plan.jit leaves them to XLA" in str(plan)
    mesh = make_jax_mesh(plan)
    out_h = jax.tree.leaves(out_shardings(plan, mesh))[1]
    assert out_h.spec == jax.sharding.PartitionSpec(None, None, None)  # whole-axis prefix
    assert partition_spec(next(iter(subs.values()))) == jax.sharding.PartitionSpec(None, None, None)

    def constraints(p):
        return p.jit(_heads, mesh).lower(*args).as_text().count("sharding_constraint")

    assert constraints(plan) < constraints(solved)  # the sub-axis layouts are not pinned
    y, h = plan.jit(_heads, mesh)(*args)
    want_y, want_h = _heads(*args)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want_y), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(h), np.asarray(want_h), rtol=1e-6, atol=1e-6)


def test_a_sub_axis_pin_plans_and_runs() -> None:
    """A pin may name a sub-axis (``pins=``; Shardy's users cannot write one, shardplan's can):
    the plan prices the reshards around it, says so in its summary, and ``plan.jit`` leaves the
    value to XLA with the plain function's numerics."""
    from shardplan.frontend.jax.capture import capture

    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((8, 16), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((2, 4, 16), dtype=np.float32))
    graph, _ = capture(_heads, x, w)
    (name,) = [op.results[0].name for op in graph.ops if op.kind == "sin"]
    sub = Sharding((("tp:(1)2",), ("tp:(2)2",), ()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = sp.plan(_heads, x, w, mesh=MESH, pins={name: sub}, time_limit=10)
    assert plan.sharding_of(name) == sub
    assert f"Sub-axes: 1 layout (%{name})" in str(plan)
    y, h = plan.jit(_heads)(x, w)
    want_y, want_h = _heads(x, w)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want_y), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(h), np.asarray(want_h), rtol=1e-6, atol=1e-6)
