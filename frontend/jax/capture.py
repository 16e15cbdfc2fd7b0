"""Capture a JAX callable as an IR graph: ``jax.make_jaxpr`` on the example pytrees, then one
IR op (or a few) per equation.

Graph inputs are the flattened argument leaves, in ``jax.tree_util`` order, each with its pytree
path (``params['layers'][0]['wq']``) as origin. Roles come from the path (see ``default_role``)
or the ``roles=`` option. Example arguments may be ``jax.ShapeDtypeStruct``s: nothing is
allocated, so a 7B-shaped step can be planned on a laptop.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from ...ir import FrontendError, Graph, Mesh, Op, Origin, Pin, Role, TensorType, Value
from .constraints import Constraint, check_pins, constraint_of, pin_table
from .conventions import Filtered, InPlaceCheck, variable_roles
from .lower import Emitter, ir_type, literal_attrs, lower_equation
from .regions import pins_of, region_attrs
from .serving import SERVING_MODES, ServingStep, check_serving_step, donated_arguments
from .walk import Walker

OPTIMIZER_KEYS = frozenset(
    {"opt_state", "optimizer_state", "opt", "optimizer", "mu", "nu", "momentum", "trace"}
)
PARAMETER_KEYS = frozenset({"params", "param", "parameters", "weights", "variables", "model"})
STATE_KEYS = frozenset({"batch_stats"})
"""Keys of mutable model state (Flax Linen's ``mutable=["batch_stats"]``): held and updated by
the step like an optimizer state (``Role.OPTIMIZER_STATE``), never split as a batch."""
CACHE_KEYS = frozenset({"cache", "kv_cache", "kvcache", "past_key_values"})
"""Keys of a serving step's key/value cache (``Role.KV_CACHE``, aliased to the updated cache
the step returns: ``frontend/jax/serving.py``)."""

RolesOption = Mapping[str, Role | str] | Callable[[str], Role | str | None] | None


def _xla_partial_semantics():
    from ...solver.costs import PartialSemantics

    return PartialSemantics(passthrough=False, reduce_once=True)


@dataclass(eq=False)
class JaxContext:
    """What the JAX emitter needs to map a plan back onto the traced function."""

    closed_jaxpr: Any
    in_tree: Any
    """PyTreeDef of the positional arguments (a tuple)."""
    out_tree: Any
    arg_inputs: list[str]
    """IR input name of every flattened argument leaf."""
    outputs: list[str]
    """IR value name of every flattened output leaf."""
    partial_semantics: object = field(default_factory=lambda: _xla_partial_semantics())
    """XLA in Auto mode reduces pending sums at the producing op, once (see solver/costs.py)."""
    steps: list[tuple[str | None, ...]] = field(default_factory=list)
    """Per walk step, the IR value names of its results (None: no IR value)."""
    step_uses: list[tuple[tuple[Op, int] | None, ...]] = field(default_factory=list)
    """Per walk step and operand, the IR (op, operand index) that consumes it first; its
    operand may be a size-1-dims reshape of the step's operand (see ``emit.relayout``)."""
    unroll_scans: bool = False
    """Scans were captured iteration by iteration (else each body once)."""
    serving: ServingStep | None = None
    """A prefill/decode step's batch, tokens and cache (``mode=``); None otherwise."""
    donate: tuple[int, ...] = ()
    """Positional arguments ``plan.jit`` donates: a serving step's KV cache."""
    fn: Callable[..., Any] | None = None
    """The planned function (``plan.jit()`` compiles it when given no other)."""
    filtered: Filtered | None = None
    """Set when the arguments had non-array leaves (an Equinox module's functions): the graph
    is of ``filtered.traced`` over the array part (``conventions.py``)."""
    constraints: dict[str, Constraint] = field(default_factory=dict)
    """IR value name -> the user's ``with_sharding_constraint`` / ``reshard`` on it (the last
    one wins); ``sp.plan`` pins them (``user_pins``)."""

    def user_pins(self, mesh: Mesh | None) -> dict[str, Pin]:
        """The constraints as pins (value name -> sharding), checked against ``mesh``."""
        if mesh is not None:
            check_pins(self.constraints, mesh)
        return pin_table(self.constraints)


def default_role(keys: Sequence[str]) -> Role:
    """Role from pytree keys, outermost first: the first key naming optimizer state
    (``opt_state``, ``mu``, ``nu``...), parameters (``params``, ``weights``...) or a KV cache
    (``cache``, ``kv_cache``) decides; anything else is a batch input."""
    for key in keys:
        if key.lower() in CACHE_KEYS:
            return Role.KV_CACHE
        if key.lower() in OPTIMIZER_KEYS or key.lower() in STATE_KEYS:
            return Role.OPTIMIZER_STATE
        if key.lower() in PARAMETER_KEYS:
            return Role.PARAMETER
    return Role.INPUT


