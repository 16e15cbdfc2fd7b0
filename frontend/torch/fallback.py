"""A local fallback for the aten ops of a plan that DTensor has no sharding strategy for.

DTensor raises ``NotImplementedError`` ("Operator aten.mkldnn_rnn_layer.default does not have
a sharding strategy registered") for ops outside its registry: ``fill_.Tensor`` (Hugging
Face's ``_shift_right`` / ``shift_tokens_right``), ``_embedding_bag`` (``nn.EmbeddingBag``, which
``bags.py`` runs on local shards itself), ``mkldnn_rnn_layer`` (``nn.LSTM`` on CPU),
``transpose_`` (``nn.GRU``) and their backwards.
Before ``plan.apply`` or ``follow_plan`` runs a captured step, every traced aten op without a
strategy gets one (of the kind ``register_sharding`` takes), forward and backward alike:

- ops elementwise in their first operand (``_LOCAL``: a fill) run on local shards at that
  operand's layout, the other operands whole; a split keeps its operand's layout off the
  split dim;
- every other op runs whole: its operands are gathered (DTensor's redistribution, pending sums
  reduced), it computes on every rank, and its results are replicated (a later planned layout is
  a local slice). The IR gives such an op the all-``need_replication`` rule (an unknown op), so
  the plan prices exactly these gathers.

In-place views (``transpose_``: ``torch.Tag.inplace_view``) change a DTensor's shape, which no
strategy can describe: ``emit`` reruns a torch function DTensor refuses on whole plain tensors
(``run_whole``), its backward too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard

_REGISTERED: set[str] = set()


def ensure_strategies(targets: Iterable[str]) -> list[str]:
    """Give every aten op in ``targets`` (``str(OpOverload)``) that DTensor has no strategy
    for the fallback strategy; returns the ops newly registered."""
    added = []
    for target in sorted(set(targets) - _REGISTERED):
        op = _overload(target)
        if op is None or torch.Tag.inplace_view in op.tags or _has_strategy(op):
            continue
        if not any("Tensor" in str(a.type) for a in op._schema.arguments):
            continue  # a factory (zeros, arange, empty): no DTensor operand ever reaches it,
            # and a strategy registered for it changes how later calls are traced process-wide
        if op._schema.is_mutable and target not in _LOCAL:
            continue  # a whole strategy cannot keep a split target in place (a KV cache's
            # index_copy_ by heads): DTensor runs it, or emit reruns it whole (run_whole)
        _register(op, _LOCAL.get(target) or _whole_strategy)
        _REGISTERED.add(target)
        added.append(target)
    return added


def _overload(target: str) -> Any:
    """``torch.ops.aten.fill_.Tensor`` for ``"aten.fill_.Tensor"``; None for other namespaces."""
    namespace, _, rest = target.partition(".")
    name, _, overload = rest.rpartition(".")
    if namespace != "aten" or not name:
        return None
    packet = getattr(torch.ops.aten, name, None)
    return getattr(packet, overload, None) if packet is not None else None


def _has_strategy(op: Any) -> bool:
    """Whether DTensor can shard ``op`` itself (or decomposes it before it reaches DTensor).

    Private: DTensor's registry of strategies has no public query."""
    from torch.distributed.tensor import DTensor

    if not op.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeExplicitAutograd) and (
        op.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd)
    ):
        return True  # decomposed above DTensor's dispatch
    dispatcher = DTensor._op_dispatcher
    propagator = dispatcher.sharding_propagator
    return (
        op in propagator.op_strategy_funcs
        or op in propagator.op_to_rules
        or op in getattr(propagator, "op_single_dim_strategy_funcs", {})
        or op in dispatcher._custom_op_handlers
    )


def _whole_strategy(results: int, *args: Any, **kwargs: Any) -> list[tuple[list, list]]:
    """One strategy per mesh dim: every tensor operand and result replicated."""
    return [([Replicate()] * results, [_replicated(a) for a in (*args, *kwargs.values())])]


