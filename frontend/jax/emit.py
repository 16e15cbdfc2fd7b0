"""The JAX emitter: a plan as ``NamedSharding`` pytrees and a ``jax.jit`` that follows it.

``jit`` re-traces the function inside ``jax.jit`` and evaluates its jaxpr with the same walk as
capture (``walk.Walker``), binding each equation and pinning its results with
``with_sharding_constraint`` at the planned layouts, so XLA partitions the way the plan says
rather than by its own propagation. Partial (pending-sum) layouts cannot be written in ``Auto``
mode: those values stay unconstrained and the consumer's planned operand layout is pinned
instead, which is where the plan puts the reduction. Dots, ``reduce_sum``s over several split
dims and embedding gradients over ids split on several dims are bound as explicit pending sums
instead (``pending.py``: XLA would reduce them otherwise than planned). Other scatter-adds are
the exception: XLA would move the updates rather than reduce, so their pending sums are pinned
replicated first (``_Emit._scatter_add``). Two convolution layouts XLA would partition
otherwise (a grouped convolution's split batch, a staged pending sum of split input features)
are bound per device in a ``shard_map`` (``local_conv.py``). A layout with a Shardy sub-axis
(``"x":(1)2``) has no ``NamedSharding`` either (jax 0.10 exposes none): an intermediate with
one is left to XLA's own propagation, which reaches the same sub-axis from the pinned
neighbours, and the function's inputs and outputs take the whole-axis prefix, as Shardy does at
a jit boundary (``solver.summary.sub_axis_note`` says so in the plan's summary).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from ...ir import FrontendError, Mesh, Op, Sharding, Value
from ...solver.plan import Plan
from .capture import JaxContext
from .local_conv import explicit_conv
from .paths import pinned_layouts
from .pending import Pending, explicit_dot, explicit_reduce, explicit_scatter_rows, sum_axes
from .walk import Walker

SCATTER_ADD = frozenset({"scatter-add", "scatter_add"})
EXPLICIT = {
    "dot_general": "dot_general",
    "reduce_sum": "reduce_sum",
    "conv_general_dilated": "convolution",
}
"""Primitives the emitter may bind otherwise than captured -> their IR op kind (``_explicit``)."""


def make_jax_mesh(plan_or_mesh: Plan | Mesh) -> jax.sharding.Mesh:
    """A jax Mesh with the plan's axis names and sizes, ``Auto`` axis types, first N devices."""
    mesh = plan_or_mesh.mesh if isinstance(plan_or_mesh, Plan) else plan_or_mesh
    devices = jax.devices()
    if len(devices) < mesh.size:
        raise FrontendError(
            f"mesh {mesh} needs {mesh.size} devices but jax sees {len(devices)}; on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={mesh.size} before importing jax"
        )
    shape = tuple(size for _, size in mesh.axes)
    axis_types = (AxisType.Auto,) * len(shape)
    return jax.make_mesh(
        shape, mesh.axis_names, axis_types=axis_types, devices=devices[: mesh.size]
    )


def partition_spec(sharding: Sharding) -> PartitionSpec:
    """``[{"dp"}, {}, {"tp", "sp"}]`` -> ``P('dp', None, ('tp', 'sp'))`` (partial axes dropped).

    A ``PartitionSpec`` names whole mesh axes only, so a dim's axes stop before its first
    sub-axis (``"x":(1)2``): the nearest expressible layout, and what Shardy itself does to
    sub-axes at a jit boundary (``[{"x":(1)2}, {"x":(2)2}]`` becomes ``P()``).
    """
    entries: list[str | tuple[str, ...] | None] = []
    for axes in sharding.dims:
        if sharding.has_sub_axes:
            axes = whole_axes_prefix(axes)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*entries)


def whole_axes_prefix(axes: Sequence[str]) -> tuple[str, ...]:
    """A dim's axes up to its first sub-axis (what a ``PartitionSpec`` can say of it)."""
    out: list[str] = []
    for axis in axes:
        if ":" in axis:
            break
        out.append(axis)
    return tuple(out)


def relayout(
    sharding: Sharding | None, shape: Sequence[int], new_shape: Sequence[int]
) -> Sharding | None:
    """The same layout after a reshape that only adds or drops size-1 dims."""
    if sharding is None or tuple(shape) == tuple(new_shape):
        return sharding
    axes = iter([a for a, size in zip(sharding.dims, shape, strict=True) if size != 1])
    dims = tuple(next(axes) if size != 1 else () for size in new_shape)
    return Sharding(dims, sharding.partial)


