"""A Plan's layouts as DTensor placements: per parameter, per consumed value, per mesh dim.

Placements are per mesh dimension in the plan mesh's axis order: mesh axis ``a`` splitting
tensor dim ``d`` is ``Shard(d)``, a partial axis is ``Partial()``, an unused one ``Replicate()``.
Imports no other emission module (``emit``, ``apply_mode``, ``follow`` and ``reshard`` import
it).
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from ...ir import FrontendError, Mesh, Role, Sharding
from ...solver.plan import Plan
from .capture import TorchContext

Placements = tuple[Placement, ...]


def placements_of(sharding: Sharding, mesh: Mesh, value: str = "") -> Placements:
    """DTensor placements (one per mesh axis, mesh order) of an IR sharding.

    A dim split over several axes must list them in mesh order (major first), which is what
    DTensor's default shard order means; the reverse needs ``_StridedShard`` and is refused.
    A Shardy sub-axis (``"x":(1)2``, from propagation through a reshape inside an axis) is
    refused too: a placement shards a tensor dim over a whole mesh dim, never part of one, and
    lowering it to the whole axis would put different data on the devices than planned.
    ``value`` names the tensor in that error.
    """
    if sharding.has_sub_axes:
        sub = sorted(a for a in sharding.used_axes if ":" in a)[0]
        base, rest = sub.split(":", 1)
        raise FrontendError(
            f"{'%' + value + ' has ' if value else ''}sharding {sharding}, which splits over "
            f'sub-axis "{base}":{rest} of mesh axis {base!r}; DTensor placements can only '
            "shard over whole mesh dims. hint: pin the tensor (or the reshape's operand) to "
            "whole axes, or plan without the pin that propagated the sub-axis"
        )
    out: list[Placement] = []
    for axis in mesh.axis_names:
        if axis in sharding.partial:
            out.append(Partial())
            continue
        dims = [d for d, axes in enumerate(sharding.dims) if axis in axes]
        out.append(Shard(dims[0]) if dims else Replicate())
    for d, axes in enumerate(sharding.dims):
        order = [mesh.axis_index(a) for a in axes]
        if order != sorted(order):
            raise FrontendError(
                f"dimension {d} of sharding {sharding} is split over {axes}, minor mesh axis "
                "first; DTensor's public placements cannot express it (needs _StridedShard). "
                "hint: pin the dimension to mesh order"
            )
    return tuple(out)


def context_of(plan: Plan) -> TorchContext:
    context = plan.frontend_context
    if not isinstance(context, TorchContext):
        raise FrontendError(
            "this plan has no torch capture context (it was loaded from JSON or planned from an "
            "IR graph); re-plan with shardplan.plan(model, *inputs, mesh=...) to emit for torch"
        )
    return context


def to_placements(plan: Plan) -> dict[str, Placements]:
    """``{param_fqn: placements}`` for every parameter, tied aliases included.

    Works without a capture context too (a loaded plan): then graph inputs with the PARAMETER
    role are keyed by their origin path.
    """
    context = plan.frontend_context
    if not isinstance(context, TorchContext):
        return {
            v.origin.path or v.name: placements_of(plan.shardings[v.name], plan.stage_mesh, v.name)
            for v in plan.graph.inputs
            if v.role is Role.PARAMETER
        }
    result = {fqn: _param_placements(plan, name) for fqn, name in context.param_values.items()}
    for alias, canonical in context.tied.items():
        result[alias] = result[canonical]
    return result


def _param_placements(plan: Plan, value: str) -> Placements:
    """A parameter's placements; a (meaningless) partial parameter is stored replicated."""
    return tuple(
        Replicate() if isinstance(p, Partial) else p
        for p in placements_of(plan.shardings[value], plan.stage_mesh, value)
    )


def consumed_layout(plan: Plan, value: str, within: str | None = None) -> Sharding:
    """The layout the first consumer of ``value`` (inside module ``within``) computes with."""
    for index, op in enumerate(plan.graph.ops):
        if within is not None and not _inside(op.origin.module, within):
            continue
        for j, operand in enumerate(op.operands):
            if operand.name == value:
                return plan.operand_shardings.get((index, j), plan.shardings[value])
    return plan.shardings[value]


def _inside(module: str, prefix: str) -> bool:
    return prefix == "" or module == prefix or module.startswith(prefix + ".")


def check_mesh(plan: Plan, device_mesh: DeviceMesh) -> None:
    names = tuple(device_mesh.mesh_dim_names or ())
    shape = tuple(device_mesh.shape)
    want = plan.mesh.axis_names
    if names != want or shape != tuple(plan.mesh.shape[a] for a in want):
        raise FrontendError(
            f"device mesh {dict(zip(names, shape, strict=False))} does not match the plan mesh "
            f"{plan.mesh}; build it with init_device_mesh(device, "
            f"{tuple(plan.mesh.shape[a] for a in want)}, mesh_dim_names={want})"
        )


def flattened_meshes(device_mesh: DeviceMesh) -> dict[tuple[str, ...], DeviceMesh]:
    """One flattened mesh per ascending group of two or more mesh dims (sizes > 1).

    The cost model prices a collective over several axes as one (XLA's replica groups);
    DTensor issues one per mesh dimension unless a flattened mesh over those dimensions
    exists, in which case it merges consecutive all-gathers, reduce-scatters and all-reduces
    into one collective on it. Made once per device mesh (DTensor caches them on the root).
    Private: ``DeviceMesh._flatten`` is the only way to register such a mesh with DTensor.
    """
    import itertools

    names = tuple(device_mesh.mesh_dim_names or ())
    dims = [n for n, size in zip(names, device_mesh.shape, strict=True) if size > 1]
    out: dict[tuple[str, ...], DeviceMesh] = {}
    for k in range(2, len(dims) + 1):
        for group in itertools.combinations(dims, k):
            out[group] = device_mesh[group]._flatten("_".join(group))
    return out
