"""CNNs through the JAX frontend (issue 36): ``conv_general_dilated``, pooling windows and the
max-pool backward lower to IR ops with real rules, and the planned step runs right.

Models (``jax_cnn.py``): a Flax Linen CNN with BatchNorm (``batch_stats`` as mutable state,
optax Adam) and a plain ``lax.conv_general_dilated`` NCHW net (SGD with momentum). Every cell of
models x meshes (8,), (2, 4), (2, 2, 2) x plans (free, ``sp.strategies`` DP and FSDP pins) runs
``plan.jit`` against the unsharded step (loss, params, batch_stats, optimizer state; rtol 1e-4),
compares XLA's collectives with the plan's and checks the plan splits some convolution.
"""

from __future__ import annotations

import warnings

import jax
import jax_cnn
import numpy as np
import pytest
import shardplan as sp
from shardplan.frontend.jax.capture import capture
from shardplan.frontend.jax.emit import make_jax_mesh
from shardplan.frontend.jax.hlo import collectives, compare
from shardplan.frontend.jax.paths import distinct_collectives
from shardplan.ir import TensorType, UnsupportedOpWarning, rule_for

pytestmark = [pytest.mark.jax]

MESHES = {
    "8": {"dp": 8},
    "2x4": {"dp": 2, "tp": 4},
    "2x2x2": {"dp": 2, "fsdp": 2, "tp": 2},
}
KINDS = ("free", "dp", "fsdp")
MODELS = {"flax": jax_cnn.make_flax, "lax": jax_cnn.make_lax, "grouped": jax_cnn.make_grouped}


def test_a_flax_cnn_step_lowers_every_op():
    """Forward, input-gradient (lhs-dilated) and weight-gradient (batch-contracting) convs,
    both poolings and the max-pool backward all get rules: no op runs replicated unasked."""
    step, args = jax_cnn.make_flax()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsupportedOpWarning)
        graph, _ = capture(step, *args)
    kinds = [op.kind for op in graph.ops]
    assert kinds.count("convolution") == 5  # 2 forward, 1 input grad (conv 0 has none), 2 wgrad
    for kind in ("reduce_window_max", "reduce_window_sum", "select_and_scatter_add"):
        assert kind in kinds
    convs = [op for op in graph.ops if op.kind == "convolution"]
    assert any(max(op.attrs["lhs_dilation"]) > 1 for op in convs)  # strided conv's input grad
    x_grad = [op for op in convs if op.operands[0] is graph.inputs[-2]]
    assert len(x_grad) == 2
    assert x_grad[1].attrs["lhs_dims"][:2] == (3, 0)  # the weight gradient: C is its "batch"


def _rule(kind, ins, out, **attrs):
    return rule_for(kind, [TensorType(s, "f32") for s in ins], [TensorType(out, "f32")], attrs)


def test_convolution_rule_splits_batch_and_sums_input_features():
    nhwc = dict(
        lhs_dims=(0, 3, 1, 2), rhs_dims=(3, 2, 0, 1), out_dims=(0, 3, 1, 2), strides=(1, 1),
        padding=((1, 1), (1, 1)), lhs_dilation=(1, 1), rhs_dilation=(1, 1),
        feature_group_count=1, batch_group_count=1,
    )  # fmt: skip
    rule = _rule("convolution", [(8, 16, 16, 3), (3, 3, 3, 4)], (8, 16, 16, 4), **nhwc)
    (lhs, rhs), (out,) = rule.operands, rule.results
    assert lhs[0] == out[0]  # batch passes through
    assert rule.size_of[lhs[0][0]] == 8
    assert rhs[3] == out[3]  # output features pass through
    cin = lhs[3][0]
    assert rhs[2] == (cin,)
    assert not any(cin in d for d in out)  # input features: a reduction
    assert cin not in rule.need_replication


_CELLS: dict[tuple[str, str, str], object] = {}


def _cell(model: str, mesh_name: str, kind: str):
    """Plan and jit once per session (the three tests of a cell share it)."""
    key = (model, mesh_name, kind)
    if key not in _CELLS:
        step, args = MODELS[model]()
        mesh = sp.Mesh(MESHES[mesh_name], cluster="cpu-test")
        pins = None
        if kind != "free":
            graph, _ = capture(step, *args)
            by_name = {v.name: v for v in graph.inputs}
            strategy = sp.strategies.dp() if kind == "dp" else sp.strategies.fsdp()
            pins = {by_name[n].origin.path: s for n, s in strategy.pins(graph, mesh).items()}
        plan = sp.plan(step, *args, mesh=mesh, pins=pins, time_limit=30)
        compiled = plan.jit(step, make_jax_mesh(plan)).lower(*args).compile()  # once per cell
        _CELLS[key] = (args, plan, compiled, _unsharded(model))
    return _CELLS[key]


_UNSHARDED: dict[str, object] = {}


def _unsharded(model: str):
    """The reference: the unsharded ``jax.jit`` step's results, once per model."""
    if model not in _UNSHARDED:
        step, args = MODELS[model]()
        _UNSHARDED[model] = jax.jit(step)(*args)
    return _UNSHARDED[model]


CELLS = [(m, mesh, k) for m in ("flax", "lax") for mesh in MESHES for k in KINDS]
CELLS += [("grouped", "8", "dp"), ("grouped", "8", "fsdp")]  # grouped / depthwise convs


@pytest.mark.slow
@pytest.mark.parametrize(("model", "mesh", "kind"), CELLS)
def test_plan_jit_matches_the_unsharded_step_and_shards_a_conv(model, mesh, kind):
    args, plan, compiled, want = _cell(model, mesh, kind)
    got = compiled(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    split = [i for i, op in enumerate(plan.graph.ops) if op.kind == "convolution"]
    assert any(plan.assignments.get(i) for i in split), "no convolution is split"


@pytest.mark.slow
@pytest.mark.parametrize(("model", "mesh", "kind"), CELLS)
def test_xla_collectives_are_the_planned_ones(model, mesh, kind):
    _, plan, compiled, _ = _cell(model, mesh, kind)
    found = collectives(compiled.as_text(), plan.mesh)  # check_plan_collectives, compiled once
    compare(distinct_collectives(plan.reshards), found, plan.mesh)
    assert found or not plan.collectives()


def test_a_realistic_cnn_plans_data_parallel():
    """256 images of 64x64, 64/128 channels on 8 H100s: every convolution (forward and both
    gradients) splits the batch over dp, and the images are split on the way in."""
    step, args = jax_cnn.make_flax(batch=256, size=64, channels=(64, 128), abstract=True)
    plan = sp.plan(step, *args, mesh=sp.Mesh({"dp": 8}, cluster="h100-sxm"))
    assert plan.sharding_of("x").dims[0] == ("dp",)
    convs = [i for i, op in enumerate(plan.graph.ops) if op.kind == "convolution"]
    for i in convs:
        op = plan.graph.ops[i]
        batch = op.rule.operands[0][op.attrs["lhs_dims"][0]]  # wgrad: lhs "feature" is N
        batch = (
            batch
            if op.operands[0].type.shape[op.attrs["lhs_dims"][0]] == 256
            else (op.rule.operands[0][op.attrs["lhs_dims"][1]])
        )
        assert dict(plan.assignments[i]).get(batch[0]) == ("dp",), (op, plan.assignments[i])
