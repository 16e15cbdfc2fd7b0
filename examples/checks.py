"""The check every example ends with: the planned step computes what the unsharded step does.

Each example plans a model, prints the one-screen summary, runs the planned step (torch: DTensor
on simulated ranks, forward and backward; JAX: ``plan.jit`` on simulated CPU devices, a few
training steps) next to the plain model, and prints one line per check. A check that fails
exits with status 1 and says what differed, so running an example is a test
(``tests/test_example_scripts.py`` runs them all).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence
from typing import Any

RTOL = 1e-4


def _fail(message: str) -> None:
    print(f"CHECK FAILED: {message}", file=sys.stderr)
    raise SystemExit(1)


def _close(a: float, b: float, rtol: float = RTOL, atol: float = 1e-6) -> bool:
    return abs(a - b) <= atol + rtol * abs(b)


def _per_rank(tensor: Any) -> list[Any]:
    """Every simulated rank's value of a (local-)DTensor, as plain tensors."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    local = getattr(tensor, "_local_tensors", None)  # LocalTensor: one tensor per rank
    return [t.detach() for t in local.values()] if local is not None else [tensor.detach()]


def torch_check(plan: Any, model: Any, inputs: Sequence[Any]) -> None:
    """Apply the plan on simulated ranks, run forward and backward: on every rank the loss and
    every parameter's gradient must equal the unsharded model's."""
    import torch
    from shardplan.frontend.torch import simulate
    from shardplan.frontend.torch.train import step_loss
    from torch.distributed.device_mesh import init_device_mesh

    plain = copy.deepcopy(model)
    want_loss = step_loss(plain, inputs)
    want_loss.backward()
    want_loss = float(want_loss.detach())
    want = {name: p.grad for name, p in plain.named_parameters()}
    sizes = tuple(plan.mesh.shape[a] for a in plan.mesh.axis_names)
    simulate.simulated_world(plan.mesh.size)
    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=plan.mesh.axis_names)
    with simulate.local_ranks(plan.mesh.size):
        sharded = plan.apply(copy.deepcopy(model), mesh)
        loss = step_loss(sharded, inputs)
        loss.backward()
        losses = _per_rank(loss)
        grads = {name: _per_rank(p.grad) for name, p in sharded.named_parameters()}
    if not all(_close(float(x), want_loss) for x in losses):
        _fail(f"loss on the simulated ranks {[float(x) for x in losses]} != {want_loss}")
    for name, per_rank in grads.items():
        for got in per_rank:
            if not torch.allclose(got, want[name], rtol=RTOL, atol=1e-6):
                error = float((got - want[name]).abs().max())
                _fail(f"gradient of {name} differs from the unsharded model's by {error:.3g}")
    print(
        f"check passed: forward and backward of the applied plan on {plan.mesh.size} simulated "
        f"ranks: loss {want_loss:.5f} and all {len(grads)} parameter gradients equal the "
        f"unsharded model's on every rank (rtol {RTOL:g})"
    )


def jax_check(plan: Any, step: Any, args: tuple, steps: int = 3) -> None:
    """``plan.jit`` against ``jax.jit`` for ``steps`` steps (loss and every updated array), and
    the collectives XLA compiled against the plan's."""
    import jax
    import numpy as np
    from shardplan.frontend.jax.emit import make_jax_mesh
    from shardplan.frontend.jax.hlo import CollectiveMismatch, check_plan_collectives

    jitted, plain = plan.jit(step, make_jax_mesh(plan)), jax.jit(step)
    try:
        found = check_plan_collectives(plan, jitted, *args)
    except CollectiveMismatch as exc:
        _fail(str(exc))
    state, reference, losses = args, args, []
    for _ in range(steps):
        *carried, loss = jitted(*state)
        *carried_ref, loss_ref = plain(*reference)
        for got, want in zip(jax.tree.leaves(carried), jax.tree.leaves(carried_ref), strict=True):
            if not np.allclose(np.asarray(got), np.asarray(want), rtol=RTOL, atol=1e-6):
                _fail("an updated array of plan.jit differs from the unsharded jax.jit step")
        if not _close(float(loss), float(loss_ref)):
            _fail(f"loss {float(loss)} of plan.jit != {float(loss_ref)} unsharded")
        losses.append(float(loss))
        state = (*carried, args[-1])
        reference = (*carried_ref, args[-1])
    kinds: dict[str, int] = {}
    for c in found:
        kinds[c.kind] = kinds.get(c.kind, 0) + 1
    compiled = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "none"
    print(f"check passed: XLA compiled the collectives the plan predicts ({compiled})")
    print(
        f"check passed: {steps} steps of plan.jit on {plan.mesh.size} devices, losses "
        f"{', '.join(f'{x:.5f}' for x in losses)}, equal jax.jit's unsharded step "
        f"(loss and every updated array, rtol {RTOL:g})"
    )


def print_placements(plan: Any, shown: int = 4) -> None:
    """A few of the DTensor placements ``plan.apply`` gives the parameters."""
    placements = plan.to_placements()
    print(f"DTensor placements of {len(placements)} parameters on the device mesh, e.g.:")
    for fqn, placement in list(placements.items())[:shown]:
        print(f"  {fqn:44s} {placement}")
