"""``capture(model, *example_inputs)``: an nn.Module's training step as a sharding-IR Graph.

The graph holds forward, loss, backward and the optimizer update (``mode="train"``, the
default) or the forward only (``mode="inference"``). Graph inputs are the parameters
(``Role.PARAMETER``, ``Origin(path=fqn)``), buffers (``CONSTANT``), optimizer states
(``OPTIMIZER_STATE``, path ``fqn#exp_avg``) and the example inputs (``INPUT``); outputs are the
loss, then the updated parameters and states, aliased to the inputs they replace.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from ...ir import FrontendError, Graph, Mesh, Role, Sharding, ShardplanError, Value
from ...ir.errors import ArgumentError
from ...passes.stamp_layers import StampedGraph
from ...passes.stamp_layers import stamp_layers as stamp_graph
from . import moe, ops_bag, optim, stack
from .annotate import dtensor_parameter_pins
from .lower import Lowering, add_input, infer_modules, lower_node
from .trace import Traced, trace

_ROLES = {
    "param": Role.PARAMETER, "buffer": Role.CONSTANT, "state": Role.OPTIMIZER_STATE,
    "input": Role.INPUT, "kv_cache": Role.KV_CACHE,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class AtenStep:
    """One aten call of the captured step, as ``follow.py`` replays it at run time.

    Invariants: ``operands``/``results`` list one entry per tensor leaf of the call's
    ``(args, kwargs)`` / result in ``leaves`` order (``None``: no IR value); ``ops`` are the indices
    of the IR ops the call was lowered to (``addmm`` -> matmul, add).
    """

    target: str
    """The aten overload, ``str(OpOverload)``: ``aten.mm.default``."""
    operands: tuple[str | None, ...]
    results: tuple[str | None, ...]
    ops: range
    module: str
    """Module path (``loss``, ``optimizer`` for those phases)."""
    identity: bool = False
    """Moves no data (``detach``, ``alias``, a view to the same shape): hooks and autograd make
    such calls at run time that the trace lacks, and the reverse, so replay may skip them."""


@dataclass
class TorchContext:
    """What the torch emitters need to map a Plan back onto the module (never serialised)."""

    mode: str
    param_values: dict[str, str] = field(default_factory=dict)
    """Parameter FQN -> IR value name of the graph input."""
    grad_values: dict[str, str] = field(default_factory=dict)
    """Parameter FQN -> IR value name of its gradient (train mode)."""
    state_values: dict[str, dict[str, str]] = field(default_factory=dict)
    """Parameter FQN -> {state name: IR value name}."""
    input_values: list[str] = field(default_factory=list)
    """IR value names of the tensor example inputs, in call order (positional, then keyword,
    then ``loss_inputs``)."""
    input_slots: list[str] = field(default_factory=list)
    """Path of each tensor example input in the call, bound by ``forward``'s signature
    (``input_ids``, ``xs[1]``, ``batch['labels']``; ``loss_inputs[0]``: see ``inputs.py``)."""
    input_binding: str = ""
    """How the example inputs bound, for the progress line: ``x=[8, 4] float32, ...``."""
    module_inputs: dict[str, dict[int, str]] = field(default_factory=dict)
    """Module path -> {positional arg index: IR value name} at its first call."""
    module_outputs: dict[str, str] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)
    """Tied parameter alias FQN -> canonical FQN."""
    module_kinds: dict[str, str] = field(default_factory=dict)
    """Module path -> ``Linear`` / ``Embedding`` (subclasses too) or the class name."""
    loss_value: str | None = None
    cache_values: dict[str, str] = field(default_factory=dict)
    """KV-cache buffer path (``<attention>.key_cache``) -> IR value name (prefill/decode)."""
    serving: object | None = None
    """``serving.CacheShape`` of a prefill/decode capture (None for train/inference)."""
    optimizer: optim.OptimizerSpec = field(default_factory=optim.OptimizerSpec)
    steps: list[AtenStep] = field(default_factory=list)
    """Every aten call of the step in execution order (marks and ``getitem`` left out)."""
    traced_ops: frozenset[str] = frozenset()
    """Every aten overload the trace called (kept when ``steps`` is emptied): the ops
    ``fallback.py`` checks DTensor's strategies for."""
    stamped: bool = False
    """Layers past the third were stamped, not traced: ``steps`` is empty (no replay)."""
    pins: dict[str, Sharding] = field(default_factory=dict)
    """IR value name -> ``shardplan.annotate`` pin; parameter FQN -> a DTensor parameter's
    placements (``annotate.py``). ``sp.plan`` applies them (``user_pins``)."""
    partial_semantics: object = field(default_factory=lambda: _dtensor_semantics())
    """What DTensor runs: partials pass through linear ops; a dim split over several axes
    lists them in mesh order (see solver/costs.py, docs/torch.md)."""

    def user_pins(self, mesh: Mesh | None) -> dict[str, Sharding]:
        """The model's own annotations as pins, checked against ``mesh``'s axis names."""
        if mesh is not None:
            for key, pin in self.pins.items():
                missing = sorted(pin.used_axes - set(mesh.axis_names))
                if missing:
                    raise FrontendError(
                        f"the model pins %{key} to {pin} (shardplan.annotate or a DTensor "
                        f"parameter), but the planner mesh {mesh} has no axis {missing[0]!r}; "
                        "name the planner mesh's axes as the annotations do"
                    )
        return dict(self.pins)


