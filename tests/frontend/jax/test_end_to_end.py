"""sp.plan -> plan.jit on 8 simulated CPU devices: numerics, XLA's collectives, known answers."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import jax_gpt
import jax_mlp
import numpy as np
import pytest
import shardplan as sp
from shardplan.frontend.jax.emit import make_jax_mesh
from shardplan.frontend.jax.hlo import check_plan_collectives

pytestmark = pytest.mark.jax

MESHES = [(8,), (2, 4), (4, 2)]
GPT = jax_gpt.GPTConfig(n_layers=1, adam_eps=1e-4)  # eps >> |g|: the first Adam step is
# g / (|g| + eps), a sign function where |g| ~ eps, which no reduction order reproduces to 1e-4

# The GPT's layout LP on a 2-D mesh takes ~10 s on two busy cores; planning must not be cut
# short (a time-limited solve is not a deterministic plan).
PLAN_TIME_LIMIT = 120


_KNOWN_GAPS: dict[tuple[str, tuple[int, ...]], pytest.MarkDecorator] = {}
"""Measured gaps between the plan's collectives and XLA's: strict, so a fixed cell fails here.
The GPT's free plan on (4, 2) was one until the emitter bound a dot's pending sum explicitly
(``frontend/jax/pending.py``): XLA ran its reduce-scatters as all-reduce + collective-permute."""


def _mesh(shape: tuple[int, ...]) -> sp.Mesh:
    return sp.Mesh(dict(zip(("dp", "tp"), shape, strict=False)), cluster="cpu-test")


@functools.cache
def _planned(model: str, shape: tuple[int, ...]):
    step, args = jax_gpt.make(GPT) if model == "gpt" else jax_mlp.make()
    plan = sp.plan(step, *args, mesh=_mesh(shape), time_limit=PLAN_TIME_LIMIT)
    return step, args, plan, plan.jit(step, make_jax_mesh(plan))


def _assert_same(got, want) -> None:
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("model", ["mlp", "gpt"])
@pytest.mark.parametrize("shape", MESHES)
def test_plan_jit_matches_unsharded_step(model, shape):
    step, args, _, jitted = _planned(model, shape)
    _assert_same(jitted(*args), jax.jit(step)(*args))


@pytest.mark.parametrize(
    ("model", "shape"),
    [
        pytest.param(model, shape, marks=_KNOWN_GAPS[(model, shape)])
        if (model, shape) in _KNOWN_GAPS
        else (model, shape)
        for model in ("mlp", "gpt")
        for shape in MESHES
    ],
)
def test_xla_collectives_are_the_planned_ones(model, shape):
    _, args, plan, jitted = _planned(model, shape)
    found = check_plan_collectives(plan, jitted, *args)
    assert found or not plan.collectives()


def _lookup_step(axis: int):
    """Rows (axis 0, an embedding) or columns (axis 1, a general gather) of a table looked up by
    token ids, then a matmul and a plain gradient step: the table's gradient is a scatter-add."""

    def step(params, batch):
        def loss(p):
            x = jnp.take(p["table"], batch["ids"], axis=axis)
            x = x if axis == 0 else jnp.einsum("dbs->bsd", x)
            return jnp.mean(jnp.tanh(x @ p["w"]))

        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    table = (128, 64) if axis == 0 else (64, 128)
    params = {"table": jax.random.normal(k1, table), "w": jax.random.normal(k2, (64, 64))}
    return step, (params, {"ids": jax.random.randint(k3, (16, 32), 0, 128)})


@pytest.mark.parametrize("axis", [0, 1], ids=["embedding", "general"])
def test_scatter_add_reduced_onto_its_window_dim(axis):
    # The table's model dim is split, the ids batch-split: the plan scatters each device's
    # tokens into a partial table and reduce-scatters it onto the model (window) dim. XLA moves
    # the updates into that split instead unless the emitter pins the scatter's own result
    # (docs/design.md, "Scatter-adds as the plan computes them").
    # Followers are merged, as at scale: solved exactly, this small step gathers the ids
    # instead (cheaper here) and no scatter-add is reduced at all.
    from shardplan.frontend.jax.capture import capture
    from shardplan.solver.planner import plan_graph

    step, args = _lookup_step(axis)
    model_dim = sp.Sharding.of(None, "dp") if axis == 0 else sp.Sharding.of("dp", None)
    pins = {"params['table']": model_dim, "batch['ids']": sp.Sharding.of("dp", None)}
    graph, context = capture(step, *args)
    plan = plan_graph(
        graph, sp.Mesh({"dp": 8}, cluster="cpu-test"), pins=pins, time_limit=10,
        merge_followers=True, semantics=context.partial_semantics,
    )  # fmt: skip
    plan = plan.with_context(context)
    table = plan.graph.inputs[0].type
    reduced = [
        r
        for r in plan.reshards
        if r.src.partial and r.dst == model_dim and plan.graph.value(r.value).type == table
    ]
    assert [c.kind for r in reduced for c in r.collectives] == ["reduce-scatter"]
    jitted = plan.jit(step, make_jax_mesh(plan))
    _assert_same(jitted(*args), jax.jit(step)(*args))
    assert check_plan_collectives(plan, jitted, *args)