def _context(plan: Plan) -> JaxContext:
    context = plan.frontend_context
    if not isinstance(context, JaxContext):
        raise FrontendError(
            "this plan has no JAX capture context (it was loaded from JSON or planned from a "
            "Graph); plan the JAX function with shardplan.plan(fn, *example_args, mesh=...)"
        )
    return context


def to_partition_specs(plan: Plan) -> Any:
    """Tuple (one entry per positional argument) of PartitionSpec pytrees."""
    context = _context(plan)
    specs = [partition_spec(plan.sharding_of(name)) for name in context.arg_inputs]
    return jax.tree_util.tree_unflatten(context.in_tree, specs)


def in_shardings(plan: Plan, jax_mesh: jax.sharding.Mesh | None = None) -> Any:
    """Tuple (one entry per positional argument) of NamedSharding pytrees (default mesh:
    ``make_jax_mesh(plan)``)."""
    jax_mesh = mesh_or_default(plan, jax_mesh)
    specs = to_partition_specs(plan)
    return jax.tree.map(lambda s: NamedSharding(jax_mesh, s), specs, is_leaf=_is_spec)


def out_shardings(plan: Plan, jax_mesh: jax.sharding.Mesh | None = None) -> Any:
    """NamedSharding pytree matching the function's outputs (default mesh as above)."""
    jax_mesh = mesh_or_default(plan, jax_mesh)
    context = _context(plan)
    layouts = plan.output_shardings or [plan.sharding_of(n) for n in context.outputs]
    leaves = [NamedSharding(jax_mesh, partition_spec(s)) for s in layouts]
    return jax.tree_util.tree_unflatten(context.out_tree, leaves)


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