def _dtensor_semantics() -> object:
    from ...solver.costs import PartialSemantics

    return PartialSemantics(passthrough=True, ordered_dims=True)


def capture(
    model: nn.Module,
    *example_inputs: Any,
    mode: str = "train",
    loss_fn: Callable[..., torch.Tensor] | None = None,
    loss_inputs: Any = None,
    optimizer: str = "adamw",
    lr: float = 1e-3,
    name: str | None = None,
    stamp_layers: bool = True,
    context_len: int | None = None,
    pooling: Mapping[str, float] | None = None,
    **example_kwargs: Any,
) -> tuple[Graph, TorchContext]:
    """Trace and lower one step of ``model``.

    Args:
      model: the module; its parameters may be real, ``meta`` or fake (nothing is allocated).
      example_inputs, example_kwargs: the example call, as the model is called: positional
        and keyword inputs bound by ``forward``'s signature (HF style ``input_ids=ids,
        labels=ids``, or one dict of them), each a tensor (real/meta/fake) or a pytree of
        tensors (tuples, lists, dicts, dataclasses; ``None`` and numbers as constants);
        ``inputs.py``. A keyword that names one of the options below is that option.
      mode: ``"train"`` (forward + backward + optimizer), ``"inference"`` (forward), or a
        serving step of a HF decoder with a static KV cache (``serving.py``): ``"prefill"``
        (the prompt ``input_ids`` written into the cache) or ``"decode"`` (one token per
        sequence, ``input_ids`` of shape ``[batch, 1]``, against ``context_len`` cached tokens).
      context_len: cache slots per sequence for ``"prefill"`` (default: the prompt length) and
        ``"decode"`` (required).
      loss_fn: ``loss_fn(output, *loss_inputs)``, or ``loss_fn(output, *positional_inputs)``
        without ``loss_inputs``; default: ``output.loss`` when the model returns one, else the
        mean square of its first output tensor.
      loss_inputs: a tuple of tensors (or pytrees) only ``loss_fn`` reads, such as targets:
        ``capture(model, x, loss_fn=fn, loss_inputs=(y,))`` traces ``fn(model(x), y)``; they
        are graph inputs (split with the batch like the others).
      optimizer: ``"adamw"`` (two fp32 moments per parameter), ``"sgd"``, or
        ``"sgd-momentum"`` (one fp32 momentum buffer, weight decay; torch.optim.SGD's step).
      pooling: ``{table module: average ids per bag}`` for ``nn.EmbeddingBag`` lookups (default:
        each lookup's example, ``ids / bags``): what the cost model prices their rows by
        (``frontend/torch/ops_bag.py``).
      stamp_layers: trace 3 layers of a deep stack of alike layers and stamp out the rest
        (``frontend/torch/stack.py``; the graph is the same, capture is much faster). Such a
        capture cannot be replayed by ``follow_plan``; pass False for that.
    Returns:
      (graph, context) - the context maps IR values back to FQNs for the emitters.
    """
    if mode not in ("train", "inference", "prefill", "decode"):
        raise ArgumentError(
            f"mode must be 'train', 'inference', 'prefill' or 'decode', got {mode!r}"
        )
    if context_len is not None and mode not in ("prefill", "decode"):
        raise ArgumentError(f"context_len= is for mode='prefill'/'decode', not mode={mode!r}")
    moe.ensure_traceable(model)  # HF experts: a static-shape dispatch instead of grouped_mm
    spec = optim.OptimizerSpec(name=optimizer, lr=lr)
    _ = spec.state_names  # validates the optimizer name early
    call = _Call(example_inputs, example_kwargs, loss_fn, _loss_inputs(loss_fn, loss_inputs))
    if mode in ("prefill", "decode") and (example_kwargs or call.loss_inputs):
        call = _serving_call(call, mode)
    layers = stack.find_stack(model) if stamp_layers else None
    if layers is not None:
        with stack.truncated(layers):
            graph, context = _capture(model, call, mode, spec, name, context_len)
        stamped = stamp_graph(graph, layers.path, layers.size)
        if stamped is not None:
            ops_bag.set_pooling(stamped.graph, pooling)
            return stamped.graph, _stamped_context(context, stamped)
    graph, context = _capture(model, call, mode, spec, name, context_len)
    ops_bag.set_pooling(graph, pooling)
    return graph, context