def _register(op: Any, strategy: Any) -> None:
    """Register ``strategy(results, *specs)`` (one mesh dim's ``(result placements, operand
    placements)`` pairs, as ``register_sharding`` takes them) for ``op``, counting the op's
    tensor results (a ``Tensor[]`` return has as many as the call makes).

    Private: DTensor's public ``register_sharding`` allows one result per declared return, so
    an op returning a list of tensors (``unsafe_split``) cannot be described with it; this
    registers the same kind of strategy with the call's result count."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import OpStrategy, RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    def spec(x: Any) -> Any:
        if isinstance(x, OpStrategy):
            return x.strategies[0].output_spec
        if isinstance(x, (list, tuple)):
            return type(x)(spec(e) for e in x)
        return x

    def propagate(schema: Any) -> Any:
        args = tuple(spec(a) for a in schema.args_schema)
        kwargs = {k: spec(v) for k, v in schema.kwargs_schema.items()}
        results = _result_count(op, args, kwargs)
        rows = [out + list(_flat(inputs)) for out, inputs in strategy(results, *args, **kwargs)]
        return expand_to_full_mesh_op_strategy(
            schema.get_mesh_from_args(), schema, rows, input_index=results,
            inplace_op=schema.is_inplace_op(),
        )  # fmt: skip

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.register_op_strategy(op, propagate, RuntimeSchemaInfo(needs_pytree=True))


def _flat(placements: list) -> list:
    out: list = []
    for p in placements:
        out.extend(p if isinstance(p, list) else [p])
    return out


def _result_count(op: Any, args: tuple, kwargs: dict) -> int:
    """How many tensors a call of ``op`` returns (a meta run for a ``Tensor[]`` return)."""
    returns = op._schema.returns
    if not any(isinstance(r.type, torch.ListType) for r in returns):
        return len(returns)
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    def meta(x: Any) -> Any:
        if isinstance(x, DTensorSpec):
            m = x.tensor_meta
            return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")
        if isinstance(x, (list, tuple)):
            return type(x)(meta(e) for e in x)
        return x

    out = op(*(meta(a) for a in args), **{k: meta(v) for k, v in kwargs.items()})
    return len(out) if isinstance(out, (list, tuple)) else 1


def _replicated(arg: Any) -> Any:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    if isinstance(arg, DTensorSpec):
        return Replicate()
    if isinstance(arg, (list, tuple)) and any(isinstance(a, DTensorSpec) for a in arg):
        return [Replicate() if isinstance(a, DTensorSpec) else None for a in arg]
    return None


def _elementwise_strategy(
    results: int, x: Any, *args: Any, **kwargs: Any
) -> list[tuple[list, list]]:
    """The first operand's layout (a shard of any dim, or whole) kept by the result; the other
    tensor operands whole."""
    rest = [_replicated(a) for a in (*args, *kwargs.values())]
    layouts = [Replicate(), *(Shard(d) for d in range(x.ndim))]
    return [([p], [p, *rest]) for p in layouts]


def _split_strategy(results: int, x: Any, *args: Any, **kwargs: Any) -> list[tuple[list, list]]:
    """A split along ``dim``: every piece keeps the operand's layout when that leaves ``dim``
    whole (a batch split of ``nn.GRU``'s gate pre-activations split into its gates), or all
    whole; the IR's split (one slice per piece) has the same choices."""
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % x.ndim
    rest = [None] * (len(args) + len(kwargs))
    layouts = [Replicate(), *(Shard(d) for d in range(x.ndim) if d != dim)]
    return [([p] * results, [p, *rest]) for p in layouts]


_LOCAL = {
    "aten.fill_.Tensor": _elementwise_strategy,
    "aten.fill.Tensor": _elementwise_strategy,
    "aten.unsafe_split.Tensor": _split_strategy,
    "aten.unsafe_split_with_sizes.default": _split_strategy,
}
"""Ops computed on local shards: elementwise in their first operand (a fill: the other operands
whole), or a split keeping its operand's layout off the split dim."""


def is_unsupported(error: Exception) -> bool:
    """Whether ``error`` is DTensor's refusal of an op it has no strategy for."""
    return isinstance(error, NotImplementedError) and "sharding strategy" in str(error)


def run_whole(func: Any, args: tuple, kwargs: dict, quiet: Any = contextlib.nullcontext) -> Any:
    """``func`` on whole tensors: DTensor operands gathered, the call (and later its backward)
    made on plain tensors, tensor results replicated DTensors; in backward the gradients come
    back replicated. ``quiet()`` is entered around the backward (``follow.paused``: the
    follower leaves its plain-tensor calls alone).

    For a torch function whose aten ops DTensor cannot run at all: an in-place view such as
    ``transpose_`` (``nn.GRU`` with ``batch_first``), which changes a DTensor's shape, has no
    strategy that could describe it (``ensure_strategies`` leaves those ops out)."""
    from torch.distributed.tensor import DTensor

    inputs = [t for t in _tensors((args, kwargs)) if isinstance(t, DTensor)]
    if not inputs:
        return func(*args, **kwargs)
    slots = iter(range(len(inputs)))
    tree = _map(lambda x: _Slot(next(slots)) if isinstance(x, DTensor) else None, (args, kwargs))
    layout: list = []
    flat = _Whole.apply((func, tree, quiet, layout), *inputs)
    return _map(lambda x: flat[x.index] if isinstance(x, _Slot) else None, layout[0])


class _Slot:
    """Where a tensor sits in a call's arguments or results (``_Whole``)."""

    def __init__(self, index: int) -> None:
        self.index = index


class _Whole(torch.autograd.Function):
    """A call on whole plain tensors between DTensors (``run_whole``); the results' structure,
    tensors replaced by ``_Slot``s, is appended to the call's ``layout`` list."""

    @staticmethod
    def forward(ctx: Any, call: tuple, *inputs: Any) -> Any:  # type: ignore[override]
        from torch.distributed.tensor import DTensor

        func, tree, ctx.quiet, layout = call
        mesh = inputs[0].device_mesh
        whole = [Replicate()] * mesh.ndim
        local = [
            x.redistribute(placements=whole).to_local().detach().requires_grad_(x.requires_grad)
            for x in inputs
        ]
        args, kwargs = _map(lambda x: local[x.index] if isinstance(x, _Slot) else None, tree)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
            out = func(*args, **kwargs)  # saved tensors stay plain (not apply's hooks)
        results = _tensors(out)
        slots = iter(range(len(results)))
        layout.append(_map(lambda x: _Slot(next(slots)) if isinstance(x, torch.Tensor) else None,
                           out))  # fmt: skip
        ctx.local, ctx.results, ctx.whole = local, results, whole
        return tuple(DTensor.from_local(r.detach(), mesh, whole, run_check=False) for r in results)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:  # type: ignore[override]
        with ctx.quiet():
            return (None, *_whole_gradients(ctx.local, ctx.results, grads, ctx.whole))


def _whole_gradients(local: list, results: list, grads: tuple, whole: list) -> list:
    """The gradients of ``local`` (plain inputs of a whole call), as replicated DTensors."""
    from torch.distributed.tensor import DTensor

    mesh = next(g.device_mesh for g in grads if isinstance(g, DTensor))
    pairs = [(r, g) for r, g in zip(results, grads, strict=True)
             if g is not None and r.requires_grad]  # fmt: skip
    wanted = [x for x in local if x.requires_grad]
    plain = [g.redistribute(placements=whole).to_local() if isinstance(g, DTensor) else g
             for _, g in pairs]  # fmt: skip
    found = iter(
        torch.autograd.grad([r for r, _ in pairs], wanted, plain, allow_unused=True)
        if pairs and wanted else ()
    )  # fmt: skip
    out = []
    for x in local:
        g = next(found, None) if x.requires_grad else None
        out.append(None if g is None else DTensor.from_local(g, mesh, whole, run_check=False))
    return out


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _tensors(tree: Any) -> list:
    out: list = []
    _map(lambda x: out.append(x) if isinstance(x, torch.Tensor) else None, tree)
    return out


def _map(fn: Any, tree: Any) -> Any:
    """``tree`` (tuples, lists, dicts) with every leaf ``x`` replaced by ``fn(x)``."""
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a named tuple
        return type(tree)(*(_map(fn, x) for x in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(_map(fn, x) for x in tree)
    if isinstance(tree, dict):
        return {k: _map(fn, v) for k, v in tree.items()}
    out = fn(tree)
    return tree if out is None else out


def reset() -> None:
    """Unregister every fallback strategy and drop DTensor's cached decisions (a test file
    starts from DTensor's own registry: registrations are process-wide).

    Private: DTensor's registry has no public way to unregister a strategy."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    for target in _REGISTERED:
        op = _overload(target)
        propagator.op_strategy_funcs.pop(op, None)
        propagator.op_to_schema_info.pop(op, None)
    _REGISTERED.clear()
    propagator.propagate_op_sharding.cache_clear()
