"""Train an applied plan for a few steps on simulated ranks (examples and smoke tests)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ...ir import FrontendError
from ...solver.plan import Plan
from . import simulate
from .trace import default_loss, split_inputs


def step_loss(
    model: nn.Module, inputs: Sequence[Any], loss_fn: Any = None, loss_inputs: Sequence = ()
) -> torch.Tensor:
    """The loss the captured step computes (the capture's default when ``loss_fn`` is None;
    ``loss_fn(output, *loss_inputs)`` with ``loss_inputs``, else ``loss_fn(output, *args)``)."""
    args, kwargs = split_inputs(inputs)
    out = model(*args, **kwargs)
    if loss_fn is None:
        return default_loss(out)
    return loss_fn(out, *(loss_inputs or args))


def distribute_loss_inputs(plan: Plan, device_mesh: DeviceMesh, loss_inputs: Sequence) -> tuple:
    """``loss_inputs`` (targets only ``loss_fn`` reads, ``sp.plan(..., loss_inputs=(y,))``) as
    DTensors at their planned layouts, for ``loss_fn(applied_model(x), *these)``."""
    from torch.distributed.tensor import distribute_tensor

    from .emit import context_of, placements_of
    from .inputs import map_tree

    context = context_of(plan)
    values = dict(zip(context.input_slots, context.input_values, strict=True))

    def distribute(path: str, x: torch.Tensor) -> torch.Tensor:
        if path not in values:
            raise FrontendError(
                f"{path} is not a loss input of this plan; give the loss_inputs it was planned with"
            )
        placements = placements_of(plan.shardings[values[path]], plan.mesh, values[path])
        return distribute_tensor(x, device_mesh, list(placements), src_data_rank=None)

    return tuple(map_tree(tuple(loss_inputs), "loss_inputs", distribute))


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