def _role(path: str, keys: Sequence[str], roles: RolesOption, typed: Role | None) -> Role:
    """``roles=`` first, then the leaf's ``nnx.Variable`` type (``typed``), then its keys."""
    chosen: Role | str | None = None
    if callable(roles):
        chosen = roles(path)
    elif roles:
        prefixes = [p for p in roles if path.startswith(p)]
        chosen = roles[max(prefixes, key=len)] if prefixes else None
    if chosen is None:
        return typed or default_role(keys)
    return chosen if isinstance(chosen, Role) else Role(chosen)


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _arg_names(fn: Callable[..., Any], count: int) -> list[str]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in params if p.kind in kinds]
    return [names[i] if i < len(names) else f"arg{i}" for i in range(count)]


_LIBRARY_DIRS = (
    *(
        os.path.join(os.path.dirname(os.path.dirname(m.__file__)), m.__name__, "")
        for m in (jax, np)
    ),
    os.path.join(os.path.dirname(os.path.dirname(__file__)), ""),
    "<",
)


def _source(eqn: Any) -> str:
    """``file.py:line`` of the innermost user frame that produced the equation."""
    traceback = getattr(eqn.source_info, "traceback", None)
    if traceback is None:
        return ""
    for frame in traceback.frames:
        name = frame.file_name
        if not name.startswith(_LIBRARY_DIRS) and "jaxlib" not in name:
            return f"{os.path.basename(name)}:{frame.line_num}"
    return ""


StepUse = tuple[Op, int]


def _first_use(ops: Sequence[Op], value: Value) -> StepUse | None:
    return next(((op, i) for op in ops for i, v in enumerate(op.operands) if v is value), None)


def _same_dims(a: Sequence[int], b: Sequence[int]) -> bool:
    """Reshapes that only add or drop size-1 dims keep every layout expressible."""
    return [d for d in a if d != 1] == [d for d in b if d != 1]