class _Emit(Walker[Any]):
    """The emitter walk: bind every equation, pin planned layouts around it."""

    def __init__(self, plan: Plan, context: JaxContext, jax_mesh: jax.sharding.Mesh) -> None:
        super().__init__()
        self.plan = plan
        self.context = context
        self.jax_mesh = jax_mesh
        self.op_index = {id(op): i for i, op in enumerate(plan.graph.ops)}
        self.constraints = 0
        self.left_to_xla = 0
        """Planned layouts with sub-axes, left unconstrained (``sub_axis_note``)."""
        self.edges, self.results, self.outputs = _reshard_paths(plan)
        self.chains: dict[tuple[str, tuple[Sharding, ...]], Any] = {}
        self.values = {v.name: v for v in plan.graph.values()}
        self.produced = {
            r.value: r.src for r in plan.reshards if r.consumer.startswith("reduce:")
        }  # a reduce-once value's layout as its producer computes it (its pending sum)

    def _pin(self, x: Any, sharding: Sharding | None) -> Any:
        if isinstance(x, Pending) and sharding is not None:
            x = sum_axes(x, sharding.partial)  # a planned reduction
            if isinstance(x, Pending):
                if sharding.rank == len(x.shape):
                    x.array = self._pin(x.array, x.expanded(sharding.without_partial()))
                return x
        if sharding is None or sharding.partial or sharding.rank != len(getattr(x, "shape", ())):
            return x
        if sharding.has_sub_axes:  # no NamedSharding holds a sub-axis: XLA chooses this one
            self.left_to_xla += 1
            return x
        self.constraints += 1
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(self.jax_mesh, partition_spec(sharding))
        )

    def _pin_path(self, x: Any, layouts: list[Sharding], value: str = "") -> Any:
        """Pin ``layouts`` in turn; chains of the same value share their common prefix, so a
        reshard two consumers need is done once (as ``paths.distinct_collectives`` counts)."""
        for k, layout in enumerate(layouts):
            key = (value, tuple(layouts[: k + 1]))
            if value and key in self.chains:
                x = self.chains[key]
                continue
            x = self._pin(x, layout)
            if value:
                self.chains[key] = x
        return x

    def _pin_results(self, outs: list[Any]) -> list[Any]:
        """Pin each result at its planned layout (after the steps of a user pin, if any)."""
        if self.step >= len(self.context.steps):
            raise FrontendError("the function traced differently from the planned one")
        pinned = []
        for x, name in zip(outs, self.context.steps[self.step], strict=True):
            if name in self.results:
                x = self._pin_path(x, self.results[name])
            pinned.append(self._pin(x, self.plan.shardings.get(name) if name else None))
        return pinned

    def _pin_operands(self, ins: list[Any]) -> list[Any]:
        """Where the plan reshards an edge, pin every layout along the way to the consumer's."""
        out = list(ins)
        for k, use in enumerate(self.context.step_uses[self.step]):
            if use is not None and id(use[0]) in self.op_index:
                out[k] = self._pin_use(out[k], *use)
        return out

    def _pin_use(self, x: Any, op: Op, index: int) -> Any:
        """Pin ``x`` along the planned reshard into operand ``index`` of IR op ``op``."""
        key, value = (self.op_index[id(op)], index), op.operands[index]
        shape = tuple(getattr(x, "shape", ()))
        if key in self.edges:
            path = [relayout(s, value.type.shape, shape) for s in self.edges[key]]
            return self._pin_path(x, path, value.name)
        if (wanted := self.plan.operand_shardings.get(key)) != self.plan.shardings.get(value.name):
            return self._pin(x, relayout(wanted, value.type.shape, shape))
        return x

    def _pin_summed(self, x: Any, value: Value) -> Any:
        """Pin a scatter-add's result at its planned layout with any partial axes replicated:
        for a pending sum XLA then scatters locally and reduces (all-reduce, and the reader's
        dynamic-slice makes it a reduce-scatter) instead of moving the updates into the
        reader's layout (docs/design.md, "Scatter-adds as the plan computes them")."""
        sharding = self.plan.shardings.get(value.name)
        return self._pin(x, sharding.without_partial()) if sharding is not None else x

    def _scatter_add(self, eqn: Any, ins: list[Any], params: dict[str, Any]) -> Any:
        """Bind a scatter-add as the plan computes it. An embedding gradient was captured as
        ``embedding_backward`` (a scatter into zeros) + ``add`` of the base; it is emitted as
        those two ops so the scatter's own result, which the plan may leave partial, has a
        value to pin."""
        (name,) = self.context.steps[self.step]
        value = self.values.get(name) if name else None
        add = value.producer if value is not None else None
        planned = add is not None and add.kind == "add" and id(add) in self.op_index
        rows = add.operands[1] if planned else None
        if rows is None or rows.producer is None or rows.producer.kind != "embedding_backward":
            out = eqn.primitive.bind(*ins, **params)
            return self._pin_summed(out, value) if value is not None else out
        base, indices, updates = ins
        summed = self._explicit_rows(rows, base, indices, updates, params)
        if summed is None:
            zeros = jax.lax.full(base.shape, 0, base.dtype)
            summed = self._pin_summed(eqn.primitive.bind(zeros, indices, updates, **params), rows)
        return jax.lax.add(base, _plain(self._pin_use(summed, add, 1)))

    def _explicit_rows(
        self, rows: Value, base: Any, indices: Any, updates: Any, params: dict[str, Any]
    ) -> Pending | None:
        """The embedding gradient ``rows`` as an explicit pending sum when the plan leaves it
        one over ids split on several dims (``pending.explicit_scatter_rows``); else None."""
        planned = self._planned(rows.name)
        if planned is None or tuple(updates.shape) != planned[0].operands[0].type.shape:
            return None
        _, result, (upd_layout, ids_layout) = planned
        return explicit_scatter_rows(
            base,
            indices,
            updates,
            (upd_layout, ids_layout),
            result,
            params.get("mode"),
            self.plan.mesh,
            self._pin,
        )

    def pin_outputs(self, outs: list[Any]) -> list[Any]:
        return [_plain(self._pin_path(x, self.outputs.get(i, []))) for i, x in enumerate(outs)]

    def _planned(
        self, name: str | None, partial: bool = True
    ) -> tuple[Op, Sharding, list[Sharding]] | None:
        """The producer of value ``name``, its planned (produced) layout when that is a pending
        sum (any layout unless ``partial``), and its operands' planned layouts; None for any
        other value."""
        value = self.values.get(name) if name else None
        result = self.produced.get(name) or self.plan.shardings.get(name) if name else None
        op = value.producer if value is not None else None
        if result is None or (partial and not result.partial):
            return None
        if op is None or id(op) not in self.op_index:
            return None
        i = self.op_index[id(op)]
        layouts = [
            self.plan.operand_shardings.get((i, k), self.plan.shardings.get(operand.name))
            for k, operand in enumerate(op.operands)
        ]
        if any(layout is None for layout in layouts):
            return None
        return op, result, layouts  # type: ignore[return-value]

    def _explicit(self, eqn: Any, ins: list[Any], params: dict[str, Any]) -> Any | None:
        """A dot or ``reduce_sum`` whose planned result is a pending sum, bound so that XLA
        reduces it as planned (``pending.py``), or a convolution XLA would partition otherwise
        than planned (``local_conv.py``); None for any other equation."""
        kind = eqn.primitive.name
        if kind not in EXPLICIT or len(self.context.steps[self.step]) != 1:
            return None
        conv = kind == "conv_general_dilated"
        if (planned := self._planned(self.context.steps[self.step][0], not conv)) is None:
            return None
        op, result, layouts = planned
        if op.kind != EXPLICIT[kind] or any(
            tuple(getattr(x, "shape", ())) != v.type.shape
            for x, v in zip(ins, op.operands, strict=True)
        ):
            return None
        if conv:
            return explicit_conv(eqn, ins, layouts, result, params, self.jax_mesh, self._pin)
        if kind == "reduce_sum":
            (x,) = ins
            return explicit_reduce(x, layouts[0], params["axes"], result, self.plan.mesh, self._pin)
        return explicit_dot(*ins, tuple(layouts), result, params, self.plan.mesh, self._pin)

    def apply(self, eqn: Any, ins: list[Any]) -> list[Any]:
        ins = [_plain(x) for x in self._pin_operands(ins)]
        params = eqn.primitive.get_bind_params(eqn.params)  # jax 0.10: params only
        with eqn.ctx.manager:  # the equation's context (compute type, metadata), as eval_jaxpr
            if eqn.primitive.name in SCATTER_ADD:
                return self._pin_results([self._scatter_add(eqn, ins, params)])
            if (pending := self._explicit(eqn, ins, params)) is not None:
                return self._pin_results([pending])
            outs = eqn.primitive.bind(*ins, **params)
        return self._pin_results(list(outs) if eqn.primitive.multiple_results else [outs])

    def index(self, x: Any, i: int) -> Any:
        (x,) = [_plain(y) for y in self._pin_operands([x])]
        return self._pin_results([jax.lax.index_in_dim(x, i, axis=0, keepdims=False)])[0]

    def stack(self, pieces: list[Any]) -> Any:
        pieces = [_plain(p) for p in self._pin_operands(pieces)]
        rows = [jax.lax.expand_dims(p, (0,)) for p in pieces]
        return self._pin_results([jax.lax.concatenate(rows, 0)])[0]

    def _pin_step(self, step: int, x: Any, operand: bool = True, result: bool = True) -> Any:
        """Pin ``x`` as step ``step`` planned: along its use (``operand``), at its result."""
        saved, self.step = self.step, step
        try:
            x = self._pin_operands([x])[0] if operand else x
            return self._pin_results([x])[0] if result else x
        finally:
            self.step = saved

    def loop(self, eqn: Any, consts: list[Any], init: list[Any], xs: list[Any]) -> list[Any]:
        """A ``lax.scan`` whose body is the planned one: carries enter and come back at the
        ``scan_carry`` layouts, each iteration's slices at the ``scan_index`` results', and the
        stacked results leave at the ``scan_stack`` layouts (steps numbered as in capture)."""
        p = eqn.params
        n_carry, first = p["num_carry"], self.step
        carry_steps = range(first, first + len(init))
        index_steps = range(carry_steps.stop, carry_steps.stop + len(xs))
        init = [_plain(self._pin_step(s, c)) for s, c in zip(carry_steps, init, strict=True)]
        xs = [
            _plain(self._pin_step(s, x, result=False)) for s, x in zip(index_steps, xs, strict=True)
        ]
        consts = [_plain(c) for c in consts]
        traced: list[tuple[int, list[int]]] = []
        outer_chains = self.chains  # reshards done inside the body must not leak out of it

        def body(carry: list[Any], sliced: list[Any]) -> tuple[list[Any], list[Any]]:
            self.step = index_steps.stop  # (lax.scan may trace the body more than once)
            self.chains = dict(outer_chains)
            carry = [
                self._pin_step(s, c, operand=False) for s, c in zip(carry_steps, carry, strict=True)
            ]
            sliced = [
                self._pin_step(s, x, operand=False)
                for s, x in zip(index_steps, sliced, strict=True)
            ]
            with self.body(p["length"]):
                walked = self.run_closed(p["jaxpr"], [*consts, *carry, *sliced])
            outs = [_plain(self.materialize(o)) for o in walked]
            looped = []
            for o in outs[:n_carry]:
                looped.append(self._pin_step(self.step, o))
                self.step += 1
            stack_steps = list(range(self.step, self.step + len(outs) - n_carry))
            ys = [
                self._pin_step(s, y, result=False)
                for s, y in zip(stack_steps, outs[n_carry:], strict=True)
            ]
            self.step += len(stack_steps)
            traced.append((self.step, stack_steps))
            return looped, ys

        final, stacked = jax.lax.scan(
            body, init, xs, length=p["length"], reverse=p["reverse"], unroll=p.get("unroll", 1)
        )
        self.step, stack_steps = traced[-1]
        self.chains = outer_chains
        ys = [
            self._pin_step(s, y, operand=False) for s, y in zip(stack_steps, stacked, strict=True)
        ]
        return [*final, *ys]

    def literal(self, value: Any, aval: Any) -> Any:
        return value

    def constant(self, value: Any) -> Any:
        return value


