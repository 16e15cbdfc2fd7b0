"""Emit a Plan for PyTorch: DTensor placements, an applied module, parallelize_module styles.

Placements are per mesh dimension in the plan mesh's axis order: mesh axis ``a`` splitting
tensor dim ``d`` is ``Shard(d)``, a partial axis is ``Partial()``, an unused one ``Replicate()``.
``apply`` distributes parameters as planned and redistributes activations where the plan says
so at module boundaries (inputs/outputs of modules that own parameters) and on gradients, so
the DTensor program follows the planned layouts and issues the planned collectives.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from ...ir import FrontendError, Mesh, Role, Sharding
from ...solver.plan import Plan
from . import bags, fallback, follow, inputs, local, lookup, nn_local, reshard, views
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


def redistribute(x: Any, placements: Placements) -> Any:
    """Move a DTensor to ``placements`` when DTensor can: S->P and R->P are not layout changes
    it makes (the logical tensor is the same), so such a dim keeps its layout."""
    if not isinstance(x, DTensor) or tuple(x.placements) == placements:
        return x
    fixed = tuple(_reachable(old, new) for old, new in zip(x.placements, placements, strict=True))
    if tuple(x.placements) == fixed:
        return x
    with follow.paused():  # the reshard's local ops are not calls of the traced step
        return reshard.reshard(x, fixed)[0]  # the plan's collectives


def _reachable(old: Placement, new: Placement) -> Placement:
    """The placement a mesh dim can move to for ``new``: a pending sum stays one where it is one
    already; a dim that is not pending keeps its layout (no R/S -> P); a pending sum of
    another kind - the ``_MaskPartial`` of a vocabulary-split lookup, which DTensor may only
    reduce (HF OPT Megatron on (2, 4): "Can not redistribute from MaskP(sum, ...) to P(sum)")
    - is reduced to whole."""
    if not isinstance(new, Partial):
        return new
    if not isinstance(old, Partial):
        return old
    return new if type(old) is type(new) and old == new else Replicate()


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


class _ApplyMode(TorchFunctionMode):
    """Torch functions run as the plan means them when DTensors take part.

    ``torch.cat`` skips 1-D empty operands, as eager ``cat`` does: eager ``cat`` ignores a
    legacy ``torch.tensor([])`` whatever the other operands' rank; DTensor's rule instead
    redistributes it, as a replicated operand, to the others' layout and fails when they are
    split on a dimension it lacks. Hugging Face's ``DynamicCache`` starts every layer from such
    a tensor and concatenates the new keys and values onto it.

    Views and reshapes of split dims are local reshapes (``views.py``): DTensor's view rule
    refuses most of them (``[b, s, (kv d)]`` split over two axes -> ``[b, s, kv, d]``).
    Attention and batched matmuls run on local shards (``local.py``): DTensor folds their
    batch and head dims into a ``_StridedShard``.
    Under ``follow_plan`` the follower runs every aten call at its planned layouts, so only
    the ``cat`` rule applies then."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in _CATS and args and any(isinstance(t, DTensor) for t in args[0]):
            args = (follow.without_legacy_empty(args[0]), *args[1:])
        elif follow.following():
            pass  # the follower runs each aten call at its planned layouts
        elif func in _VIEWS and args and isinstance(args[0], DTensor):
            out = _view(func, args, kwargs)
            if out is not None:
                return out
        elif func is F.embedding and len(args) > 1 and isinstance(args[1], DTensor):
            return embedding(*args, **kwargs)
        elif func is F.embedding_bag and len(args) > 1 and isinstance(args[1], DTensor):
            out = bags.embedding_bag(*args, **kwargs)
            return _call(func, args, kwargs) if out is NotImplemented else out
        elif (out := _local_call(func, args, kwargs)) is not None:
            return out
        elif func is F.linear and args and isinstance(args[0], DTensor) and args[0].ndim > 2:
            return linear(*args, **kwargs)
        elif func in _IN_PLACE_ADDS and len(args) > 1 and isinstance(args[0], DTensor):
            args = (args[0], pending_like(args[0], args[1]), *args[2:])
        return _call(func, args, kwargs)


