"""Agreement of shardplan's propagation with Shardy's, on the same seeds (issue 17).

For a JAX function, some inputs get a fixed sharding (the *seeds*) and the rest stay open.
Shardy's answer: ``jax.jit(fn).lower(*args).compile()`` with the seeds as the
``ShapeDtypeStruct`` shardings and open inputs unspecified; XLA's Shardy propagation then
chooses the open inputs' and the outputs' shardings, read back from ``compiled.input_shardings``
and ``output_shardings``. shardplan's answer: capture, pin the seeds (and the function's own
``with_sharding_constraint``s), run the ``propagate`` pass, read the same tensors; an
undecided tensor reads as replicated and an output's pending sum as reduced, as at a jit
boundary. Two answers agree when they lay the tensor out the same (``is_equivalent_to``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from ...ir import Mesh, Sharding
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
    mesh = _jax_mesh(case.mesh)
    with jax.set_mesh(mesh):  # bare PartitionSpecs in constraints name this mesh's axes
        lowered = jax.jit(case.fn).lower(*_args(case, mesh))
        compiled = lowered.compile(compiler_options=FAST_BACKEND)
    ins, _ = compiled.input_shardings
    return list(ins), list(jax.tree.leaves(compiled.output_shardings))


def shardplan(case: Case) -> tuple[list[Sharding], list[Sharding]]:
    """shardplan's propagated input and output shardings for the case."""
    mesh = _jax_mesh(case.mesh)
    with jax.set_mesh(mesh):
        graph, context = capture(case.fn, *_args(case, mesh))
    graph.mesh = Mesh(dict(case.mesh), cluster="cpu-test")
    pins = {
        context.arg_inputs[i]: _sharding(spec, len(case.shapes[i]))
        for i, spec in case.seeds.items()
    }
    pins.update(context.user_pins(graph.mesh))
    annotate(graph, pins)
    propagate(graph)

    def read(name: str) -> Sharding:
        value = graph.value(name)
        if value.sharding is None:
            return Sharding.replicated(value.type.rank)
        return value.sharding.without_partial()

    return [read(n) for n in context.arg_inputs], [read(n) for n in context.outputs]


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