def _plain(x: Any) -> Any:
    """An array for a consumer the plan gives no reduction step: a pending sum is summed and
    XLA reduces it as it likes (the emitter's behaviour before ``pending.py``)."""
    return x.total() if isinstance(x, Pending) else x


Paths = dict[Any, list[Sharding]]


def _reshard_paths(plan: Plan) -> tuple[Paths, Paths, Paths]:
    """Layouts to pin along each planned reshard: by (op, operand), by pinned result name, and
    by output index."""
    edges: Paths = {}
    results: Paths = {}
    outputs: Paths = {}
    for r in plan.reshards:
        layouts = pinned_layouts(r.src, r.dst, r.collectives, plan.mesh, partial=True)
        kind, _, where = r.consumer.partition(":")
        if kind == "op":
            op, operand = where.split(":")
            edges[(int(op), int(operand))] = layouts
        elif kind == "pin":
            results[where] = ([] if r.src.partial else [r.src]) + layouts
        elif kind == "reduce":  # a reduce-once value: the layouts its producer reduces it to
            results[where] = layouts
        elif kind in ("output", "alias"):
            outputs[int(where)] = layouts
    return edges, results, outputs


def mesh_or_default(plan: Plan, jax_mesh: jax.sharding.Mesh | None) -> jax.sharding.Mesh:
    return make_jax_mesh(plan) if jax_mesh is None else jax_mesh


