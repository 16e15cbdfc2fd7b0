"""Agreement of shardplan's propagation with Shardy's, on the same seeds (issue 17).

For a JAX function, some inputs get a fixed sharding (the *seeds*) and the rest stay open.
Shardy's answer: ``jax.jit(fn).lower(*args).compile()`` with the seeds as the
``ShapeDtypeStruct`` shardings and open inputs unspecified; XLA's Shardy propagation then
chooses the open inputs' and the outputs' shardings, read back from ``compiled.input_shardings``
and ``output_shardings``. shardplan's answer: capture, pin the seeds (and the function's own
``with_sharding_constraint``s), run the ``propagate`` pass, read the same tensors; an
undecided tensor reads as replicated, an output's pending sum as reduced and a sub-axis
(``"tp":(1)2``) as dropped from its dim (``emit.partition_spec``), as at a jit boundary.
Two answers agree when they lay the tensor out the same (``is_equivalent_to``).

A case may give seeds Shardy's user priorities (``p0``, ``p1``, ...). jax has no public way
to write them, so the lowered module's argument shardings get the priority suffix before XLA
compiles it (``_compile_with_priorities``); shardplan pins the same seeds with ``Pin(priority)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from ...ir import Mesh, Pin, Sharding
from ...passes.annotate import annotate
from ...passes.propagate import propagate
from .capture import capture
from .emit import partition_spec

FAST_BACKEND = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
"""Shardy and the SPMD partitioner run before the CPU backend; skipping its optimisations halves
the harness's compile time and leaves the shardings read back unchanged (checked on 40 cases)."""


@dataclass(frozen=True, slots=True)
class Case:
    """One function, its argument shapes, and which arguments are seeded with which spec."""

    name: str
    fn: Callable[..., Any]
    shapes: tuple[tuple[int, ...], ...]
    seeds: Mapping[int, PartitionSpec]
    mesh: tuple[tuple[str, int], ...] = (("dp", 2), ("tp", 4))
    priorities: Mapping[int, int] = field(default_factory=dict)
    """Seed argument index -> Shardy user priority (``0`` is ``p0``); unlisted seeds have none."""


@dataclass(frozen=True, slots=True)
class Tensor:
    """One inferred tensor (an open input or an output) and both answers."""

    case: str
    tensor: str
    shardy: str
    shardplan: str
    agree: bool


def _jax_mesh(axes: Sequence[tuple[str, int]]) -> jax.sharding.Mesh:
    names = tuple(n for n, _ in axes)
    shape = tuple(s for _, s in axes)
    devices = jax.devices()[: math.prod(shape)]
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=devices)


def _args(case: Case, mesh: jax.sharding.Mesh) -> list[jax.ShapeDtypeStruct]:
    out = []
    for i, shape in enumerate(case.shapes):
        spec = case.seeds.get(i)
        sharding = NamedSharding(mesh, spec) if spec is not None else None
        out.append(jax.ShapeDtypeStruct(shape, jax.numpy.float32, sharding=sharding))
    return out


def _spec(sharding: Any) -> str:
    spec = getattr(sharding, "spec", None)
    return str(spec) if spec is not None else str(sharding)


def shardy(case: Case) -> tuple[list[Any], list[Any]]:
    """Shardy's input and output shardings (per leaf) for the case."""
    compiled = compile_case(case)
    ins, _ = compiled.input_shardings
    return list(ins), list(jax.tree.leaves(compiled.output_shardings))


def compile_case(case: Case) -> Any:
    """The case compiled by XLA (Shardy, then the SPMD partitioner) with its seeds."""
    mesh = _jax_mesh(case.mesh)
    with jax.set_mesh(mesh):  # bare PartitionSpecs in constraints name this mesh's axes
        lowered = jax.jit(case.fn).lower(*_args(case, mesh))
        if case.priorities:
            return _compile_with_priorities(lowered, case.priorities)
        return lowered.compile(compiler_options=FAST_BACKEND)


