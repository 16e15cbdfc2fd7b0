"""JAX serving steps (issue 19, point 1): a decoder with an explicit KV-cache pytree.

``kv_decoder.py``'s decode step (one token per sequence against a cache of ``context`` slots)
and prefill (the prompt written at slot 0) are planned on a 2-D mesh with ``mode=``. Checked
against the plan: the cache is a ``Role.KV_CACHE`` input aliased to the returned cache and
donated (XLA aliases the buffers), memory counts it once and exactly, ``plan.jit`` equals the
unsharded step (next-token logits rtol 1e-4, updated cache) and XLA's collectives are the
plan's. The TP baseline (``sp.strategies.megatron`` pins) puts the cache by KV heads over
``tp`` and the batch over ``dp``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import kv_decoder
import numpy as np
import pytest
import shardplan as sp
from shardplan.frontend.jax.capture import capture
from shardplan.frontend.jax.hlo import collectives, compare
from shardplan.frontend.jax.paths import distinct_collectives
from shardplan.ir import FrontendError, Role
from shardplan.ir.errors import ArgumentError

pytestmark = pytest.mark.jax

CONFIG = kv_decoder.DecoderConfig(d_model=64, n_heads=8, n_kv_heads=4, d_ff=128, batch=4)
MESH = {"dp": 2, "tp": 4}


@functools.cache
def _step(mode: str, scan: bool = False):
    return kv_decoder.make(mode, CONFIG, scan)


def _megatron_pins(fn, args, mode: str) -> dict:
    graph, _ = capture(fn, *args, mode=mode, context_len=CONFIG.context)
    mesh = sp.Mesh(MESH, cluster="cpu-test")
    by_name = {v.name: v for v in graph.inputs}
    pins = sp.strategies.megatron(tp="tp").pins(graph, mesh)
    return {by_name[name].origin.path: layout for name, layout in pins.items()}


@pytest.fixture(scope="module", params=[("decode", "megatron"), ("decode", "free-scan"),
                                        ("prefill", "megatron")])  # fmt: skip
def planned(request):
    """Megatron-pinned steps (the TP baseline) and the free plan of the scanned decoder (its
    layers and cache stacked under ``lax.scan``)."""
    mode, kind = request.param
    fn, args = _step(mode, kind.endswith("scan"))
    pins = _megatron_pins(fn, args, mode) if kind == "megatron" else None
    plan = sp.plan(fn, *args, mesh=sp.Mesh(MESH, cluster="cpu-test"), mode=mode,
                   context_len=CONFIG.context, pins=pins, time_limit=10)  # fmt: skip
    return mode, kind, fn, args, plan, plan.jit()


def _cache_inputs(plan):
    return [v for v in plan.graph.inputs if v.role is Role.KV_CACHE]


def test_the_cache_is_an_aliased_kv_cache_counted_once_exactly(planned) -> None:
    mode, kind, _, _, plan, _ = planned
    caches = _cache_inputs(plan)
    assert len(caches) == (2 if kind.endswith("scan") else 2 * CONFIG.layers)
    aliased = {plan.graph.inputs[i].name for i in plan.graph.output_aliases.values()}
    assert {v.name for v in caches} <= aliased
    mesh = plan.mesh
    exact = sum(v.type.nbytes // plan.shardings[v.name].shard_count(mesh) for v in caches)
    assert plan.memory_breakdown().by_category["kv_cache"] == exact
    if kind == "megatron":  # [batch, kv_heads, slot, head_dim]: batch over dp, heads over tp
        for v in caches:
            assert plan.shardings[v.name].dims == (("dp",), ("tp",), (), ())
        assert exact == 2 * CONFIG.layers * 4 * 4 * 16 * 8 * 4 // 8
    report = plan.serving
    assert report.mode == mode
    assert report.batch == CONFIG.batch
    assert report.tokens_per_step == CONFIG.batch * (1 if mode == "decode" else CONFIG.prompt)
    assert report.roofline.cache_bytes == exact
    assert "planned at its arguments' batch" in report.reason


def test_plan_jit_matches_the_unsharded_step_with_the_planned_collectives(planned) -> None:
    """One compile per cell: its HLO (collectives, buffer aliases) and its numerics."""
    _, kind, fn, args, plan, jitted = planned
    compiled = jitted.lower(*args).compile()
    hlo = compiled.as_text()
    found = collectives(hlo, plan.mesh)
    compare(distinct_collectives(plan.reshards), found, plan.mesh)  # raises on a mismatch
    if kind == "megatron":  # row-parallel wo / w_down: their sums are all-reduced over tp
        assert any(c.kind == "all-reduce" for c in found)
    assert "input_output_alias" in hlo  # the donated cache buffers are the outputs'
    want = jax.jit(fn)(*args)
    params, cache, tokens = args
    got = compiled(params, jax.tree.map(jnp.copy, cache), tokens)  # the cache is donated
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-4, atol=1e-6)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_serving_steps_are_checked() -> None:
    fn, args = _step("decode")
    with pytest.raises(FrontendError, match="needs context_len"):
        capture(fn, *args, mode="decode")
    prefill, prompt_args = _step("prefill")
    with pytest.raises(FrontendError, match="one token per sequence"):
        capture(prefill, *prompt_args, mode="decode", context_len=CONFIG.context)
    with pytest.raises(FrontendError, match="does not return its updated KV cache"):
        capture(lambda p, cache, t: fn(p, cache, t)[0], *args, mode="decode",
                context_len=CONFIG.context)  # fmt: skip
    with pytest.raises(FrontendError, match="needs the KV cache as an argument"):
        capture(lambda p, kv, t: fn(p, kv, t), *args, mode="decode", context_len=16)
    with pytest.raises(ArgumentError, match="planned at the batch of its example"):
        sp.plan(fn, *args, mesh=sp.Mesh(MESH, cluster="cpu-test"), mode="decode",
                context_len=CONFIG.context, max_batch=64)  # fmt: skip