@dataclass(frozen=True)
class _Call:
    """The example call of a capture."""

    args: tuple
    kwargs: dict
    loss_fn: Callable[..., torch.Tensor] | None
    loss_inputs: tuple


def _loss_inputs(loss_fn: Any, loss_inputs: Any) -> tuple:
    from .inputs import check_loss_inputs

    return check_loss_inputs(loss_fn, loss_inputs)


def _serving_call(call: _Call, mode: str) -> _Call:
    """A serving step reads ``input_ids`` (positionally or in one dict)."""
    if call.loss_inputs:
        raise ArgumentError(f"mode={mode!r} has no loss: leave out loss_inputs=")
    if call.args:
        raise ArgumentError(f"mode={mode!r}: give input_ids positionally or by name, not both ways")
    return _Call(({**call.kwargs},), {}, call.loss_fn, ())


def _capture(model, call, mode, spec, name, context_len=None) -> tuple[Graph, TorchContext]:  # type: ignore[no-untyped-def]
    shape = None
    try:
        if mode in ("prefill", "decode"):
            from .serving import trace_serving

            traced, shape = trace_serving(model, call.args, mode, context_len)
        else:
            traced = trace(
                model, call.args, mode == "train", call.loss_fn, spec, call.kwargs,
                call.loss_inputs,
            )  # fmt: skip
    except ShardplanError:
        raise
    except Exception as exc:  # tracing failures surface as one typed error with the cause
        from .diagnose import trace_failure
        from .inputs import capture_hint

        raise FrontendError(trace_failure(model, exc, capture_hint(exc))) from exc
    graph = Graph(name or type(model).__name__)
    context = TorchContext(mode=mode, tied=traced.tied, optimizer=spec, serving=shape)
    context.module_kinds = {path: _kind(m) for path, m in model.named_modules()}
    context.pins = dtensor_parameter_pins(model)
    _lower(traced, graph, context)
    if mode not in ("prefill", "decode"):
        _check_read(model, call, graph, context)
    context.input_binding = ", ".join(
        f"{slot}={graph.value(value).type}"
        for slot, value in zip(context.input_slots, context.input_values, strict=True)
    )
    return graph, context


