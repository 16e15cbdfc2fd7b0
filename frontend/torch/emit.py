"""Emit a Plan for PyTorch: DTensor placements, an applied module, parallelize_module styles.

``apply`` distributes parameters as planned and redistributes activations where the plan says
so at module boundaries (inputs/outputs of modules that own parameters) and on gradients, so
the DTensor program follows the planned layouts and issues the planned collectives. The
placements themselves are ``plan_layouts.py``; the torch calls ``apply`` runs locally are
``apply_mode.py`` (their public names are importable from here too).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.attention import SDPBackend, sdpa_kernel

from ...ir import FrontendError
from ...solver.plan import Plan
from . import bags, fallback, follow, inputs, strides
from .apply_mode import (
    _ApplyMode,
    embedding,
    ids_for_lookup,
    linear,
    local_attention,
    local_matmul,
    locally_contiguous,
    one_leading_split,
    one_vocab_split,
    pending_like,
    redistribute,
)
from .capture import TorchContext
from .plan_layouts import (
    Placements,
    check_mesh,
    consumed_layout,
    context_of,
    flattened_meshes,
    placements_of,
    to_placements,
)

__all__ = [
    "Placements",
    "apply",
    "check_mesh",
    "consumed_layout",
    "context_of",
    "embedding",
    "flattened_meshes",
    "ids_for_lookup",
    "linear",
    "local_attention",
    "local_matmul",
    "locally_contiguous",
    "one_leading_split",
    "one_vocab_split",
    "pending_like",
    "pipeline_split_spec",
    "placements_of",
    "redistribute",
    "to_parallelize_plan",
    "to_placements",
]


def apply(plan: Plan, model: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
    """The same module, parameters as DTensors and activations moved as planned.

    Inputs given to the root module are distributed to the planned input layouts (every rank
    passes the same global tensors, as in SPMD data loading); buffers and tensors made inside
    ``forward`` are treated as replicated (``implicit_replication``); after backward each
    gradient is redistributed to the layout the planned optimizer update consumes it in (the
    data-parallel all-reduce / reduce-scatter).
    """
    context = context_of(plan)
    check_mesh(plan, device_mesh)
    fallback.ensure_strategies(context.traced_ops)  # ops DTensor cannot shard run whole
    strides.ensure_view_handler()  # views of shards laid out unlike their DTensor
    flattened_meshes(device_mesh)  # multi-axis collectives run as one (see there)
    _distribute_parameters(plan, context, model, device_mesh)
    _install_root_hooks(plan, context, model, device_mesh)
    _install_boundary_hooks(plan, context, model)
    _install_mark_hooks(model)
    _install_grad_hooks(plan, context, model)
    bags.install_hooks(plan, context, model)
    return model


def _distribute_parameters(
    plan: Plan, context: TorchContext, model: nn.Module, mesh: DeviceMesh
) -> None:
    placements = to_placements(plan)
    done: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, param in list(module.named_parameters(recurse=False)):
            fqn = f"{module_name}.{name}" if module_name else name
            if id(param) not in done:
                if fqn not in placements:
                    raise FrontendError(f"parameter {fqn} is not in the plan; re-plan this model")
                tensor = distribute_tensor(
                    param.detach(), mesh, list(placements[fqn]), src_data_rank=None
                )
                done[id(param)] = nn.Parameter(tensor, requires_grad=param.requires_grad)
            module.register_parameter(name, done[id(param)])


def _install_root_hooks(
    plan: Plan, context: TorchContext, model: nn.Module, mesh: DeviceMesh
) -> None:
    layouts = {
        slot: placements_of(plan.shardings[value], plan.mesh, value)
        for slot, value in zip(context.input_slots, context.input_values, strict=True)
    }
    active: list[Any] = []
    signature = inputs.forward_signature(model)

    def distribute(slot: str, x: torch.Tensor) -> Any:
        if isinstance(x, DTensor) or slot not in layouts:
            return x
        return distribute_tensor(x, mesh, list(layouts[slot]), src_data_rank=None)

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        for cm in _forward_contexts(mesh):
            cm.__enter__()
            active.append(cm)
        with follow.paused():  # inputs bound by forward's signature, as capture bound them
            return inputs.map_tensors(args, kwargs, signature, distribute)

    def post(module: nn.Module, args: tuple, out: Any) -> Any:
        while active:
            active.pop().__exit__(None, None, None)
        return out

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post, always_call=True)  # also when forward raises


def _forward_contexts(mesh: DeviceMesh) -> list[Any]:
    """Contexts around the root forward: plain tensors made inside act as replicated, and on
    CPU attention takes the math path (DTensor has no strategy for the CPU flash kernel)."""
    contexts: list[Any] = [implicit_replication(), _replicate_saved_tensors(mesh), _ApplyMode()]
    if mesh.device_type == "cpu" and not follow.following():  # the follower runs the kernel
        contexts.append(sdpa_kernel([SDPBackend.MATH]))
    return contexts


def _replicate_saved_tensors(mesh: DeviceMesh) -> Any:
    """Plain tensors autograd saves (rotary tables, masks) come back as replicated DTensors,
    so backward - which runs outside ``implicit_replication`` - never mixes the two kinds."""
    replicate = [Replicate()] * mesh.ndim

    def pack(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor) or t.dim() == 0:
            return t
        return DTensor.from_local(t, mesh, replicate, run_check=False)

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _install_boundary_hooks(plan: Plan, context: TorchContext, model: nn.Module) -> None:
    """Redistribute inputs/outputs of parameter-owning modules to their planned layouts."""
    modules = dict(model.named_modules())
    for path, values in context.module_inputs.items():
        if path not in modules or path == "":
            continue
        want = {
            i: placements_of(consumed_layout(plan, v, path), plan.mesh, v)
            for i, v in values.items()
        }
        modules[path].register_forward_pre_hook(_input_hook(want))
    for path, value in context.module_outputs.items():
        if path in modules and path != "":
            placements = placements_of(plan.shardings[value], plan.mesh, value)
            modules[path].register_forward_hook(_output_hook(placements))


def _input_hook(want: dict[int, Placements]):  # type: ignore[no-untyped-def]
    def hook(module: nn.Module, args: tuple) -> tuple:
        if follow.following():  # every op already computes at its planned layouts
            return args
        return tuple(redistribute(a, want[i]) if i in want else a for i, a in enumerate(args))

    return hook


def _output_hook(placements: Placements):  # type: ignore[no-untyped-def]
    def hook(module: nn.Module, args: tuple, out: Any) -> Any:
        return out if follow.following() else redistribute(out, placements)

    return hook


def _install_mark_hooks(model: nn.Module) -> None:
    """Under ``follow_plan``, alias the inputs and output of every parameter-owning module as
    the capture's marks do (``trace.module_annotations``).

    The marks are ``aten.alias`` calls, so the captured autograd graph has an ``AliasBackward``
    node at each such boundary. The engine's order of work, and so the order in which a
    value's gradients are summed (``(g1 + g2) + g3`` or ``g1 + (g2 + g3)``), depends on those
    nodes: with them the run sums gradients as the trace does, and each sum is the traced
    ``add`` at its planned layouts. The aliases move no data (the follower skips them)."""
    from .trace import boundary_modules

    for path in boundary_modules(model):
        module = model.get_submodule(path)
        module.register_forward_pre_hook(_mark_inputs)
        module.register_forward_hook(_mark_output)


def _mark_inputs(module: nn.Module, args: tuple) -> tuple | None:
    if not follow.following():
        return None
    return tuple(_alias(a) for a in args)


def _mark_output(module: nn.Module, args: tuple, out: Any) -> Any:
    return _alias(out) if follow.following() else None


def _alias(x: Any) -> Any:
    return torch.ops.aten.alias.default(x) if isinstance(x, torch.Tensor) else x


def _install_grad_hooks(plan: Plan, context: TorchContext, model: nn.Module) -> None:
    params = dict(model.named_parameters())
    for fqn, grad_value in context.grad_values.items():
        param = params.get(fqn)
        if param is None or not param.requires_grad:  # a frozen parameter has no gradient
            continue
        layout = consumed_layout(plan, grad_value, "optimizer")
        placements = placements_of(layout.without_partial(), plan.mesh, grad_value)

        def hook(p: torch.Tensor, placements: Placements = placements) -> None:
            p.grad = redistribute(p.grad, placements)

        param.register_post_accumulate_grad_hook(hook)


def to_parallelize_plan(plan: Plan) -> Any:
    """``parallelize_module`` styles + ``fully_shard`` calls (see ``styles.py``)."""
    from .styles import to_parallelize_plan as build

    return build(plan)


def pipeline_split_spec(plan: Plan) -> Any:
    """``{"model.layers.4": SplitPoint.BEGINNING, ...}`` (see ``pipeline.py``)."""
    from .pipeline import pipeline_split_spec as build

    return build(plan)
