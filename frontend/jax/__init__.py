"""JAX frontend: jaxpr capture to the IR (``capture``) and NamedSharding/jit emission (``emit``).

Kept import-light: jax loads only when a function here is called or a submodule is imported.
The emitters are these functions (``Plan.jit`` and the others call them through
``solver.plan``'s registry); ``jax_mesh`` defaults to ``make_jax_mesh(plan)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...ir import Mesh
from ...solver.plan import Plan
from ..lazy import load

__all__ = ["in_shardings", "jit", "make_jax_mesh", "out_shardings", "to_partition_specs"]


def _emit(name: str) -> Callable[..., Any]:
    """``emit.<name>`` (importing jax the first time)."""
    return load(f"{__name__}.emit", "jax", name)


def jit(plan: Plan, fn: Callable[..., Any] | None = None, jax_mesh: Any = None) -> Any:
    """``jax.jit`` of ``fn`` (default: the planned function) with the planned in/out shardings
    and every planned intermediate layout, on ``jax_mesh`` (``emit.jit``)."""
    return _emit("jit")(plan, fn, jax_mesh)


def in_shardings(plan: Plan, jax_mesh: Any = None) -> Any:
    """Pytree of NamedSharding matching the example arguments."""
    return _emit("in_shardings")(plan, jax_mesh)


def out_shardings(plan: Plan, jax_mesh: Any = None) -> Any:
    """Pytree of NamedSharding matching the function's outputs."""
    return _emit("out_shardings")(plan, jax_mesh)


def to_partition_specs(plan: Plan) -> Any:
    """Tuple (one entry per positional argument) of PartitionSpec pytrees."""
    return _emit("to_partition_specs")(plan)


def make_jax_mesh(plan_or_mesh: Plan | Mesh) -> Any:
    """A ``jax.sharding.Mesh`` of the first devices with the plan's axis names and sizes."""
    return _emit("make_jax_mesh")(plan_or_mesh)