def _check_read(model: nn.Module, call: _Call, graph: Graph, context: TorchContext) -> None:
    """Refuse an example keyword that ``**kwargs`` swallowed and the step never reads."""
    from .inputs import check_read

    values = dict(zip(context.input_slots, context.input_values, strict=True))
    returned = {v.name for v in graph.outputs}

    def read(path: str) -> bool:
        name = values.get(path)
        return name is not None and (bool(graph.value(name).uses) or name in returned)

    check_read(model, call.args, call.kwargs, read)


def _stamped_context(context: TorchContext, stamped: StampedGraph) -> TorchContext:
    """The context of a stamped capture: every FQN-keyed table grown like the graph."""

    def name(value: str, names: dict[str, str]) -> str:
        return names.get(value, value)

    def names_of(entry: dict, names: dict[str, str]) -> dict:  # type: ignore[type-arg]
        return {k: name(v, names) for k, v in entry.items()}

    context.param_values = stack.rename_keyed(context.param_values, stamped, name)
    context.cache_values = stack.rename_keyed(context.cache_values, stamped, name)
    context.grad_values = stack.rename_keyed(context.grad_values, stamped, name)
    context.state_values = stack.rename_keyed(context.state_values, stamped, names_of)
    context.module_inputs = stack.rename_keyed(context.module_inputs, stamped, names_of)
    context.module_outputs = stack.rename_keyed(context.module_outputs, stamped, name)
    context.pins = stack.rename_pins(context.pins, stamped)
    context.steps = []
    context.stamped = True
    return context


def _kind(module: nn.Module) -> str:
    for base in (nn.Linear, nn.Embedding):
        if isinstance(module, base):
            return base.__name__
    return type(module).__name__


def _owner(path: str) -> str:
    return path.split("#", 1)[0].rpartition(".")[0]


def _lower(traced: Traced, graph: Graph, context: TorchContext) -> None:
    gm = traced.gm
    low = Lowering(graph, module_of=infer_modules(gm))
    low.fold_broadcast_weights = context.mode in ("prefill", "decode")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, ph in zip(placeholders, traced.placeholders, strict=True):
        add_input(low, node, _ROLES[ph.role], ph.path, module=_owner(ph.path))
        value = low.env[node]
        if isinstance(value, Value):
            _record_input(context, ph.role, ph.path, value.name)
    for node in gm.graph.nodes:
        if node.op == "call_function":
            first = len(graph.ops)
            operands = _operand_names(low, node)  # before an in-place op rebinds its target
            lower_node(low, node)
            if _is_aten_call(node):
                context.steps.append(_step(low, node, operands, range(first, len(graph.ops))))
        elif node.op == "get_attr":
            add_input(low, node, Role.CONSTANT, node.target, module=low.module_of.get(node, ""))
    _record_marks(context, low.marks, traced.pins)
    _set_outputs(traced, graph, low, context)
    context.traced_ops = frozenset(s.target for s in context.steps)
    if low.fold_broadcast_weights and _erase_dead_views(graph):
        context.steps = []  # op indices moved: a serving step is not replayed by follow_plan


def _erase_dead_views(graph: Graph) -> int:
    """Drop layout-only ops nothing reads (the expands a folded ``bmm`` no longer reads)."""
    from ...ir.op_cost import VIEW_KINDS

    outputs = {id(v) for v in graph.outputs}
    erased = 0
    for op in reversed(list(graph.ops)):
        if op.kind in VIEW_KINDS and not any(r.uses or id(r) in outputs for r in op.results):
            graph.erase(op)
            erased += 1
    return erased


def _is_aten_call(node: fx.Node) -> bool:
    """Calls that also happen at run time (marks exist only in the trace)."""
    custom = node.meta.get("custom") or {}
    return node.target is not operator.getitem and "mark" not in custom


def leaves(tree: object, kind: type) -> list:
    """The ``kind`` leaves of nested tuples/lists/dicts in order (capture and replay agree)."""
    if isinstance(tree, kind):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [x for item in tree for x in leaves(item, kind)]
    if isinstance(tree, dict):
        return [x for item in tree.values() for x in leaves(item, kind)]
    return []


