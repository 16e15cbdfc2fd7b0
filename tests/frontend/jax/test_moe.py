"""A GShard-style JAX MoE layer (``jax_moe.py``) planned on a 2-D mesh (issue 18).

Two plans share the module's captures: the planner's free choice, and GShard's annotation
(dispatched buffer experts-over-``ep``, groups-over-``dp``). Both run through ``plan.jit`` on 8
simulated devices with the unsharded step's numerics, and XLA's collectives are the plan's
(kind, bytes, axes); the annotated plan moves tokens to their experts by all-to-all.
"""

from __future__ import annotations

import functools

import jax
import jax_moe
import numpy as np
import pytest
import shardplan as sp
from jax.sharding import AxisType
from shardplan.frontend.jax.emit import make_jax_mesh
from shardplan.frontend.jax.hlo import check_plan_collectives

pytestmark = [pytest.mark.jax, pytest.mark.filterwarnings("error::UserWarning")]

MESH = sp.Mesh({"dp": 2, "ep": 4}, cluster="h100-sxm")
CONFIG = jax_moe.MoEConfig(groups=8, tokens=64, hidden=256, ffn=1024, capacity_factor=1.0)
DATA = sp.Sharding((("dp", "ep"), (), ()))
"""The batch's groups over every device (data parallel input): GShard's layout of ``x``."""


@functools.cache
def _planned(annotated: bool):
    experts_on = None
    if annotated:
        jax_mesh = jax.make_mesh((2, 4), ("dp", "ep"), axis_types=(AxisType.Auto,) * 2)
        experts_on = (jax_mesh, "ep", "dp")
    step, args = jax_moe.make(CONFIG, experts_on)
    pins = {"batch['x']": DATA, "batch['y']": DATA} if annotated else None
    plan = sp.plan(step, *args, mesh=MESH, pins=pins, time_limit=60)
    return step, args, plan, plan.jit(step, make_jax_mesh(plan))


@pytest.mark.parametrize("annotated", [False, True], ids=["free", "gshard"])
def test_moe_plan_jit_matches_unsharded_step_and_its_collectives(annotated):
    step, args, plan, jitted = _planned(annotated)
    for got, want in zip(
        jax.tree.leaves(jitted(*args)), jax.tree.leaves(jax.jit(step)(*args)), strict=True
    ):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
    found = check_plan_collectives(plan, jitted, *args)
    assert found or not plan.collectives()


def test_gshard_plan_splits_experts_over_ep_and_dispatches_by_all_to_all():
    _, args, plan, jitted = _planned(True)
    w_in = next(v for v in plan.graph.inputs if "w_in" in v.origin.path)
    assert plan.sharding_of(w_in.name).dims[0] == ("ep",)
    compiled = [c.kind for c in check_plan_collectives(plan, jitted, *args)]  # equal elements
    predicted = [c.kind for c in plan.collectives()]
    # tokens to experts and back, forward and backward (XLA may fuse two into one instruction)
    assert predicted.count("all-to-all") >= 4, predicted
    assert "all-to-all" in compiled, compiled
