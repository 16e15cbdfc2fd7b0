"""User sharding annotations in a torch model, read as planner pins.

Two ways to say a layout in torch code:

- ``shardplan.annotate(tensor, sharding)`` inside ``forward``: while shardplan captures the
  model it tags the tensor (an identity ``aten.alias`` carrying a ``pin:<k>`` mark, like the
  module marks of ``trace.py``), and the captured value is pinned; outside a capture it returns
  ``tensor`` unchanged (at run time the applied plan already lays the value out as pinned).
- parameters that are already DTensors: their placements on a ``DeviceMesh`` with
  ``mesh_dim_names`` become pins on the parameter (by FQN).

Placements map onto planner axes by mesh dimension name: ``Shard(d)`` on mesh dim ``i`` adds
``names[i]`` to tensor dim ``d`` (several mesh dims sharding one tensor dim split it major to
minor in mesh order, as DTensor does). ``Partial`` and ``_StridedShard`` (FSDP2 + TP) layouts
are refused: a pin cannot state them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

from ...ir import FrontendError, Sharding
from .trace import mark

SpecEntry = str | Sequence[str] | None
_PINS: ContextVar[list[Sharding] | None] = ContextVar("shardplan_torch_pins", default=None)
PIN_TAG = "pin:"


@contextlib.contextmanager
def collecting() -> Iterator[list[Sharding]]:
    """While capturing: ``annotate`` calls append their pin here and tag the tensor."""
    pins: list[Sharding] = []
    token = _PINS.set(pins)
    try:
        yield pins
    finally:
        _PINS.reset(token)


def annotate(
    tensor: torch.Tensor,
    sharding: Sharding | Sequence[SpecEntry] | None = None,
    *,
    placements: Sequence[Any] | None = None,
    mesh: Any = None,
) -> torch.Tensor:
    """Pin ``tensor``'s layout in the plan (GSPMD's ``with_sharding_constraint`` for torch).

    Give either ``sharding``: a ``shardplan.Sharding`` or a PartitionSpec-like sequence with
    one entry per dimension (``("dp", None)``, ``(("dp", "tp"), None)``), naming planner mesh
    axes; or DTensor ``placements`` with the ``mesh`` (a ``DeviceMesh`` whose
    ``mesh_dim_names`` are planner axes). Returns ``tensor`` (tagged while shardplan captures).
    """
    pin = to_sharding(tensor, sharding, placements, mesh)
    pins = _PINS.get()
    if pins is None:
        return tensor
    pins.append(pin)
    return mark(tensor, f"{PIN_TAG}{len(pins) - 1}")


def to_sharding(
    tensor: torch.Tensor,
    sharding: Sharding | Sequence[SpecEntry] | None,
    placements: Sequence[Any] | None,
    mesh: Any,
) -> Sharding:
    """The pin ``annotate`` was given, checked against the tensor's rank."""
    if (sharding is None) == (placements is None):
        raise FrontendError(
            "shardplan.annotate takes a sharding (Sharding or a spec such as ('dp', None)) "
            "or placements= with mesh=, exactly one of them"
        )
    if placements is not None:
        pin = from_placements(placements, _mesh_names(mesh), tensor.dim(), "annotate")
    elif isinstance(sharding, Sharding):
        pin = sharding
    else:
        pin = Sharding.of(*sharding)  # type: ignore[misc]
    if pin.has_sub_axes:  # a DTensor placement splits over whole mesh dims only
        sub = sorted(a for a in pin.used_axes if ":" in a)[0]
        raise FrontendError(
            f"shardplan.annotate: {pin} splits over sub-axis {sub!r}, part of a mesh axis; "
            "DTensor cannot run that layout, so torch annotations take whole axes"
        )
    if pin.rank != tensor.dim():
        raise FrontendError(
            f"shardplan.annotate: {pin} has {pin.rank} dimensions but the tensor "
            f"{tuple(tensor.shape)} has {tensor.dim()}; give one entry per dimension"
        )
    return pin


def _mesh_names(mesh: Any) -> tuple[str, ...]:
    names = getattr(mesh, "mesh_dim_names", None)
    if not names:
        raise FrontendError(
            "a DeviceMesh without mesh_dim_names cannot name planner axes; create it with "
            "init_device_mesh(..., mesh_dim_names=(...)) using the planner mesh's axis names"
        )
    return tuple(names)


def from_placements(
    placements: Sequence[Any], names: Sequence[str], rank: int, what: str
) -> Sharding:
    """DTensor placements on a mesh with dim ``names`` as a Sharding (see the module doc)."""
    from torch.distributed.tensor import Replicate, Shard

    if len(placements) != len(names):
        raise FrontendError(
            f"{what}: {len(placements)} placements for a mesh of {len(names)} dimensions"
        )
    dims: list[list[str]] = [[] for _ in range(rank)]
    for placement, name in zip(placements, names, strict=True):
        if type(placement) is Shard:
            dims[placement.dim % rank].append(name)
        elif not isinstance(placement, Replicate):
            raise FrontendError(
                f"{what}: placement {placement} on mesh dim {name!r} cannot be a pin (only "
                "Shard and Replicate can); give the tensor a Shard/Replicate layout"
            )
    return Sharding(tuple(tuple(d) for d in dims))


def dtensor_parameter_pins(model: nn.Module) -> dict[str, Sharding]:
    """Parameter FQN -> the placements of parameters that are DTensors, as pins."""
    from torch.distributed.tensor import DTensor

    pins: dict[str, Sharding] = {}
    for fqn, p in model.named_parameters():
        if isinstance(p, DTensor):
            names = _mesh_names(p.device_mesh)
            pins[fqn] = from_placements(p.placements, names, p.dim(), f"parameter {fqn}")
    return pins