def _operand_names(low: Lowering, node: fx.Node) -> tuple[str | None, ...]:
    return tuple(
        low.env[a].name if isinstance(low.env.get(a), Value) else None
        for a in leaves((node.args, node.kwargs), fx.Node)
    )


def _step(low: Lowering, node: fx.Node, operands: tuple[str | None, ...], ops: range) -> AtenStep:
    results = _result_names(low.env.get(node), node.meta.get("val"))
    target = str(node.target)
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    in_shape = tuple(getattr(first.meta.get("val"), "shape", ())) if first is not None else None
    identity = is_identity(target, in_shape, tuple(getattr(node.meta.get("val"), "shape", ())))
    return AtenStep(target, operands, results, ops, low.module_of.get(node, ""), identity)


IDENTITY_CALLS = ("aten.detach.default", "aten.alias.default", "aten.view_as.default")


VIEW_CALLS = ("aten.view.default", "aten._unsafe_view.default")


def is_identity(target: str, in_shape: tuple | None, out_shape: tuple | None) -> bool:
    """``detach``/``alias``/``view_as``, or a ``view``/``_unsafe_view`` keeping the shape."""
    if target in IDENTITY_CALLS:
        return True
    return target in VIEW_CALLS and in_shape is not None and tuple(out_shape or ()) == in_shape


def _result_names(lowered: object, val: object) -> tuple[str | None, ...]:
    """IR value per tensor of the aten result (lowerings return one value or a list that is
    aligned either with the whole result or with its tensors only)."""
    vals = list(val) if isinstance(val, (list, tuple)) else [val]
    count = sum(isinstance(v, torch.Tensor) for v in vals)
    names: list[str | None] = []
    if isinstance(lowered, Value):
        names = [lowered.name]
    elif isinstance(lowered, list):
        names = [v.name if isinstance(v, Value) else None for v in lowered]
        if len(names) == len(vals):
            names = [n for n, v in zip(names, vals, strict=True) if isinstance(v, torch.Tensor)]
    return tuple(names[:count] + [None] * (count - len(names)))


def _record_input(context: TorchContext, role: str, path: str, value: str) -> None:
    if role == "param":
        context.param_values[path] = value
    elif role == "state":
        fqn, state = path.split("#", 1)
        context.state_values.setdefault(fqn, {})[state] = value
    elif role == "kv_cache":
        context.cache_values[path] = value
    elif role == "input":
        context.input_values.append(value)
        context.input_slots.append(path)


def _record_marks(context: TorchContext, marks: dict[str, str], pins: list[Sharding]) -> None:
    for tag, value in marks.items():
        kind, _, rest = tag.partition(":")
        if kind == "pin":
            context.pins[value] = pins[int(rest)]
        elif kind == "grad":
            context.grad_values[rest] = value
        elif kind == "in":
            module, _, index = rest.rpartition(":")
            context.module_inputs.setdefault(module, {}).setdefault(int(index), value)
        elif kind == "out":
            context.module_outputs.setdefault(rest.rpartition(":")[0], value)


def _set_outputs(traced: Traced, graph: Graph, low: Lowering, context: TorchContext) -> None:
    out_node = next(n for n in traced.gm.graph.nodes if n.op == "output")
    flat = list(out_node.args[0])
    index_of = {v.name: i for i, v in enumerate(graph.inputs)}
    values: list[Value] = []
    aliases: dict[int, int] = {}
    for node, (kind, path) in zip(flat, traced.outputs, strict=True):
        value = low.env.get(node) if node is not None else None
        if not isinstance(value, Value):
            continue
        if kind == "loss":
            context.loss_value = value.name
        elif kind == "param":
            aliases[len(values)] = index_of[context.param_values[path]]
        elif kind == "state":
            fqn, state = path.split("#", 1)
            aliases[len(values)] = index_of[context.state_values[fqn][state]]
        elif kind == "kv_cache":  # written in place: the new contents replace the input
            aliases[len(values)] = index_of[context.cache_values[path]]
        values.append(value)
    graph.set_outputs(values, aliases)