@pytest.mark.parametrize("shape", [(8,), (2, 4)])
def test_scanned_gpt_plans_the_body_once_and_matches_numerics(shape):
    step, args = jax_gpt.make(jax_gpt.GPTConfig(n_layers=3, scan_layers=True, adam_eps=1e-4))
    plan = sp.plan(step, *args, mesh=_mesh(shape), time_limit=PLAN_TIME_LIMIT)
    graph = plan.graph
    assert any(op.repeat == 3 for op in graph.ops)  # planned once, for all three layers
    stacked = plan.parameter_shardings()["params['layers']['wq']"]
    assert stacked.dims[0] == ()  # each iteration needs its whole layer: the layer axis is whole
    for op in graph.ops:  # a carry comes back in the layout it entered the loop with
        if op.kind == "scan_loop":
            assert plan.shardings[op.result.name] == plan.shardings[op.attrs["carry"]]
    inside = [r for r in plan.reshards if r.count == 3]  # edges into the body: every iteration
    assert all(graph.ops[int(r.consumer.split(":")[1])].repeat == 3 for r in inside)
    jitted = plan.jit(step, make_jax_mesh(plan))
    assert "while" in jitted.lower(*args).as_text()  # emitted as a loop, not unrolled
    _assert_same(jitted(*args), jax.jit(step)(*args))


def test_scanned_layers_are_unrolled_when_pipelined():
    # Stages split the layers of a scan, so a pipelined plan captures every iteration.
    step, args = jax_gpt.make(jax_gpt.GPTConfig(n_layers=4, scan_layers=True), abstract=True)
    plan = sp.plan(
        step,
        *args,
        mesh=sp.Mesh({"pp": 2, "dp": 4}, cluster="cpu-test"),
        time_limit=PLAN_TIME_LIMIT,
    )
    assert len(plan.stages) == 2
    assert all(op.repeat == 1 for op in plan.graph.ops)
    assert {"layers.0", "layers.3"} <= {op.origin.module for op in plan.graph.ops}


def _nested_loops(w, x):
    """A reverse scan over stacked weights with a scan inside, then a ``fori_loop``."""

    def outer(h, wl):
        def inner(g, _):
            return jnp.tanh(g @ wl), jnp.sum(g)

        return jax.lax.scan(inner, h, None, length=3)

    h, sums = jax.lax.scan(outer, x, w, reverse=True)
    h = jax.lax.fori_loop(0, 4, lambda i, c: c * 0.5 + 1.0, h)
    return jnp.sum(h) + jnp.sum(sums)


