"""Compile a Plan into ``parallelize_module`` styles and ``fully_shard`` calls (torchtitan shape).

Axes that split the batch of the example inputs are data-parallel; a parameter sharded over one
of them is FSDP (``fully_shard`` on that axis). One other axis may carry tensor parallelism:
``nn.Linear`` weights ``Shard(0)`` there are ``ColwiseParallel``, ``Shard(1)`` ``RowwiseParallel``
(``nn.Embedding``: ``Shard(1)`` / ``Shard(0)``). Whatever does not fit these shapes (several
tensor-parallel axes, a parameter split over two axes, a layout a style would not produce) is
listed in ``fallback`` with its placements: use ``plan.apply`` for those.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ...solver.plan import Plan
from .emit import Placements, context_of, to_placements


@dataclass
class ParallelizePlan:
    """Styles for ``parallelize_module(model, mesh[tp_axis], styles)``, then FSDP2 wrapping."""

    styles: dict[str, Any] = field(default_factory=dict)
    """Module path or pattern (``model.layers.*.mlp.up_proj``) -> ParallelStyle."""
    tp_axis: str | None = None
    dp_axes: tuple[str, ...] = ()
    fully_shard: list[str] = field(default_factory=list)
    """Modules to ``fully_shard`` over ``dp_axes``, bottom-up; ``""`` is the root."""
    fallback: dict[str, Placements] = field(default_factory=dict)
    """Parameters whose planned placements no style produces (apply them with plan.apply)."""
    notes: list[str] = field(default_factory=list)

    @property
    def expressible(self) -> bool:
        return not self.fallback

    def apply(self, model: nn.Module, device_mesh: Any) -> nn.Module:
        """``parallelize_module`` on the TP sub-mesh, then ``fully_shard`` bottom-up on dp."""
        from torch.distributed.fsdp import fully_shard

        if self.tp_axis and self.styles:
            parallelize_module(model, device_mesh[self.tp_axis], self.styles)
        if self.fully_shard:
            dp_mesh = device_mesh[self.dp_axes[0] if len(self.dp_axes) == 1 else self.dp_axes]
            for path in self.fully_shard:
                fully_shard(model.get_submodule(path) if path else model, mesh=dp_mesh)
        return model

    def __str__(self) -> str:
        lines = [f"tensor parallel axis: {self.tp_axis}; data parallel axes: {self.dp_axes}"]
        lines += [f"  {path}: {style!r}" for path, style in self.styles.items()]
        if self.fully_shard:
            lines.append(f"fully_shard over {self.dp_axes}: {self.fully_shard}")
        lines += [f"  not expressible: {fqn} {p}" for fqn, p in self.fallback.items()]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def batch_axes(plan: Plan) -> tuple[str, ...]:
    """Mesh axes that split dim 0 of the example inputs (the data-parallel axes)."""
    context = context_of(plan)
    axes: list[str] = []
    for value in context.input_values:
        sharding = plan.shardings[value]
        if sharding.rank:
            axes += [a for a in sharding.dims[0] if a not in axes]
    return tuple(a for a in plan.mesh.axis_names if a in axes)


def to_parallelize_plan(plan: Plan) -> ParallelizePlan:
    """See the module docstring."""
    model_params = to_placements(plan)
    mesh_axes = plan.mesh.axis_names
    # An axis that splits some weight on a dim other than 0 is tensor parallel even when it
    # also splits the batch (fully_shard only ever shards dim 0).
    row_split = {
        mesh_axes[i]
        for placements in model_params.values()
        for i, p in enumerate(placements)
        if isinstance(p, Shard) and p.dim != 0
    }
    dp = tuple(a for a in batch_axes(plan) if a not in row_split)
    result = ParallelizePlan(dp_axes=dp)
    tp_candidates = {
        mesh_axes[i]
        for placements in model_params.values()
        for i, p in enumerate(placements)
        if isinstance(p, Shard) and mesh_axes[i] not in dp
    }
    if len(tp_candidates) > 1:
        result.notes.append(f"parameters are split over several non-batch axes {tp_candidates}")
    result.tp_axis = sorted(tp_candidates)[0] if len(tp_candidates) == 1 else None
    fsdp = approximated = False
    for fqn, placements in model_params.items():
        per_axis = dict(zip(mesh_axes, placements, strict=True))
        fsdp |= any(isinstance(per_axis[a], Shard) for a in dp)
        approximated |= any(per_axis[a] not in (Shard(0), Replicate()) for a in dp)
        if any(
            isinstance(per_axis[a], Shard) for a in mesh_axes if a not in dp and a != result.tp_axis
        ):
            result.fallback[fqn] = placements
    _styles(plan, result, model_params)
    if fsdp:
        result.fully_shard = _fsdp_units(plan)
    if approximated:
        result.notes.append(
            "fully_shard shards every parameter's dim 0 over the data axes; planned dp "
            "placements on other dims are approximated"
        )
    return result


def _styles(plan: Plan, result: ParallelizePlan, params: dict[str, Placements]) -> None:
    """One Colwise/Rowwise style per Linear/Embedding whose TP placements match one."""
    if result.tp_axis is None:
        return
    tp = plan.mesh.axis_names.index(result.tp_axis)
    kinds = context_of(plan).module_kinds
    per_module: dict[str, Any] = {}
    for fqn, placements in params.items():
        module, _, name = fqn.rpartition(".")
        style = _style_for(kinds.get(module, ""), name, placements[tp])
        if style is None:
            if isinstance(placements[tp], Shard):
                result.fallback.setdefault(fqn, placements)
            continue
        if name == "weight":
            per_module[module] = style
    for fqn in list(params):
        module, _, name = fqn.rpartition(".")
        if name == "bias" and module in per_module:
            want = Shard(0) if isinstance(per_module[module], ColwiseParallel) else Replicate()
            if params[fqn][tp] != want:
                result.fallback.setdefault(fqn, params[fqn])
    result.styles = _collapse(per_module)


def _style_for(kind: str, name: str, placement: Any) -> Any:
    if name != "weight" or not isinstance(placement, Shard):
        return None
    column = {"Linear": 0, "Embedding": 1}.get(kind)
    if column is None:
        return None
    return ColwiseParallel() if placement.dim == column else RowwiseParallel()


def _collapse(per_module: dict[str, Any]) -> dict[str, Any]:
    """``layers.0.x`` .. ``layers.N.x`` with one style become ``layers.*.x``."""
    groups: dict[str, list[str]] = {}
    for path in per_module:
        groups.setdefault(re.sub(r"\.\d+\.", ".*.", path), []).append(path)
    out: dict[str, Any] = {}
    for pattern, paths in groups.items():
        styles = {type(per_module[p]) for p in paths}
        if len(paths) > 1 and len(styles) == 1:
            out[pattern] = per_module[paths[0]]
        else:
            out.update({p: per_module[p] for p in paths})
    return out


def _fsdp_units(plan: Plan) -> list[str]:
    """Repeated blocks (``layers.<i>`` / ``h.<i>``) bottom-up, then the root."""
    blocks = sorted(
        {m.group(0) for fqn in context_of(plan).param_values for m in [_BLOCK.match(fqn)] if m},
        key=lambda p: [int(t) if t.isdigit() else t for t in p.split(".")],
    )
    return [*blocks, ""]


_BLOCK = re.compile(r"^(?:.*\.)?(?:layers|h|blocks|layer)\.\d+")
