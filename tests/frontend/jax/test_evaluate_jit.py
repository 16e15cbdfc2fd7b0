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
