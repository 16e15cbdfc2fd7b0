"""A plan saved and loaded applies through the emitter registry (``Plan.apply`` dispatches to
``shardplan.frontend.torch.apply``) and trains as the plain module does."""

from __future__ import annotations

import copy

import pytest
import shardplan as sp
import torch
from shardplan.frontend.torch import simulate
from shardplan.frontend.torch.capture import capture
from shardplan.frontend.torch.train import step_loss
from shardplan.solver.planner import plan_graph
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

pytestmark = pytest.mark.torch


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def test_a_loaded_plan_applies_through_the_registry(tmp_path) -> None:
    """FSDP on dp=4, saved and loaded: the loaded plan's placements are the planned ones
    (no capture context needed), ``apply`` without a context says how to get one, and with
    the capture's context the applied module's loss and every gradient match the plain
    module's, with the weights split over dp."""
    torch.manual_seed(0)
    model, x = _MLP(), torch.randn(8, 16)
    graph, context = capture(model, x, stamp_layers=False)
    mesh = sp.Mesh({"dp": 4}, cluster="cpu-test")
    planned = plan_graph(graph, mesh, pins=sp.strategies.fsdp().pins(graph, mesh), time_limit=20,
                         semantics=context.partial_semantics, merge_followers=True)  # fmt: skip
    planned = planned.with_context(context)
    path = tmp_path / "plan.json"
    planned.save(path)
    loaded = sp.load_plan(path)
    assert loaded.to_placements() == planned.to_placements()
    assert any(isinstance(p, Shard) for ps in loaded.to_placements().values() for p in ps)

    simulate.simulated_world(mesh.size)
    device_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    with pytest.raises(sp.ShardplanError, match="no torch capture context"):
        loaded.apply(copy.deepcopy(model), device_mesh)

    reference = copy.deepcopy(model)
    ref_loss = step_loss(reference, (x,))
    ref_loss.backward()
    with simulate.local_ranks(mesh.size):
        sharded = loaded.with_context(context).apply(copy.deepcopy(model), device_mesh)
        loss = step_loss(sharded, (x,))
        loss.backward()
        weight = sharded.fc1.weight
        assert tuple(weight.placements) == (Shard(0),)  # FSDP: the weight's rows over dp
        grads = {n: simulate.rank0(p.grad) for n, p in sharded.named_parameters()}
        loss = simulate.rank0(loss)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-4, atol=1e-6)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
