"""SSA graph of ops over tensor values, with provenance and training roles.

The graph owns use bookkeeping: operands change only through ``Graph`` methods, so passes never
touch use lists (as in torch.fx). Ops are kept in a topological order.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from .errors import IRVerifyError
from .mesh import Mesh
from .rules import ShardingRule
from .sharding import Sharding
from .types import TensorType

AttrValue = int | float | str | bool | tuple[int, ...] | tuple[tuple[int, ...], ...]


class Role(enum.Enum):
    """What a value is in a training step; graph inputs are tagged, the rest are activations."""

    PARAMETER = "param"
    OPTIMIZER_STATE = "opt_state"
    INPUT = "input"
    CONSTANT = "const"
    ACTIVATION = "act"
    KV_CACHE = "kv_cache"
    """A serving step's key/value cache: a graph input updated in place (its new contents are
    an output aliased to it), held all step like a parameter, split like the heads it caches."""


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a value came from, so emitters and error messages can map back to the user's code."""

    path: str = ""
    """Parameter FQN (``layers.0.attn.wq.weight``) or pytree path (``params['w1']``)."""
    module: str = ""
    """Module path or named scope that produced the value."""
    source: str = ""
    """``file.py:line`` of the producing code, when known."""

    def __str__(self) -> str:
        parts = [p for p in (self.path, self.module) if p]
        text = " ".join(dict.fromkeys(parts))
        if self.source:
            text += f" ({self.source})" if text else self.source
        return text


@dataclass(eq=False, slots=True)
class Value:
    """An SSA value: a graph input or one result of an op. Hashed by identity."""

    name: str
    type: TensorType
    role: Role = Role.ACTIVATION
    origin: Origin = field(default_factory=Origin)
    producer: Op | None = None
    """The op whose result this is; None for graph inputs."""
    sharding: Sharding | None = None
    """Annotation: a user pin, a propagated hint, or the solved layout."""
    pinned: bool = False
    """True when ``sharding`` is a user pin that passes and the solver must keep."""
    uses: list[Use] = field(default_factory=list)
    """(op, operand index) pairs; maintained by Graph."""
    priority: int | None = None
    """A pin's user priority (Shardy's ``p0``, ``p1``, ...): lower numbers propagate first and
    win conflicts; None counts as ``p0``, as in Shardy (``passes/propagate.py``)."""
    sharding_origin: str = ""
    """Why ``sharding`` is what it is: ``pin 'w'``, ``with_sharding_constraint at f.py:3``,
    ``propagated from %x through dot``; shown by ``shardplan plan --print-ir``."""

    @property
    def users(self) -> list[Op]:
        return list(dict.fromkeys(use.op for use in self.uses))

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


@dataclass(frozen=True, slots=True)
class Use:
    op: Op
    index: int


@dataclass(eq=False, slots=True)
class Op:
    """One operation: a canonical kind, operands, results and the factor rule that shards it."""

    kind: str
    operands: list[Value]
    results: list[Value]
    rule: ShardingRule
    attrs: dict[str, AttrValue] = field(default_factory=dict)
    origin: Origin = field(default_factory=Origin)

    @property
    def repeat(self) -> int:
        """How many times the op runs per step (attribute ``repeat``, default 1). A scan body
        is captured once and its ops run once per iteration: costs count ``repeat`` times."""
        return int(self.attrs.get("repeat", 1))  # type: ignore[arg-type]

    @property
    def result(self) -> Value:
        if len(self.results) != 1:
            raise IRVerifyError(f"op {self.kind} has {len(self.results)} results; use .results")
        return self.results[0]

    def __repr__(self) -> str:
        outs = ", ".join(f"%{r.name}" for r in self.results)
        ins = ", ".join(f"%{v.name}" for v in self.operands)
        return f"{outs} = {self.kind}({ins})"