def planned_function(plan: Plan) -> Callable[..., Any]:
    """The function ``plan`` was captured from (``plan.jit()`` without ``fn``)."""
    fn = _context(plan).fn
    if fn is None:
        raise FrontendError("this plan does not hold its function; call plan.jit(fn, jax_mesh)")
    return fn


def jit(
    plan: Plan, fn: Callable[..., Any] | None = None, jax_mesh: jax.sharding.Mesh | None = None
) -> Any:
    """``jax.jit(fn)`` with the planned in/out shardings and every planned intermediate layout.

    ``fn`` is traced again inside the jit (so closed-over values are current) and must trace to
    the same equations as the planned function; scans stay scans (their bodies pinned as
    planned) unless they were captured unrolled. ``fn`` defaults to the planned function,
    ``jax_mesh`` to ``make_jax_mesh(plan)`` (the first devices, the plan's axis names, Auto
    axis types).
    """
    context = _context(plan)
    fn = planned_function(plan) if fn is None else fn
    jax_mesh = mesh_or_default(plan, jax_mesh)
    name = getattr(fn, "__name__", "planned")
    filtered = None
    if context.filtered is not None:  # non-array leaves: jit the array part, recombine
        filtered = dataclasses.replace(context.filtered, fn=fn)
        fn = filtered.traced

    def planned(*args: Any) -> Any:
        flat, tree = jax.tree_util.tree_flatten(args)
        if tree != context.in_tree:
            raise FrontendError(f"arguments {tree} do not match the planned ones {context.in_tree}")
        closed = jax.make_jaxpr(fn)(*args)
        walker = _Emit(plan, context, jax_mesh)
        walker.unroll = context.unroll_scans
        outs = [walker.materialize(v) for v in walker.run_closed(closed, flat)]
        outs = walker.pin_outputs(outs)
        if walker.step != len(context.steps):
            raise FrontendError(
                f"{name} traced to {walker.step} steps, the plan has "
                f"{len(context.steps)}; plan and run the same function"
            )
        return jax.tree_util.tree_unflatten(context.out_tree, outs)

    planned.__name__ = name
    jitted = jax.jit(
        planned,
        in_shardings=in_shardings(plan, jax_mesh),
        out_shardings=out_shardings(plan, jax_mesh),
        donate_argnums=context.donate,  # a serving step's KV cache: written in place
    )
    return filtered.wrap(jitted) if filtered is not None else jitted
