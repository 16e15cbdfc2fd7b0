"""FSDP2 from a plan, checked with real gloo processes (torch.multiprocessing.spawn)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import shardplan as sp
import torch
from shardplan.frontend.torch.gloo import load_factory, run_on_gloo
from shardplan.frontend.torch.train import step_loss

pytestmark = [pytest.mark.torch, pytest.mark.slow]

FACTORY = str(Path(__file__).resolve().parents[3] / "examples" / "torch_mlp.py") + ":make"
SHAPES = {"batch": 1024, "dim": 32, "hidden": 64}


def test_fsdp2_plan_matches_plain_module_with_gloo() -> None:
    model, (x,) = load_factory(FACTORY)(**SHAPES)
    # Data loading splits the batch; the solver then shards parameters and states (ZeRO-3).
    pins = {"x": sp.Sharding.of("dp", None)}
    plan = sp.plan(model, x, mesh=sp.Mesh({"dp": 2}, cluster="cpu-test"), pins=pins)
    parallel = plan.to_parallelize_plan()
    assert parallel.fully_shard, f"expected an FSDP plan, got:\n{parallel}"
    reference = copy.deepcopy(model)
    ref_loss = step_loss(reference, (x,))
    ref_loss.backward()
    result = run_on_gloo(parallel, FACTORY, world=2, **SHAPES)
    # FSDP2 averages gradients over dp; the mean of per-shard mean losses is the global mean.
    torch.testing.assert_close(result["loss"], ref_loss.detach(), rtol=1e-4, atol=1e-6)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(result["grads"][name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