class _Capture(Walker[Value]):
    """The capture walk: every step appends IR ops and records their values."""

    def __init__(self, graph: Graph, context: JaxContext) -> None:
        super().__init__()
        self.graph = graph
        self.context = context
        self._constants: dict[tuple[Any, ...], Value] = {}
        self._sources: dict[int, str] = {}

    def _source(self, eqn: Any) -> str:
        """Cached: inlined jaxprs repeat the same equations (one per call and per layer)."""
        key = id(eqn.source_info)
        if key not in self._sources:
            self._sources[key] = _source(eqn)
        return self._sources[key]

    def _origin(self, eqn: Any = None) -> Origin:
        """Module path from the walk; source from the equation or, for library code that was
        traced once and inlined (``jnp.take``), from the innermost call site in user code."""
        source = self._source(eqn) if eqn is not None else ""
        for site in reversed(self.call_sites):
            source = source or self._source(site)
        return Origin(module=".".join(self.modules), source=source)

    def _record(self, ins: Sequence[Value], outs: Sequence[Value], first_op: int | None) -> None:
        """Remember the step's result names and, per operand, the IR use whose planned layout
        the emitter pins (looking through a step-internal reshape, as for embedding ids)."""
        ops = self.graph.ops[first_op:] if first_op is not None else []
        uses: list[StepUse | None] = []
        for value in ins:
            use = _first_use(ops, value)
            if use is not None and use[0].kind == "reshape":
                inner = _first_use(ops, use[0].results[0])
                if inner is not None and _same_dims(value.type.shape, use[0].results[0].type.shape):
                    use = inner
            uses.append(use)
        self.context.steps.append(tuple(v.name for v in outs))
        self.context.step_uses.append(tuple(uses))

    def apply(self, eqn: Any, ins: list[Value]) -> list[Value]:
        em = Emitter(self.graph, self._origin(eqn))
        if eqn.primitive.name == "shard_map":
            outs = self._region(em, eqn, ins)
        else:
            outs = lower_equation(em, eqn, ins)
        self._mark_repeat(em.first_op)
        self._record(ins, outs, em.first_op)
        return outs

    def _region(self, em: Emitter, eqn: Any, ins: list[Value]) -> list[Value]:
        """A ``shard_map``: one opaque op, its operands and results pinned to its specs
        (``regions.py``); a later annotation of the same value wins, as for constraints."""
        types = [ir_type(v.aval) for v in eqn.outvars]
        in_ranks, out_ranks = [v.type.rank for v in ins], [t.rank for t in types]
        attrs = region_attrs(eqn, in_ranks, out_ranks)
        outs = em.op("shard_map", ins, types, **attrs)
        source = self._origin(eqn).source
        for value, sharding in zip([*ins, *outs], pins_of(attrs, in_ranks, out_ranks), strict=True):
            self.context.constraints[value.name] = Constraint(sharding, source, "shard_map")
        return outs

    def pass_through(self, eqn: Any, ins: list[Value]) -> list[Value]:
        """A user constraint pins the value it constrains (the output is the same IR value)."""
        outs = super().pass_through(eqn, ins)
        if eqn.primitive.name in ("sharding_constraint", "reshard"):
            for value in outs:
                found = constraint_of(eqn, value.type.rank, self._origin(eqn).source)
                if found is not None:
                    self.context.constraints[value.name] = found
        return outs

    def _mark_repeat(self, first_op: int | None) -> None:
        """Ops lowered inside a scan body walked once run once per iteration."""
        if self.repeat != 1 and first_op is not None:
            for op in self.graph.ops[first_op:]:
                op.attrs["repeat"] = self.repeat

    def loop(
        self, eqn: Any, consts: list[Value], init: list[Value], xs: list[Value]
    ) -> list[Value]:
        """The body once, between boundary ops: ``scan_carry`` (a carry entering the loop),
        ``scan_index`` (a stacked operand's slice), ``scan_loop`` (a carry handed to the next
        iteration, in the layout it entered with) and ``scan_stack`` (a result's slice)."""
        p = eqn.params
        length, n_carry = p["length"], p["num_carry"]
        carry = [self._boundary("scan_carry", c, c.type) for c in init]
        sliced = [self._boundary("scan_index", x, _row(x.type)) for x in xs]
        with self.body(length):
            walked = self.run_closed(p["jaxpr"], [*consts, *carry, *sliced])
            outs = [self.materialize(o) for o in walked]
            final = [
                self._boundary("scan_loop", o, o.type, carry=c.name)
                for o, c in zip(outs[:n_carry], carry, strict=True)
            ]
            ys = [
                self._boundary("scan_stack", y, TensorType((length, *y.type.shape), y.type.dtype))
                for y in outs[n_carry:]
            ]
        return [*final, *ys]

    def _boundary(self, kind: str, x: Value, type_: TensorType, **attrs: Any) -> Value:
        em = Emitter(self.graph, self._origin())
        out = em.one(kind, [x], type_, **attrs)
        self._mark_repeat(em.first_op)
        self._record([x], [out], em.first_op)
        self.step += 1
        return out

    def index(self, x: Value, i: int) -> Value:
        em = Emitter(self.graph, self._origin())
        start = (i,) + (0,) * (x.type.rank - 1)
        limit = (i + 1, *x.type.shape[1:])
        row = em.one(
            "slice", [x], TensorType((1, *x.type.shape[1:]), x.type.dtype), start=start, limit=limit
        )
        out = em.one("reshape", [row], TensorType(x.type.shape[1:], x.type.dtype))
        self._record([x], [out], em.first_op)
        return out

    def stack(self, pieces: list[Value]) -> Value:
        em = Emitter(self.graph, self._origin())
        t = pieces[0].type
        rows = []
        for i, piece in enumerate(pieces):  # piece i came from iteration i: its layer's op
            with self.module(f"layers.{i}"):
                em.origin = self._origin()
                rows.append(em.one("reshape", [piece], TensorType((1, *t.shape), t.dtype)))
        em.origin = self._origin()
        while len(rows) > 1:  # concats of at most 8 operands: rule letters are finite
            groups = [rows[i : i + 8] for i in range(0, len(rows), 8)]
            rows = [self._concat(em, g) if len(g) > 1 else g[0] for g in groups]
        self._record(pieces, rows, em.first_op)
        return rows[0]

    @staticmethod
    def _concat(em: Emitter, rows: list[Value]) -> Value:
        t = rows[0].type
        shape = (sum(r.type.shape[0] for r in rows), *t.shape[1:])
        return em.one("concat", rows, TensorType(shape, t.dtype), dimension=0)

    def literal(self, value: Any, aval: Any) -> Value:
        type_ = ir_type(aval)
        attrs = literal_attrs(value)
        key = (type_, tuple(sorted(attrs.items())))
        if key not in self._constants or not attrs:
            op = self.graph.add_op("constant", [], [type_], attrs=attrs, origin=self._origin())
            self._constants[key] = op.result
        return self._constants[key]

    def constant(self, value: Any) -> Value:
        """Closed-over arrays: scalars become ``constant`` ops, arrays CONSTANT graph inputs."""
        if np.ndim(value) == 0:
            return self.literal(value, value)
        return self.graph.add_input(
            "const", ir_type(value), Role.CONSTANT, Origin(path="<closure>")
        )


def _row(t: TensorType) -> TensorType:
    return TensorType(t.shape[1:], t.dtype)


