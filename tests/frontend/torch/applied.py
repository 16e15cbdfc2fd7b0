"""Shared by the emitter tests: apply a plan on simulated ranks and compare it with the plain
model (the loss and every gradient), with one device mesh per shape and world."""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from dataclasses import dataclass, field

import shardplan as sp
import torch
from shardplan.frontend.torch import simulate
from shardplan.frontend.torch.follow import follow_plan
from shardplan.frontend.torch.train import step_loss
from torch.distributed.device_mesh import init_device_mesh

_MESHES: dict[tuple, tuple[object, object]] = {}


def device_mesh(plan: sp.Plan):  # type: ignore[no-untyped-def]
    """One device mesh per shape and world: DTensor caches redistribution plans per (equal)
    mesh; a world of another size (a test on another mesh ran in between) destroys the
    process groups a mesh of the old world was built on."""
    simulate.simulated_world(plan.mesh.size)
    key = tuple(plan.mesh.axes)
    world = torch.distributed.group.WORLD
    if key not in _MESHES or _MESHES[key][0] is not world:
        sizes = tuple(plan.mesh.shape[a] for a in plan.mesh.axis_names)
        mesh = init_device_mesh("cpu", sizes, mesh_dim_names=plan.mesh.axis_names)
        _MESHES[key] = (world, mesh)
    return _MESHES[key][1]


@dataclass
class Applied:
    """One applied forward + backward on simulated ranks (rank 0's view)."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    observed: Counter[simulate.Collective]
    """Collectives the step issued: (kind, mesh axes, bytes per device)."""
    deviations: list[str] = field(default_factory=list)


def run_applied(plan, model, inputs, follow: bool = False) -> Applied:  # type: ignore[no-untyped-def]
    """Apply ``plan`` to a copy of ``model``; with ``follow`` every op runs at planned layouts."""
    mesh = device_mesh(plan)
    with simulate.local_ranks(plan.mesh.size):
        sharded = plan.apply(copy.deepcopy(model), mesh)
        replay = follow_plan(plan, mesh) if follow else contextlib.nullcontext()
        log = simulate.CollectiveLog(mesh)
        with log, replay as follower:
            loss = step_loss(sharded, inputs)
            loss.backward()
        grads = {n: simulate.rank0(p.grad) for n, p in sharded.named_parameters()}
    deviations = follower.deviations if follow else []
    return Applied(simulate.rank0(loss), grads, log.counts, deviations)


def check_numerics(plan, model, inputs, follow: bool = False, reference=None) -> Applied:  # type: ignore[no-untyped-def]
    """``plan`` applied to ``model`` gives ``reference``'s loss and gradients (default: a
    copy of ``model``, run plain)."""
    reference = copy.deepcopy(model) if reference is None else reference
    ref_loss = step_loss(reference, inputs)
    ref_loss.backward()
    applied = run_applied(plan, model, inputs, follow)
    loss, grads = applied.loss, applied.grads
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-4, atol=1e-6)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    return applied