def _call(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func``, or - when DTensor has no strategy for one of its aten ops - ``func`` on whole
    tensors (``fallback.run_whole``; outside the follower's replay: it computes no planned
    layout)."""
    try:
        return func(*args, **kwargs)
    except NotImplementedError as error:
        if not fallback.is_unsupported(error):
            raise
    with follow.paused():
        return fallback.run_whole(func, args, kwargs, follow.paused)


_CATS = frozenset({torch.cat, torch.concat, torch.concatenate})
_VIEWS = frozenset({
    torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.flatten, torch.flatten,
    torch.Tensor.unflatten, torch.unflatten, torch.Tensor.view_as, torch.Tensor.reshape_as,
})  # fmt: skip


_IN_PLACE_ADDS = frozenset({torch.Tensor.add_, torch.Tensor.sub_})
_MATMULS = frozenset({
    torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm,
})  # fmt: skip


def _local_call(func: Any, args: tuple, kwargs: dict) -> Any:
    """Attention, batched matmuls, norms, activations and recurrent layers on local shards;
    None: not such a call (DTensor runs it)."""
    out = None
    if func is F.scaled_dot_product_attention:
        out = local_attention(func, args, kwargs)
    elif func in _MATMULS and not kwargs:
        out = local_matmul(func, args)
    elif (local_nn := nn_local.intercept(func, args, kwargs)) is not NotImplemented:
        out = local_nn
    return out


def embedding(ids: Any, table: DTensor, *args: Any, **kwargs: Any) -> Any:
    """A lookup into a DTensor table: the project's (``lookup.py``) where the rows are split
    and the call is a plain lookup; otherwise DTensor's, one vocabulary split at most."""
    out = lookup.embedding(ids, table, *args, **kwargs)
    if out is not None:
        return out
    table = one_vocab_split(table)
    return F.embedding(ids_for_lookup(ids, table), table, *args, **kwargs)


def local_attention(func: Any, args: tuple, kwargs: dict) -> DTensor | None:
    """Attention on local shards (``local.attention``), operands moved by the plan's reshard."""
    return local.attention(func, args, kwargs, redistribute)


def local_matmul(func: Any, args: tuple) -> DTensor | None:
    """A batched matmul on local shards (``local.matmul``)."""
    return local.matmul(func, args, redistribute)


def one_leading_split(x: DTensor) -> DTensor:
    """``x`` split, among its leading dims (all but the last), on the first one at most.

    ``linear`` and its backward fold the leading dims into one around their matmuls; a split
    of a later leading dim (sequence over ``tp``, alone or under a batch split) becomes a
    ``_StridedShard`` there, which a view cannot unfold and a redistribution over a flattened
    mesh refuses. Such splits are gathered first (the IR's reshape rule never folds them
    either; only ``apply``'s DTensor-chosen inner layouts meet them)."""
    if not any(isinstance(p, Shard) and 0 < p.dim < x.ndim - 1 for p in x.placements):
        return x
    placements = tuple(
        Replicate() if isinstance(p, Shard) and 0 < p.dim < x.ndim - 1 else p for p in x.placements
    )
    with follow.paused():
        return x.redistribute(placements=placements)


class _FoldedLinear(torch.autograd.Function):
    """``linear`` whose input and output gradient are split on the first leading dim at most
    (``one_leading_split``), in forward and in backward."""

    @staticmethod
    def forward(ctx: Any, x: DTensor, weight: Any, bias: Any) -> Any:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grad = locally_contiguous(one_leading_split(grad)) if isinstance(grad, DTensor) else grad
        grad_x = grad @ weight
        flat = grad.reshape(-1, grad.shape[-1])
        grad_w = flat.t() @ x.reshape(-1, x.shape[-1])
        grad_b = flat.sum(0) if ctx.bias else None
        return grad_x, grad_w, grad_b


def locally_contiguous(x: DTensor) -> DTensor:
    """``x`` with a contiguous local shard. A gradient can arrive as a transposed shard whose
    DTensor still reports global contiguous strides, so ``contiguous()`` leaves it as it is
    and DTensor's matmul then views the shard ("view size is not compatible with input
    tensor's size and stride"; HF OPT free on (2, 4))."""
    shard = x.to_local()
    if shard.is_contiguous():
        return x
    return DTensor.from_local(shard.contiguous(), x.device_mesh, x.placements, run_check=False,
                              shape=x.shape, stride=x.stride())  # fmt: skip


def linear(x: DTensor, weight: Any, bias: Any = None) -> Any:
    return _FoldedLinear.apply(locally_contiguous(one_leading_split(x)), weight, bias)


def pending_like(target: DTensor, other: Any) -> Any:
    """``other`` made a pending sum on the mesh dims where ``target`` is one, for an in-place
    add into ``target``: DTensor keeps an in-place op's placements and cannot make a shard
    pending itself (HF Falcon's ``mlp_output += attention_output``). The split is gathered,
    and each of the ``n`` ranks of the pending dims holds ``1/n`` of it (their sum is it; so
    its gradient is pending over those dims too: each rank's ``1/n`` share adds up)."""
    if not isinstance(other, DTensor):
        return other
    pending = [
        isinstance(t, Partial) and not isinstance(o, Partial)
        for t, o in zip(target.placements, other.placements, strict=True)
    ]
    if not any(pending):
        return other
    whole = tuple(
        Replicate() if want else p for want, p in zip(pending, other.placements, strict=True)
    )
    with follow.paused():
        gathered = other.redistribute(placements=whole)
    n = math.prod(other.device_mesh.size(i) for i, want in enumerate(pending) if want)
    placements = tuple(Partial() if want else p for want, p in zip(pending, whole, strict=True))
    return DTensor.from_local(
        gathered.to_local(grad_placements=placements) / n, other.device_mesh, placements,
        run_check=False,
        shape=other.shape, stride=other.stride(),
    )  # fmt: skip


def one_vocab_split(weight: DTensor) -> DTensor:
    """An embedding table split over at most one mesh dim along its rows (vocabulary).

    DTensor looks rows up in a vocabulary-split table with one ``MaskPartial`` per mesh dim,
    all sharing the op's one mask buffer: a table whose rows are split over two mesh dims
    (FSDP over ``dp`` and ``tp``) fails with "MaskBuffer has been materialized with conflicting
    data". The minor splits are gathered first (in mesh order the major one stays)."""
    rows = [i for i, p in enumerate(weight.placements) if isinstance(p, Shard) and p.dim == 0]
    if len(rows) < 2:
        return weight
    placements = tuple(Replicate() if i in rows[1:] else p for i, p in enumerate(weight.placements))
    with follow.paused():
        return weight.redistribute(placements=placements)


def ids_for_lookup(ids: Any, table: DTensor) -> Any:
    """The ids whole on every mesh dim that splits a vocabulary-split table's columns.

    DTensor's lookup in a table split along rows on one mesh dim and along its hidden dim on
    others gathers the ids over the hidden-split dims, but its redistribution masks the ids
    for the vocabulary split before it gathers them: the mask keeps the ids' local shape and
    the reduction fails ("The shape of the mask [2, 8] at index 0 does not match the shape of
    the indexed tensor [8, 8, 16]"; Gemma TP x FSDP on (2, 2, 2)). Gathering the ids first
    (what that lookup needs anyway; they are far smaller than the table) leaves DTensor only
    the local masking. The dims that split rows are left to DTensor: it may gather the table
    there and keep the ids split (FSDP), where whole ids would leave a ``MaskPartial`` output
    that no later redistribution may turn into a plain ``Partial``."""
    rows = any(isinstance(p, Shard) and p.dim == 0 for p in table.placements)
    if not rows or not isinstance(ids, DTensor):
        return ids
    placements = tuple(
        Replicate() if isinstance(t, Shard) and t.dim == 1 else p
        for p, t in zip(ids.placements, table.placements, strict=True)
    )
    if placements == tuple(ids.placements):
        return ids
    with follow.paused():
        return ids.redistribute(placements=placements)


def _view(func: Any, args: tuple, kwargs: dict) -> Any:
    """A view of a split DTensor as a local reshape, or None to let DTensor do it."""
    x = args[0]
    if func in (torch.Tensor.view_as, torch.Tensor.reshape_as):
        shape = tuple(args[1].shape)
    else:
        try:  # the result shape, whatever the spelling (-1, flatten's dims, a dtype)
            meta = func(torch.empty(x.shape, device="meta"), *args[1:], **kwargs)
        except (RuntimeError, TypeError):
            return None
        if not isinstance(meta, torch.Tensor) or meta.dtype != torch.float32:
            return None
        shape = tuple(meta.shape)
    return views.local_view(x, shape)


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
