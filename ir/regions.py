"""The sharding rule of a ``shard_map`` region: an opaque body run per shard at its declared
in/out specs (issue 17).

A region op carries its specs as attributes, in the compact text ``dp,tp|_,tp`` (one tensor
per ``|``, one dim per ``,``, ``_`` unsharded, ``+`` between axes of one dim) and the mesh
axis sizes as ``dp=2,tp=4``. Its rule gives every mesh axis the specs name one factor of that
axis's size, shared by every operand and result dim the axis splits (a dim split by ``dp+tp``
is the compound ``(dp tp rest)``); all other factors need replication. So the one way to shard
the op is the declared one; capture also pins the operands and results to the specs, and the
planner prices the edges into and out of the region. A spec axis only operands use is a
reduction factor: the body reduces over it (a ``psum``), which the planner prices as the
all-reduce of the region's result from a pending sum to the declared out spec; collectives
inside the body are priced only so (docs/design.md).

The body's cost is ``attrs["flops"]``: its FLOPs on one shard times the region's shards, so
that the cost model's division by the strategy's split gives one device's work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .errors import IRVerifyError
from .registry import register_rule
from .rule_helpers import Attrs, Types
from .rules import FACTOR_LETTERS, ShardingRule

Spec = tuple[tuple[str, ...], ...]
"""Per dim of one tensor, the mesh axes splitting it."""


def specs_text(specs: Sequence[Spec]) -> str:
    return "|".join(",".join("+".join(d) or "_" for d in spec) for spec in specs)


def parse_specs(text: str, count: int) -> list[Spec]:
    """Inverse of ``specs_text``: ``count`` tensors (an empty text is one rank-0 tensor)."""
    parts = text.split("|") if count else []
    if len(parts) != count:
        raise IRVerifyError(f"shard_map specs {text!r} name {len(parts)} tensors, not {count}")
    return [
        tuple(() if d in ("", "_") else tuple(d.split("+")) for d in p.split(",")) if p else ()
        for p in parts
    ]


def mesh_text(sizes: Mapping[str, int]) -> str:
    return ",".join(f"{a}={n}" for a, n in sizes.items())


def _mesh(text: str) -> dict[str, int]:
    return {a: int(n) for a, n in (item.split("=") for item in text.split(",") if item)}


def region_rule(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    """One factor per spec axis (shared across the region's tensors); the rest replicated."""
    specs = parse_specs(str(attrs["in_specs"]), len(ins))
    specs += parse_specs(str(attrs["out_specs"]), len(outs))
    sizes = _mesh(str(attrs["mesh_axes"]))
    names = iter(FACTOR_LETTERS)
    axis_factor: dict[str, str] = {}
    factor_sizes: dict[str, int] = {}
    replicated: set[str] = set()
    tensors = []
    for t, spec in zip([*ins, *outs], specs, strict=True):
        if len(spec) != t.rank:
            raise IRVerifyError(f"shard_map spec {specs_text([spec])} does not fit {t}")
        dims = []
        for size, axes in zip(t.shape, spec, strict=True):
            dim = []
            for axis in axes:
                if axis not in axis_factor:
                    axis_factor[axis] = next(names)
                    factor_sizes[axis_factor[axis]] = sizes[axis]
                dim.append(axis_factor[axis])
            split = 1
            for axis in axes:
                split *= sizes[axis]
            if size % split:
                raise IRVerifyError(f"shard_map spec {specs_text([spec])} does not divide {t}")
            if size // split > 1 or not axes:
                rest = next(names)
                factor_sizes[rest] = size // split
                replicated.add(rest)
                dim.append(rest)
            dims.append(tuple(dim))
        tensors.append(tuple(dims))
    return ShardingRule(
        tuple(tensors[: len(ins)]), tuple(tensors[len(ins) :]),
        tuple(factor_sizes.items()), frozenset(replicated),
    )  # fmt: skip


register_rule("shard_map", region_rule, flops="attr")