def _compile_with_priorities(lowered: Any, priorities: Mapping[int, int]) -> Any:
    """Compile ``lowered`` with ``pN`` on every sharded dim of the given arguments.

    jax writes no user priorities, so this edits a copy of the lowered StableHLO's
    ``sdy.sharding`` argument attributes and compiles it in place of the original: it uses
    jax's private ``Lowered._lowering._hlo`` (restored after; the lowering is shared by jax's
    cache) and the MLIR bindings jaxlib ships; ``compile(compiler_options=...)`` skips the
    executable cached on the lowering.
    """
    from jaxlib.mlir import ir

    lowering = lowered._lowering  # private: the only way to compile an edited module
    original = lowering._hlo
    module = ir.Module.parse(str(original), context=original.context)
    with module.context:
        (main,) = [
            op
            for op in module.body.operations
            if op.operation.name == "func.func"
            and ir.StringAttr(op.attributes["sym_name"]).value == "main"
        ]
        attrs = []
        for i, entry in enumerate(ir.ArrayAttr(main.attributes["arg_attrs"])):
            items = {a.name: a.attr for a in ir.DictAttr(entry)}
            if i in priorities and "sdy.sharding" in items:
                text = str(items["sdy.sharding"]).replace('"}', f'"}}p{priorities[i]}')
                items["sdy.sharding"] = ir.Attribute.parse(text)
            attrs.append(ir.DictAttr.get(items))
        main.attributes["arg_attrs"] = ir.ArrayAttr.get(attrs)
    lowering._hlo = module
    try:
        return lowered.compile(compiler_options=FAST_BACKEND)
    finally:
        lowering._hlo = original


def shardplan(case: Case) -> tuple[list[Sharding], list[Sharding]]:
    """shardplan's propagated input and output shardings for the case."""
    graph, context = propagated(case)

    def read(name: str) -> Sharding:
        value = graph.value(name)
        if value.sharding is None:
            return Sharding.replicated(value.type.rank)
        return value.sharding.without_partial()

    return [read(n) for n in context.arg_inputs], [read(n) for n in context.outputs]


def propagated(case: Case) -> tuple[Any, Any]:
    """The case's captured graph after ``annotate`` and ``propagate``, and its capture context
    (every value's sharding, intermediates included: the sub-axis cases check theirs)."""
    mesh = _jax_mesh(case.mesh)
    with jax.set_mesh(mesh):
        graph, context = capture(case.fn, *_args(case, mesh))
    graph.mesh = Mesh(dict(case.mesh), cluster="cpu-test")
    pins: dict[str, Sharding | Pin] = {
        context.arg_inputs[i]: Pin(_sharding(spec, len(case.shapes[i])), case.priorities.get(i))
        for i, spec in case.seeds.items()
    }
    pins.update(context.user_pins(graph.mesh))
    annotate(graph, pins)
    propagate(graph)
    return graph, context


def _sharding(spec: PartitionSpec, rank: int) -> Sharding:
    entries = list(spec) + [None] * (rank - len(spec))
    return Sharding.of(*entries)


def compare(case: Case) -> list[Tensor]:
    """Every open input and every output of the case, with both answers."""
    mesh = _jax_mesh(case.mesh)
    sdy_in, sdy_out = shardy(case)
    sp_in, sp_out = shardplan(case)
    rows = []
    tensors = [
        (f"in{i}", s, p, len(case.shapes[i]))
        for i, (s, p) in enumerate(zip(sdy_in, sp_in, strict=True))
        if i not in case.seeds
    ]
    tensors += [
        (f"out{j}", s, p, p.rank) for j, (s, p) in enumerate(zip(sdy_out, sp_out, strict=True))
    ]
    for name, theirs, ours, rank in tensors:
        mine = NamedSharding(mesh, partition_spec(ours))
        rows.append(
            Tensor(
                case.name,
                name,
                _spec(theirs),
                str(partition_spec(ours)),
                theirs.is_equivalent_to(mine, rank),
            )
        )
    return rows