@dataclass(eq=False, slots=True)
class Graph:
    """A function: typed inputs, ops in topological order, outputs.

    Invariants (checked by ``ir.verify``): every operand is an input or an earlier op's result,
    names are unique, rule arity and sizes match the types, shardings fit the mesh.
    ``output_aliases`` maps an output index to the input it replaces after the step (updated
    parameters and optimizer states), which lets the cost model price the layout round trip.
    """

    name: str = "main"
    mesh: Mesh | None = None
    inputs: list[Value] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)
    outputs: list[Value] = field(default_factory=list)
    output_aliases: dict[int, int] = field(default_factory=dict)
    _used: set[str] = field(default_factory=set, repr=False)
    _next_suffix: dict[str, int] = field(default_factory=dict, repr=False)

    # -- naming -----------------------------------------------------------------------------
    def fresh_name(self, hint: str = "") -> str:
        """A unique value name: the hint (``w``, then ``w_1``, ``w_2``...) or the next number."""
        base = "".join(c if c.isalnum() or c == "_" else "_" for c in hint)
        if base and base not in self._used:
            name = base
        else:
            count = self._next_suffix.get(base, -1 if not base else 0)
            while True:
                count += 1
                name = f"{base}_{count}" if base else str(count)
                if name not in self._used:
                    break
            self._next_suffix[base] = count
        self._used.add(name)
        return name

    # -- building ---------------------------------------------------------------------------
    def add_input(
        self,
        name: str,
        type_: TensorType,
        role: Role = Role.INPUT,
        origin: Origin | None = None,
        sharding: Sharding | None = None,
        pinned: bool = False,
    ) -> Value:
        value = Value(self.fresh_name(name), type_, role, origin or Origin(path=name))
        value.sharding, value.pinned = sharding, pinned
        self.inputs.append(value)
        return value

    def add_op(
        self,
        kind: str,
        operands: Sequence[Value],
        result_types: Sequence[TensorType],
        rule: ShardingRule | None = None,
        attrs: Mapping[str, AttrValue] | None = None,
        origin: Origin | None = None,
        names: Sequence[str] = (),
    ) -> Op:
        """Append an op; without ``rule`` the registry builds one (unknown kinds warn)."""
        attrs = dict(attrs or {})
        origin = origin or Origin()
        if rule is None:
            from .registry import rule_for

            rule = rule_for(kind, [v.type for v in operands], list(result_types), attrs, origin)
        op = Op(kind, list(operands), [], rule, attrs, origin)
        for i, type_ in enumerate(result_types):
            hint = names[i] if i < len(names) else ""
            op.results.append(Value(self.fresh_name(hint), type_, Role.ACTIVATION, origin, op))
        for i, value in enumerate(op.operands):
            value.uses.append(Use(op, i))
        self.ops.append(op)
        return op

    def set_outputs(
        self, values: Iterable[Value], aliases: Mapping[int, int] | None = None
    ) -> None:
        self.outputs = list(values)
        self.output_aliases = dict(aliases or {})

    # -- editing (the only way operands change) --------------------------------------------
    def set_operand(self, op: Op, index: int, value: Value) -> None:
        old = op.operands[index]
        old.uses.remove(Use(op, index))
        op.operands[index] = value
        value.uses.append(Use(op, index))

    def replace_all_uses_with(self, old: Value, new: Value) -> None:
        for use in list(old.uses):
            self.set_operand(use.op, use.index, new)
        self.outputs = [new if v is old else v for v in self.outputs]

    def erase(self, op: Op) -> None:
        """Remove an op whose results are unused (refuses otherwise, like torch.fx)."""
        for r in op.results:
            if r.uses or any(r is v for v in self.outputs):
                raise IRVerifyError(
                    f"cannot erase {op!r}: %{r.name} still has users; replace its uses first"
                )
        for i, value in enumerate(op.operands):
            value.uses.remove(Use(op, i))
        self.ops.remove(op)

    # -- queries ----------------------------------------------------------------------------
    def values(self) -> Iterator[Value]:
        yield from self.inputs
        for op in self.ops:
            yield from op.results

    def value(self, name: str) -> Value:
        for v in self.values():
            if v.name == name:
                return v
        raise KeyError(f"no value %{name} in graph @{self.name}")

    def __str__(self) -> str:
        from .printer import print_graph

        return print_graph(self)
