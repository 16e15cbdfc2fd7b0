"""Context parallelism through plan.jit: the tiny GPT's attention split along its queries.

One sequence of 256 tokens on the ``cpu-test`` cluster (compute-bound, no kernel floor), so
splitting the queries pays: the score einsum takes its queries split over ``cp`` and its keys
whole (XLA all-gathers them), and the key/value gradients come out as pending sums that
are reduced back. The emitted step must equal the unsharded one, loss and every gradient
(through the AdamW update), and XLA's collectives must be the planned ones.
"""

from __future__ import annotations

import functools

import jax
import jax_gpt
import numpy as np
import pytest
import shardplan as sp
from shardplan.frontend.jax.emit import make_jax_mesh
from shardplan.frontend.jax.hlo import check_plan_collectives
from shardplan.ir import Sharding

pytestmark = [pytest.mark.jax, pytest.mark.slow]

LAYER = "params['layers'][0]"


def _config(heads: int) -> jax_gpt.GPTConfig:
    return jax_gpt.GPTConfig(n_layers=1, adam_eps=1e-4, batch=1, seq=256, n_heads=heads)


def _tp_pins() -> dict[str, Sharding]:
    """Megatron attention on ``tp``: q/k/v column-parallel, the output projection row-parallel."""
    column, row = Sharding(((), ("tp",))), Sharding((("tp",), ()))
    pins = {f"{LAYER}['{w}']": column for w in ("wq", "wk", "wv")}
    pins[f"{LAYER}['wo']"] = row
    return pins


@functools.cache
def _planned(axes: tuple[tuple[str, int], ...], heads: int):
    step, args = jax_gpt.make(_config(heads))
    mesh = sp.Mesh(dict(axes), cluster="cpu-test")
    pins = _tp_pins() if "tp" in dict(axes) else None
    plan = sp.plan(step, *args, mesh=mesh, pins=pins, time_limit=120)
    return step, args, plan, plan.jit(step, make_jax_mesh(plan))


def _scores(plan: sp.Plan) -> tuple[Sharding, Sharding]:
    """Layouts of q[b,s,h,d] and k[b,t,h,d] at the forward score einsum (the first 4-D dot)."""
    for i, op in enumerate(plan.graph.ops):
        if op.kind == "dot_general" and op.operands[0].type.rank == 4:
            return plan.operand_shardings[(i, 0)], plan.operand_shardings[(i, 1)]
    raise AssertionError("no attention score einsum in the graph")


CASES = [((("cp", 2),), 1), ((("cp", 4),), 1), ((("cp", 2), ("tp", 2)), 2)]


@pytest.mark.parametrize(("axes", "heads"), CASES)
def test_queries_split_over_cp_and_keys_gathered(axes, heads):
    _, _, plan, _ = _planned(axes, heads)
    q, k = _scores(plan)
    assert q.dims[1] == ("cp",)  # queries split
    assert "cp" not in k.dims[1]  # keys whole on every device
    if heads > 1:
        assert q.dims[2] == k.dims[2] == ("tp",)  # heads on tp, as pinned


@pytest.mark.parametrize(("axes", "heads"), CASES)
def test_context_parallel_step_matches_unsharded(axes, heads):
    step, args, _, jitted = _planned(axes, heads)
    got, want = jitted(*args), jax.jit(step)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("axes", "heads"), CASES)
def test_context_parallel_collectives_are_the_planned_ones(axes, heads):
    _, args, plan, jitted = _planned(axes, heads)
    found = check_plan_collectives(plan, jitted, *args)
    assert any(c.kind == "all-gather" and "cp" in c.axes for c in found)