def test_nested_and_fori_loops_are_planned_once_and_match_numerics():
    grad_step = jax.value_and_grad(_nested_loops)
    w = jax.random.normal(jax.random.key(0), (5, 64, 64)) * 0.1
    x = jax.random.normal(jax.random.key(1), (32, 64))
    plan = sp.plan(grad_step, w, x, mesh=_mesh((2, 4)), time_limit=PLAN_TIME_LIMIT)
    assert {op.repeat for op in plan.graph.ops} == {1, 4, 5, 15}  # fori, outer, outer x inner
    got, want = plan.jit(grad_step, make_jax_mesh(plan))(w, x), jax.jit(grad_step)(w, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        # 15 chained f32 tanh iterations: reduction order alone moves results by ~4e-6
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def _weights(plan) -> dict[str, sp.Sharding]:
    return {k: v for k, v in plan.parameter_shardings().items() if k.startswith("params['w")}


def _plan_mlp(mesh: dict[str, int], **config) -> sp.Plan:
    step, args = jax_mlp.make(jax_mlp.MLPConfig(**config), abstract=True)
    return sp.plan(step, *args, mesh=sp.Mesh(mesh, cluster="h100-sxm"), time_limit=10)


def test_known_answer_large_batch_is_data_parallel():
    # Large batch, small weights: every matmul splits the batch and no activation moves; only
    # gradients and weights do. The weight update itself may run sharded (reduce-scatter the
    # gradient, all-gather the new weight: Alpa's automatic weight-update sharding), which the
    # cost model prices below a plain all-reduce because each device updates 1/8 of the state.
    batch = 65536
    plan = _plan_mlp({"dp": 8}, batch=batch, d_in=1024, hidden=1024, d_out=1024)
    x = next(v for v in plan.graph.inputs if v.origin.path == "batch['x']")
    assert plan.shardings[x.name].dims[0] == ("dp",)
    by_name = {v.name: v for v in plan.graph.values()}
    moved = [r for r in plan.reshards if r.collectives]
    assert moved
    assert all(batch not in by_name[r.value].type.shape for r in moved), [
        (r.value, str(by_name[r.value].type)) for r in moved
    ]
    kinds = {c.kind for c in plan.collectives()}
    assert kinds <= {"all-reduce", "reduce-scatter", "all-gather"}, kinds


def test_known_answer_tiny_batch_huge_hidden_is_megatron():
    plan = _plan_mlp({"tp": 8}, batch=8, d_in=4096, hidden=16384, d_out=4096)
    weights = _weights(plan)
    assert weights["params['w1']"] == sp.Sharding.of(None, "tp")  # column parallel
    assert weights["params['w2']"] == sp.Sharding.of("tp", None)  # row parallel
    assert [c.kind for c in plan.collectives()] == ["all-reduce"]


def test_known_answer_2d_mesh_splits_batch_and_hidden():
    # Both pressures: gradient traffic (favours splitting weights) and activation traffic
    # (favours splitting the batch) are of similar size here. At smaller weights (e.g.
    # 1024x4096) data parallelism over all 8 devices with a sharded update is cheaper, and the
    # planner rightly picks it.
    plan = _plan_mlp({"dp": 2, "tp": 4}, batch=8192, d_in=4096, hidden=16384, d_out=4096)
    weights = _weights(plan)
    assert weights["params['w1']"].dims[1] == ("tp",)
    x = next(v for v in plan.graph.inputs if v.origin.path == "batch['x']")
    assert plan.shardings[x.name].dims[0] == ("dp",)


def test_unsupported_primitive_warns_and_still_runs():
    def forward(params, x):  # pooling has a rule since issue 36; cholesky has none
        h = x @ params["w"]
        gram = h.T @ h / h.shape[0] + jnp.eye(h.shape[1])
        return jnp.tanh(jax.lax.linalg.cholesky(gram)).sum(axis=1)

    params = {"w": jax.random.normal(jax.random.key(1), (32, 64))}
    x = jax.random.normal(jax.random.key(2), (16, 32))
    with pytest.warns(sp.UnsupportedOpWarning, match="cholesky"):
        plan = sp.plan(forward, params, x, mesh=_mesh((2, 4)), time_limit=10)
    got = plan.jit(forward, make_jax_mesh(plan))(params, x)
    _assert_same(got, jax.jit(forward)(params, x))


FSDP_PINS = {  # ZeRO-3 / FSDP: weights, momentum and batch split over dp
    "params['w1']": sp.Sharding.of("dp", None),
    "params['w2']": sp.Sharding.of("dp", None),
    "opt_state*['w1']": sp.Sharding.of("dp", None),
    "opt_state*['w2']": sp.Sharding.of("dp", None),
    "batch['x']": sp.Sharding.of("dp", None),
}
TP_FSDP_PINS = {  # 2-D: Megatron column/row on tp, and the other weight dim sharded over dp
    "params['w1']": sp.Sharding.of("dp", "tp"),
    "params['w2']": sp.Sharding.of("tp", "dp"),
    "opt_state*['w1']": sp.Sharding.of("dp", "tp"),
    "opt_state*['w2']": sp.Sharding.of("tp", "dp"),
    "batch['x']": sp.Sharding.of("dp", None),
}


@pytest.mark.parametrize(
    ("mesh", "pins"),
    [({"dp": 8}, FSDP_PINS), ({"dp": 2, "tp": 4}, TP_FSDP_PINS)],
    ids=["fsdp", "tp_fsdp"],
)
def test_fsdp_style_plans_match_numerics_and_collectives(mesh, pins):
    step, args = jax_mlp.make()
    plan = sp.plan(step, *args, mesh=sp.Mesh(mesh, cluster="cpu-test"), pins=pins, time_limit=10)
    for path, layout in pins.items():
        if "*" not in path:
            value = next(v for v in plan.graph.inputs if v.origin.path == path)
            assert plan.shardings[value.name] == layout
    jitted = plan.jit(step, make_jax_mesh(plan))
    _assert_same(jitted(*args), jax.jit(step)(*args))
    assert check_plan_collectives(plan, jitted, *args)


def test_small_graphs_are_also_solved_exactly():
    # Follower merging is greedy: on the MLP step a follower slices a replicated value for free
    # and leaves gathering it back to its consumers, 4.3x the exact optimum on dp=8. Graphs of
    # at most MERGE_FOLLOWERS_ABOVE ops are therefore also solved without it, and the planner
    # keeps the plan the simulator finds faster.
    from shardplan.frontend.jax.capture import capture
    from shardplan.solver.planner import MERGE_FOLLOWERS_ABOVE, plan_graph

    step, args = jax_mlp.make(abstract=True)
    steps = {}
    for merge in (None, True, False):
        graph, context = capture(step, *args)
        assert len(graph.ops) <= MERGE_FOLLOWERS_ABOVE
        plan = plan_graph(
            graph, _mesh((8,)), time_limit=PLAN_TIME_LIMIT, merge_followers=merge,
            semantics=context.partial_semantics,
        )  # fmt: skip
        steps[merge] = plan.step_time
    assert steps[False] < 0.5 * steps[True]  # the setup: merging loses here
    assert steps[None] <= steps[False] * (1 + 1e-9)
