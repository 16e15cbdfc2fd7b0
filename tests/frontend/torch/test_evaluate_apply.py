"""``sp.evaluate(module, ...).plan`` applies like ``sp.plan``'s: the evaluated strategy runs."""

from __future__ import annotations

import copy

import pytest
import shardplan as sp
import torch
from shardplan.frontend.torch import simulate
from shardplan.frontend.torch.train import step_loss
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

pytestmark = pytest.mark.torch


def test_evaluated_megatron_plan_applies_and_matches_the_plain_module(examples) -> None:  # type: ignore[no-untyped-def]
    model, inputs = examples["torch_mlp"].make(batch=8, dim=32, hidden=128, bias=False)
    mesh = sp.Mesh({"dp": 2, "tp": 2}, cluster="cpu-test")
    ev = sp.evaluate(model, *inputs, mesh=mesh, strategy=sp.strategies.megatron("tp"))
    plan = ev.plan
    placements = plan.to_placements()
    assert placements["fc1.weight"] == (Replicate(), Shard(0))  # column-parallel (out, in)
    assert placements["fc2.weight"] == (Replicate(), Shard(1))  # row-parallel

    reference = copy.deepcopy(model)
    ref_loss = step_loss(reference, inputs)
    ref_loss.backward()
    simulate.simulated_world(mesh.size)
    device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with simulate.local_ranks(mesh.size):
        sharded = plan.apply(copy.deepcopy(model), device_mesh)
        loss = step_loss(sharded, inputs)
        loss.backward()
        grads = {n: simulate.rank0(p.grad) for n, p in sharded.named_parameters()}
    torch.testing.assert_close(simulate.rank0(loss), ref_loss.detach(), rtol=1e-4, atol=1e-6)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
