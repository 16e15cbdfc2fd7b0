"""``with_sharding_constraint`` / ``reshard`` in the user's function pin the plan (issue 17)."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import shardplan as sp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from shardplan.frontend.jax.capture import capture
from shardplan.frontend.jax.constraints import ConstraintWarning
from shardplan.frontend.jax.emit import make_jax_mesh
from shardplan.ir import FrontendError, Sharding

pytestmark = pytest.mark.jax

MESH = sp.Mesh({"dp": 2, "tp": 4}, cluster="cpu-test")


def _jax_mesh():
    return jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)


@functools.cache
def _args():
    """numpy draws: no jax RNG program to compile (seconds on a busy CPU)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 128), dtype=np.float32)
    w1 = rng.standard_normal((128, 256), dtype=np.float32) / 8
    return jnp.asarray(x), jnp.asarray(w1), jnp.asarray(w1.T.copy())


def _mlp(spec):
    """``tanh(x @ w1) @ w2`` with one constraint on the hidden activation (or none)."""

    def mlp(x, w1, w2):
        h = jnp.tanh(x @ w1)
        if spec is not None:
            h = jax.lax.with_sharding_constraint(h, NamedSharding(_jax_mesh(), spec))
        return h @ w2

    return mlp


@functools.cache
def _planned(spec):
    """The plan of ``_mlp(spec)`` (cached: tests share the three plans)."""
    return sp.plan(_mlp(spec), *_args(), mesh=MESH, time_limit=60)


def _layouts(plan):
    x, w1, w2 = (plan.sharding_of(n) for n in plan.frontend_context.arg_inputs)
    return x, w1, w2


def test_capture_records_the_constraint_on_the_constrained_value():
    graph, context = capture(_mlp(P(None, "tp")), *_args())
    ((name, constraint),) = context.constraints.items()
    value = graph.value(name)
    assert value.producer is not None
    assert value.producer.kind == "tanh"
    assert constraint.sharding == Sharding.of(None, "tp")
    assert constraint.source.startswith("test_constraints.py:")
    (pin,) = context.user_pins(MESH).values()  # --print-ir names the constraint and its line
    assert pin.sharding == Sharding.of(None, "tp")
    assert pin.source == f"with_sharding_constraint at {constraint.source}"


@pytest.mark.parametrize(
    ("spec", "want_x", "want_w1"),
    [
        # hidden split by columns: only w1's columns can make it without communication
        (P(None, ("dp", "tp")), Sharding.of(None, None), Sharding.of(None, ("dp", "tp"))),
        # hidden split by rows: the batch is split, the weights replicated
        (P(("dp", "tp"), None), Sharding.of(("dp", "tp"), None), Sharding.of(None, None)),
    ],
    ids=["columns", "rows"],
)
def test_single_constraint_decides_the_plan_and_jit_matches(spec, want_x, want_w1):
    fn, args = _mlp(spec), _args()
    plan = _planned(spec)
    x, w1, _ = _layouts(plan)
    assert (x, w1) == (want_x, want_w1)
    (hidden,) = plan.frontend_context.constraints
    assert plan.sharding_of(hidden) == Sharding.of(*spec)
    jitted = plan.jit(fn, make_jax_mesh(plan))
    np.testing.assert_allclose(
        np.asarray(jitted(*args)), np.asarray(jax.jit(_mlp(None))(*args)), rtol=1e-5, atol=1e-5
    )


def test_the_constraint_changes_the_unconstrained_plan():
    """Each constrained plan differs from the free one (Megatron-like dp x tp here) and from
    the other: the constraint, not the cost model's own preference, decides."""
    free = _layouts(_planned(None))
    specs = (P(None, ("dp", "tp")), P(("dp", "tp"), None))
    pinned = [_layouts(_planned(s)) for s in specs]
    assert pinned[0] != pinned[1]
    assert free not in pinned


def test_bare_partition_spec_under_set_mesh_and_reshard():
    def fn(x, w1, w2):
        h = jax.lax.with_sharding_constraint(jnp.tanh(x @ w1), P("dp", "tp"))
        return h @ w2

    with jax.set_mesh(_jax_mesh()):
        _, context = capture(fn, *_args())
    assert [c.sharding for c in context.constraints.values()] == [Sharding.of("dp", "tp")]

    explicit = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(explicit):
        _, context = capture(lambda x: jax.sharding.reshard(x, P(None, "tp")) * 2, _args()[0])
    assert [c.sharding for c in context.constraints.values()] == [Sharding.of(None, "tp")]


def test_constraint_on_an_axis_the_planner_mesh_lacks_is_refused():
    with pytest.raises(FrontendError, match=r"test_constraints.py:\d+ .*names mesh axis 'tp'"):
        sp.plan(_mlp(P(None, "tp")), *_args(), mesh=sp.Mesh({"dp": 8}, cluster="cpu-test"))


def test_unconstrained_dimension_is_not_pinned_and_says_so():
    def fn(x, w1, w2):
        h = jax.lax.with_sharding_constraint(
            jnp.tanh(x @ w1), NamedSharding(_jax_mesh(), P("dp", P.UNCONSTRAINED))
        )
        return h @ w2

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, context = capture(fn, *_args())
    assert not context.constraints
    assert any(issubclass(w.category, ConstraintWarning) for w in caught)


def test_explicit_pin_beats_the_constraint():
    fn, args = _mlp(P(None, ("dp", "tp"))), _args()
    _, context = capture(fn, *args)
    (hidden,) = context.constraints
    rows = Sharding.of(("dp", "tp"), None)
    plan = sp.plan(fn, *args, mesh=MESH, pins={hidden: rows}, time_limit=60)
    assert plan.sharding_of(hidden) == rows


def test_constraint_inside_a_scan_body_pins_every_iteration():
    """A constraint in a ``lax.scan`` body (walked once) pins the body's value; the stacked
    weights follow it (split by columns) and the jitted scan matches the plain one."""

    def body(h, w, constrain):
        h = jnp.tanh(h @ w)
        return (jax.lax.with_sharding_constraint(h, P(None, "tp")) if constrain else h), None

    def fn(x, ws, constrain=True):
        return jax.lax.scan(lambda h, w: body(h, w, constrain), x, ws)[0].sum()

    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((64, 32), dtype=np.float32))
    ws = jnp.asarray(rng.standard_normal((3, 32, 32), dtype=np.float32) / 6)
    jax_mesh = make_jax_mesh(MESH)
    with jax.set_mesh(jax_mesh):
        plan = sp.plan(fn, x, ws, mesh=MESH, time_limit=60)
        ((name, constraint),) = plan.frontend_context.constraints.items()
        assert constraint.sharding == Sharding.of(None, "tp")
        assert plan.graph.value(name).producer.attrs.get("repeat") == 3
        assert plan.sharding_of(plan.frontend_context.arg_inputs[1]) == Sharding.of(
            None, None, "tp"
        )
        got = plan.jit(fn, jax_mesh)(x, ws)
    want = jax.jit(functools.partial(fn, constrain=False))(x, ws)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
