"""Capture: jaxpr -> IR graph (kinds, rules, roles, paths, aliases, scans)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import jax_gpt
import jax_mlp
import pytest
from shardplan.frontend.jax.capture import capture, default_role
from shardplan.ir import Role, UnsupportedOpWarning, op_flops

pytestmark = pytest.mark.jax


def _capture_quiet(fn, *args, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsupportedOpWarning)
        return capture(fn, *args, **options)


def test_capture_mlp_lowers_every_equation():
    step, args = jax_mlp.make()
    graph, context = _capture_quiet(step, *args)
    kinds = [op.kind for op in graph.ops]
    assert kinds.count("dot_general") == 5
    assert len(graph.inputs) == len(context.arg_inputs) == 10
    assert len(graph.outputs) == len(context.outputs) == 9


def test_capture_backward_dots_follow_dimension_numbers():
    step, args = jax_mlp.make()
    graph, _ = _capture_quiet(step, *args)
    dims = {
        (op.attrs["lhs_contracting"], op.attrs["rhs_contracting"])
        for op in graph.ops
        if op.kind == "dot_general"
    }
    assert dims == {((1,), (0,)), ((0,), (0,)), ((1,), (1,))}
    weight_grad = next(
        op for op in graph.ops if op.kind == "dot_general" and op.attrs["lhs_contracting"] == (0,)
    )
    assert weight_grad.rule.reduction == {weight_grad.rule.operands[0][0][0]}  # batch reduces


def test_capture_paths_roles_and_aliases():
    step, args = jax_mlp.make()
    graph, _ = _capture_quiet(step, *args)
    by_path = {v.origin.path: v for v in graph.inputs}
    assert by_path["params['w1']"].role is Role.PARAMETER
    assert by_path["opt_state['mu']['w1']"].role is Role.OPTIMIZER_STATE
    assert by_path["batch['x']"].role is Role.INPUT
    # outputs (params, opt_state, loss): the first 8 replace the inputs they update
    assert graph.output_aliases == {i: i for i in range(8)}


def test_capture_roles_option_overrides_the_heuristic():
    step, args = jax_mlp.make()
    graph, _ = _capture_quiet(step, *args, roles={"batch['y']": Role.CONSTANT})
    assert {v.origin.path: v.role for v in graph.inputs}["batch['y']"] is Role.CONSTANT
    assert default_role(["state", "opt_state", "mu"]) is Role.OPTIMIZER_STATE


def test_capture_from_shape_dtype_structs_allocates_nothing():
    config = jax_gpt.GPTConfig(vocab=32000, d_model=4096, n_heads=32, d_ff=11008, seq=2048)
    step, args = jax_gpt.make(config, abstract=True)
    graph, _ = _capture_quiet(step, *args)
    embed = next(v for v in graph.inputs if v.origin.path == "params['embed']")
    assert embed.type.shape == (32000, 4096)


def test_capture_gpt_maps_embeddings_and_attention():
    step, args = jax_gpt.make()
    graph, _ = _capture_quiet(step, *args)
    kinds = {op.kind for op in graph.ops}
    assert {"embedding", "embedding_backward", "xla_gather", "xla_scatter_add"} <= kinds
    embedding = next(op for op in graph.ops if op.kind == "embedding")
    assert embedding.origin.source.startswith("jax_gpt.py:")
    scores = [op for op in graph.ops if op.kind == "dot_general" and op.attrs["lhs_batch"]]
    assert scores
    assert scores[0].attrs["lhs_batch"] == (0, 2)


def _scanned(n_layers: int, **options):
    step, args = jax_gpt.make(jax_gpt.GPTConfig(scan_layers=True, n_layers=n_layers), abstract=True)
    return _capture_quiet(step, *args, **options)


def _total_flops(graph) -> float:
    def flops(op):
        ins, outs = [v.type for v in op.operands], [r.type for r in op.results]
        return op_flops(op.kind, op.rule, ins, outs)

    return sum(op.repeat * flops(op) for op in graph.ops)


def test_capture_scan_walks_the_body_once():
    (graph, context), (deep, _) = _scanned(2), _scanned(6)
    assert len(deep.ops) == len(graph.ops)  # the body once, whatever the layer count
    assert len(context.steps) == len(context.step_uses)
    body = [op for op in deep.ops if op.repeat == 6]
    assert sum(op.kind == "dot_general" for op in body) >= 7 * 2  # forward and backward
    boundary = {op.kind for op in deep.ops if op.kind.startswith("scan_")}
    assert boundary == {"scan_carry", "scan_index", "scan_loop", "scan_stack"}
    for op in deep.ops:
        if op.kind == "scan_index":  # the stacked operand's iteration dim is never split
            assert op.repeat == 1
            assert op.rule.need_replication
        if op.kind == "scan_loop":  # handed back in the layout the carry entered with
            assert deep.value(op.attrs["carry"]).producer.kind == "scan_carry"
    # the same work as capturing every iteration on its own
    unrolled, _ = _scanned(6, unroll_scans=True)
    assert _total_flops(deep) == pytest.approx(_total_flops(unrolled), rel=1e-12)
    assert len(unrolled.ops) > 2 * len(deep.ops)


def test_capture_scan_unrolled_has_every_layer_with_module_paths():
    step, args = jax_gpt.make(jax_gpt.GPTConfig(scan_layers=True, n_layers=3))
    graph, context = _capture_quiet(step, *args, unroll_scans=True)
    modules = {op.origin.module for op in graph.ops}
    assert {"layers.0", "layers.1", "layers.2"} <= modules
    # forward residuals go straight to the backward scan: only weight gradients are stacked
    stacked = [op for op in graph.ops if op.kind == "concat"]
    assert len(stacked) == len(jax_gpt._layer_shapes(jax_gpt.GPTConfig()))
    assert len(context.steps) == len(context.step_uses)


def test_capture_inlines_remat_custom_vjp_and_jit():
    @jax.custom_vjp
    def scale(x):
        return 3.0 * x

    scale.defvjp(lambda x: (3.0 * x, None), lambda _, g: (3.0 * g,))

    @jax.checkpoint
    def layer(w, x):
        return jnp.tanh(jax.jit(jnp.dot)(x, w))

    def loss(w, x):
        return jnp.sum(scale(layer(w, x)) ** 2)

    graph, _ = _capture_quiet(jax.grad(loss), jnp.ones((8, 4)), jnp.ones((2, 8)))
    assert not {"remat2", "checkpoint", "jit", "custom_vjp_call"} & {op.kind for op in graph.ops}


def test_capture_unknown_primitive_warns_with_its_name():
    def factor(x):  # pooling (reduce_window_max) has a rule since issue 36: cholesky has none
        return jax.lax.linalg.cholesky(x)

    with pytest.warns(UnsupportedOpWarning, match="cholesky"):
        graph, _ = capture(factor, jnp.eye(4))
    op = next(op for op in graph.ops if op.kind == "cholesky")
    assert op.rule.need_replication == set(op.rule.factor_names)
