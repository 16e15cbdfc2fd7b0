"""Ops without a DTensor strategy (``fallback.py``): applied plans run them whole or on local
shards, with the plain model's numerics, under ``plan.apply`` and ``follow_plan``."""

from __future__ import annotations

import contextlib
import copy

import pytest
import shardplan as sp
import torch
from shardplan.frontend.torch import simulate
from shardplan.frontend.torch.capture import capture
from shardplan.frontend.torch.follow import follow_plan
from shardplan.frontend.torch.train import step_loss
from shardplan.solver.planner import plan_graph
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

pytestmark = [pytest.mark.torch, pytest.mark.slow]


class _Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(64, 16, mode="mean")
        self.head = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(ids)).square().mean()


class _Recurrent(nn.Module):
    def __init__(self, cell: type[nn.Module]) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16)
        self.rnn = cell(16, 16, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.rnn(self.proj(x))
        return self.head(y).square().mean()


def _model(name: str) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    if name == "embedding_bag":  # aten._embedding_bag
        return _Bag(), (torch.randint(0, 64, (16, 4)),)
    cell = {"lstm": nn.LSTM, "gru": nn.GRU}[name]  # mkldnn_rnn_layer; transpose_ (GRU)
    return _Recurrent(cell), (torch.randn(16, 6, 8),)


_MESHES: dict[tuple, object] = {}


def _device_mesh(mesh: sp.Mesh):  # type: ignore[no-untyped-def]
    key = tuple(mesh.axes)
    if key not in _MESHES:
        simulate.simulated_world(mesh.size)
        sizes = tuple(mesh.shape[a] for a in mesh.axis_names)
        _MESHES[key] = init_device_mesh("cpu", sizes, mesh_dim_names=mesh.axis_names)
    return _MESHES[key]


@pytest.mark.parametrize("name", ["embedding_bag", "lstm", "gru"])
def test_fallback_fsdp_numerics_match_plain_model(name: str) -> None:
    """FSDP on (2, 4): every parameter split, loss and every gradient as the plain model's."""
    model, inputs = _model(name)
    mesh = sp.Mesh({"dp": 2, "tp": 4}, cluster="h100-sxm")
    graph, context = capture(model, *inputs, stamp_layers=False)
    pins = sp.strategies.fsdp().pins(graph, mesh)
    plan = plan_graph(graph, mesh, pins=pins, time_limit=30,
                      semantics=context.partial_semantics, merge_followers=True)  # fmt: skip
    plan = plan.with_context(context)
    reference = copy.deepcopy(model)
    loss = step_loss(reference, inputs)
    loss.backward()
    device_mesh = _device_mesh(mesh)
    for follow in (False, True):
        with simulate.local_ranks(mesh.size):
            sharded = plan.apply(copy.deepcopy(model), device_mesh)
            split = [n for n, p in sharded.named_parameters()
                     if any(isinstance(x, Shard) for x in p.placements)]  # fmt: skip
            op_weight = "bag.weight" if name == "embedding_bag" else "rnn.weight_ih_l0"
            assert op_weight in split, f"the FSDP plan leaves {op_weight} whole: {split}"
            replay = follow_plan(plan, device_mesh) if follow else contextlib.nullcontext()
            with replay:
                got = step_loss(sharded, inputs)
                got.backward()
            grads = {n: simulate.rank0(p.grad) for n, p in sharded.named_parameters()}
        torch.testing.assert_close(simulate.rank0(got), loss.detach(), rtol=1e-4, atol=1e-7)
        for n, p in reference.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-7, msg=n)
