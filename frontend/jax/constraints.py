"""User sharding annotations in a jaxpr, read as planner pins.

``jax.lax.with_sharding_constraint`` (a ``NamedSharding``, or a bare ``PartitionSpec`` under
``jax.set_mesh``) and ``jax.sharding.reshard`` over Explicit mesh axes say which layout a value
must have (a reshard over Auto axes, as ``jnp`` inserts for scatter updates, says nothing). Capture
turns each into a pin on the constrained IR value; the PartitionSpec's mesh axis names are the
planner mesh's axis names (``plan.jit`` builds its jax mesh from them), so a constraint naming
an axis the planner mesh lacks is refused when planning (``check_pins``). A constraint with an
``UNCONSTRAINED`` dimension leaves that dimension open, which a pin (closed in every dimension)
cannot say: it is skipped with a warning rather than pinned wrongly.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...ir import FrontendError, Mesh, Pin, Sharding

CONSTRAINT_PARAMS = {"sharding_constraint": "sharding", "reshard": "dst_sharding"}
"""Primitive -> the parameter holding the sharding it asks for."""


class ConstraintWarning(UserWarning):
    """A user sharding annotation the planner could not take as a pin."""


@dataclass(frozen=True, slots=True)
class Constraint:
    """One user annotation: the pinned value's sharding and where the user wrote it."""

    sharding: Sharding
    source: str
    primitive: str


def constraint_of(eqn: Any, rank: int, source: str) -> Constraint | None:
    """The pin an annotation equation asks for, or None (not an annotation, or not a pin)."""
    param = CONSTRAINT_PARAMS.get(eqn.primitive.name)
    if param is None:
        return None
    where = f" at {source}" if source else ""
    sharding = eqn.params.get(param)
    if eqn.primitive.name == "reshard" and not _explicit(sharding):
        return None  # jnp inserts reshards over Auto axes (scatter updates): no user layout
    spec = getattr(sharding, "spec", None)
    if spec is None:
        warnings.warn(
            f"{eqn.primitive.name}{where} uses {type(eqn.params.get(param)).__name__}, not a "
            "NamedSharding/PartitionSpec: not taken as a pin (use a NamedSharding)",
            ConstraintWarning,
            stacklevel=2,
        )
        return None
    entries = list(spec) + [None] * (rank - len(spec))
    open_dims = set(eqn.params.get("unconstrained_dims") or ())
    dims: list[tuple[str, ...]] = []
    for d, entry in enumerate(entries):
        if d in open_dims or _is_unconstrained(entry):
            warnings.warn(
                f"{eqn.primitive.name}{where} leaves dimension {d} UNCONSTRAINED; a pin closes "
                "every dimension, so this constraint is not pinned (give every dimension)",
                ConstraintWarning,
                stacklevel=2,
            )
            return None
        dims.append(() if entry is None else (entry,) if isinstance(entry, str) else tuple(entry))
    return Constraint(Sharding(tuple(dims)), source, eqn.primitive.name)


def _explicit(sharding: Any) -> bool:
    """A reshard fixes a layout only over Explicit mesh axes (sharding in types)."""
    from jax.sharding import AxisType

    types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
    return bool(types) and all(t == AxisType.Explicit for t in types)


def _is_unconstrained(entry: Any) -> bool:
    from jax.sharding import PartitionSpec

    return entry is PartitionSpec.UNCONSTRAINED


def check_pins(constraints: Mapping[str, Constraint], mesh: Mesh) -> None:
    """Refuse a constraint that names an axis the planner mesh lacks, saying where it is."""
    for name, c in constraints.items():
        missing = sorted(c.sharding.used_axes - set(mesh.axis_names))
        if missing:
            where = f" at {c.source}" if c.source else ""
            raise FrontendError(
                f"{c.primitive}{where} (on %{name}) names mesh axis {missing[0]!r}, but the "
                f"planner mesh {mesh} has axes {list(mesh.axis_names)}\n  hint: give the "
                "planner mesh the axis names your jax mesh uses"
            )


def pin_table(constraints: Mapping[str, Constraint]) -> dict[str, Pin]:
    """Value name -> pin (what ``plan_graph(pins=...)`` takes), saying which annotation and
    where (``shardplan plan --print-ir`` prints it)."""
    return {name: Pin(c.sharding, source=_described(c)) for name, c in constraints.items()}


def _described(constraint: Constraint) -> str:
    name = {"sharding_constraint": "with_sharding_constraint"}.get(
        constraint.primitive, constraint.primitive
    )
    return f"{name} at {constraint.source}" if constraint.source else name
