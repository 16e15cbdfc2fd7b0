"""``sp.evaluate(fn, ...).plan`` jits like ``sp.plan``'s: the evaluated strategy runs."""

from __future__ import annotations

import jax
import jax_mlp
import numpy as np
import pytest
import shardplan as sp
from shardplan.frontend.jax.emit import make_jax_mesh

pytestmark = pytest.mark.jax


def test_evaluated_fsdp_plan_jits_and_matches_the_unsharded_step() -> None:
    step, args = jax_mlp.make()
    mesh = sp.Mesh({"dp": 4, "tp": 2}, cluster="cpu-test")
    ev = sp.evaluate(step, *args, mesh=mesh, strategy=sp.strategies.fsdp())
    plan = ev.plan
    # FSDP: every weight matrix is sharded over both data axes (dp and tp here)
    params = plan.parameter_shardings()
    assert any(s.shard_count(mesh) == 8 for s in params.values())
    jitted = plan.jit(step, make_jax_mesh(plan))
    for got, want in zip(jax.tree.leaves(jitted(*args)), jax.tree.leaves(jax.jit(step)(*args)),
                         strict=True):  # fmt: skip
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)


def test_prefer_throughput_plan_jits_as_data_parallel() -> None:
    """The example MLP step on 8 H100s: the free plan repeats the step on every device (and
    warns); ``prefer="throughput"`` splits the batch over dp×tp, its ``plan.jit`` equals the
    unsharded step and XLA compiles the collectives the plan predicts."""
    from shardplan.frontend.jax.hlo import check_plan_collectives
    from shardplan.solver.summary import batch_axes

    step, args = jax_mlp.make()
    mesh = sp.Mesh({"dp": 4, "tp": 2}, cluster="h100-sxm")
    with pytest.warns(sp.IdleDevicesWarning, match="repeat the same work"):
        free = sp.plan(step, *args, mesh=mesh, time_limit=10)
    plan = sp.plan(step, *args, mesh=mesh, time_limit=10, prefer="throughput")
    assert not batch_axes(free)
    assert batch_axes(plan) == ["dp", "tp"]
    assert plan.idle.free.step == free.step_time
    assert plan.idle.split.step == plan.step_time
    jitted = plan.jit(step, make_jax_mesh(plan))
    found = check_plan_collectives(plan, jitted, *args)
    assert any(c.kind in ("all-reduce", "reduce-scatter") for c in found)  # the gradients
    for got, want in zip(jax.tree.leaves(jitted(*args)), jax.tree.leaves(jax.jit(step)(*args)),
                         strict=True):  # fmt: skip
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)
