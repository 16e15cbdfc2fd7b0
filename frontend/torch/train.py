"""Train an applied plan for a few steps on simulated ranks (examples and smoke tests)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ...solver.plan import Plan
from . import simulate
from .trace import default_loss, split_inputs


def step_loss(model: nn.Module, inputs: Sequence[Any], loss_fn: Any = None) -> torch.Tensor:
    """The loss the captured step computes (the capture's default when ``loss_fn`` is None)."""
    args, kwargs = split_inputs(inputs)
    out = model(*args, **kwargs)
    return default_loss(out) if loss_fn is None else loss_fn(out, *args)


def train_simulated(
    plan: Plan, model: nn.Module, inputs: Sequence[Any], steps: int = 3, lr: float = 1e-3
) -> list[float]:
    """Apply ``plan`` to a copy of ``model`` on a fake world and run AdamW; rank-0 losses."""
    sizes = tuple(plan.mesh.shape[a] for a in plan.mesh.axis_names)
    simulate.simulated_world(plan.mesh.size)
    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=plan.mesh.axis_names)
    losses = []
    with simulate.local_ranks(plan.mesh.size):
        sharded = simulate.own_copies(plan.apply(copy.deepcopy(model), mesh))
        optimizer = torch.optim.AdamW(sharded.parameters(), lr=lr, foreach=False)
        for _ in range(steps):
            optimizer.zero_grad()
            loss = step_loss(sharded, inputs)
            loss.backward()
            optimizer.step()
            losses.append(float(simulate.rank0(loss)))
    return losses