def _flatten_args(
    fn: Callable[..., Any], args: tuple[Any, ...]
) -> tuple[list[tuple[str, list[str]]], Any]:
    """(path text, key names) per leaf, and the tree of the positional arguments."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(args)
    names = _arg_names(fn, len(args))
    paths = []
    for path, _ in leaves:
        arg = names[path[0].idx]
        rest = path[1:]
        paths.append((arg + jax.tree_util.keystr(rest), [arg, *(_key_name(k) for k in rest)]))
    return paths, tree


def capture(
    fn: Callable[..., Any],
    *args: Any,
    roles: RolesOption = None,
    name: str | None = None,
    unroll_scans: bool = False,
    mode: str | None = None,
    context_len: int | None = None,
    **options: Any,
) -> tuple[Graph, JaxContext]:
    """Trace ``fn(*args)`` and lower it to an IR graph.

    Args:
      fn: any JAX callable (a training step usually returns updated params, state and loss).
      args: example pytrees of arrays or ``jax.ShapeDtypeStruct``s.
      roles: path prefix -> Role (``{"batch": Role.INPUT}``) or a function of the path text.
      name: graph name (defaults to the function's name).
      unroll_scans: capture every iteration of a ``lax.scan`` on its own (a pipeline splits
        layers into stages) instead of its body once, standing for all iterations.
      mode, context_len: ``"decode"`` / ``"prefill"`` for a serving step over an explicit KV
        cache (``frontend/jax/serving.py``); checked, and its donated arguments recorded.
    Returns:
      the graph and the context the JAX emitter needs.
    """
    if options:
        raise FrontendError(
            f"unknown JAX capture options {sorted(options)}; "
            "the JAX frontend takes roles=, name=, unroll_scans=, mode= and context_len="
        )
    if mode is not None and mode not in SERVING_MODES:
        raise FrontendError(
            f"mode={mode!r}: a JAX function is planned as written (a training step, a forward); "
            "mode= takes 'decode' or 'prefill' for a serving step over an explicit KV cache"
        )
    if context_len is not None and mode is None:
        raise FrontendError("context_len= is for mode='decode'/'prefill'")
    filtered = Filtered.of(fn, args)
    traced, args = (filtered.traced, filtered.dynamic(args)) if filtered else (fn, args)
    guarded = InPlaceCheck(traced)
    closed, out_shape = jax.make_jaxpr(guarded, return_shape=True)(*args)
    guarded.check(getattr(fn, "__name__", "the step"))
    paths, in_tree = _flatten_args(fn, args)
    graph = Graph(name=name or getattr(fn, "__name__", "main").strip("<>") or "main")
    inputs = []
    typed = variable_roles(args)
    for (path, keys), aval, kind in zip(paths, closed.in_avals, typed, strict=True):
        role = _role(path, keys, roles, kind)
        inputs.append(graph.add_input("_".join(keys), ir_type(aval), role, Origin(path=path)))
    out_tree = jax.tree_util.tree_structure(out_shape)
    names = [v.name for v in inputs]
    context = JaxContext(closed, in_tree, out_tree, names, [], unroll_scans=unroll_scans, fn=fn)
    context.filtered = filtered
    walker = _Capture(graph, context)
    walker.unroll = unroll_scans
    outs = [walker.materialize(v) for v in walker.run_closed(closed, inputs)]
    context.outputs = [v.name for v in outs]
    graph.set_outputs(outs, _output_aliases(args, out_shape, inputs))
    if mode is not None:
        context.serving = check_serving_step(graph, mode, context_len)
        context.donate = donated_arguments(graph, names, in_tree)
    return graph, context


STATEFUL = frozenset({Role.PARAMETER, Role.OPTIMIZER_STATE, Role.KV_CACHE})


def _output_aliases(args: tuple[Any, ...], out: Any, inputs: list[Value]) -> dict[int, int]:
    """Outputs that are updated parameters / optimizer states / KV caches: a top-level output
    element with the same tree structure, shapes and dtypes as a positional argument holding
    such inputs."""
    if not isinstance(out, tuple | list):
        return {}
    aliases: dict[int, int] = {}
    claimed: set[int] = set()
    in_offset = 0
    tu = jax.tree_util
    arg_offsets = []
    for arg in args:
        arg_offsets.append(in_offset)
        in_offset += tu.tree_structure(arg).num_leaves
    out_offset = 0
    for element in out:
        out_leaves, out_def = tu.tree_flatten(element)
        for i, arg in enumerate(args):
            arg_leaves, arg_def = tu.tree_flatten(arg)
            same = arg_def == out_def and all(
                tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype
                for a, b in zip(arg_leaves, out_leaves, strict=True)
            )
            stateful = {inputs[arg_offsets[i] + k].role for k in range(len(arg_leaves))}
            if same and i not in claimed and stateful & STATEFUL:
                claimed.add(i)
                aliases.update({out_offset + k: arg_offsets[i] + k for k in range(len(out_leaves))})
                break
        out_offset += len(out_leaves)
    return aliases
