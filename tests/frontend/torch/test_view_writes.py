"""Writes into slice/select views (``frontend/torch/view_writes.py``): HF's label shift.

``shifted[:, 1:] = labels[:, :-1]`` and ``shifted[:, 0] = start`` run by ``follow_plan`` reach
the base ``masked_fill_`` then reads (before, the decoder read zeros: BART on (8,) free 4.1663
against 4.1289).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import shardplan as sp
import torch
from shardplan.frontend.torch import simulate
from shardplan.frontend.torch.capture import capture
from shardplan.frontend.torch.follow import follow_plan
from shardplan.solver.planner import plan_graph
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

pytestmark = pytest.mark.torch

VOCAB, WIDTH = 16, 8


class Shifted(nn.Module):
    """Decoder inputs made from the labels inside ``forward``, as HF's ``shift_tokens_right``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        shifted = labels.new_zeros(labels.shape)
        shifted[:, 1:] = labels[:, :-1].clone()
        shifted[:, 0] = 2
        shifted.masked_fill_(shifted == -100, 1)
        logits = self.head(self.embed(shifted) + self.embed(input_ids))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(1, VOCAB, (8, 6), generator=generator),
        "labels": torch.randint(1, VOCAB, (8, 6), generator=generator),
    }


@pytest.mark.slow
def test_followed_plan_shifts_labels_as_the_plain_model() -> None:
    torch.manual_seed(0)
    model, inputs = Shifted(), _inputs()
    mesh = sp.Mesh({"dp": 2, "tp": 4}, cluster="h100-sxm")
    graph, context = capture(model, **inputs, stamp_layers=False)
    plan = plan_graph(graph, mesh, pins=sp.strategies.fsdp().pins(graph, mesh), time_limit=10,
                      semantics=context.partial_semantics, merge_followers=True)  # fmt: skip
    plan = plan.with_context(context)
    reference = copy.deepcopy(model)
    loss = reference(**inputs)
    loss.backward()
    simulate.simulated_world(mesh.size)
    device_mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    for follow in (False, True):
        with simulate.local_ranks(mesh.size):
            sharded = plan.apply(copy.deepcopy(model), device_mesh)
            assert any(isinstance(p, Shard) for p in sharded.embed.weight.placements)
            with follow_plan(plan, device_mesh) if follow else contextlib.nullcontext() as follower:
                got = sharded(**inputs)
                got.backward()
            grads = {n: simulate.rank0(p.grad) for n, p in sharded.named_parameters()}
        torch.testing.assert_close(simulate.rank0(got), loss.detach(), rtol=1e-4, atol=1e-6)
        for name, p in reference.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
        if follow:
            assert not [d for d in follower.deviations if "new_zeros" in d or "base" in d]
