"""``shard_map`` regions in a jaxpr, captured as one opaque op at the declared specs (issue 17).

The body is not walked: it is per-shard code (collectives over manual axes, local shapes) the
planner must not re-shard. Capture emits one ``shard_map`` op (rule: ``ir/regions.py``) whose
operands and results are pinned to the region's ``in_specs``/``out_specs``, and whose cost is
the body's FLOPs on one shard. ``plan.jit`` binds the region as written, between the planned
layouts of its operands and results.
"""

from __future__ import annotations

import math
from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr

from ...ir import Sharding
from ...ir.regions import Spec, mesh_text, specs_text

NO_FLOPS = frozenset(
    {"psum", "psum_invariant", "pmax", "pmin", "all_gather", "all_gather_invariant",
     "all_to_all", "ppermute", "pvary", "psum_scatter",
     "reduce_scatter", "axis_index", "pbroadcast", "convert_element_type", "reshape",
     "broadcast_in_dim", "squeeze", "transpose", "copy", "copy_p"}
)  # fmt: skip
"""Equations counted as moving data, not computing (their cost is communication or a view)."""


def spec_dims(spec: Any, rank: int) -> Spec:
    """A PartitionSpec as per-dim axis tuples, padded to ``rank``."""
    entries = list(spec) + [None] * (rank - len(spec))
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)


def region_attrs(eqn: Any, in_ranks: list[int], out_ranks: list[int]) -> dict[str, Any]:
    """The ``shard_map`` op's attributes: specs, mesh axis sizes, per-device FLOPs x shards."""
    p = eqn.params
    ins = [spec_dims(s, r) for s, r in zip(p["in_specs"], in_ranks, strict=True)]
    outs = [spec_dims(s, r) for s, r in zip(p["out_specs"], out_ranks, strict=True)]
    sizes = dict(p["mesh"].shape)
    used = {a for spec in (*ins, *outs) for dim in spec for a in dim}
    shards = math.prod(sizes[a] for a in used)
    return {
        "in_specs": specs_text(ins),
        "out_specs": specs_text(outs),
        "mesh_axes": mesh_text({a: n for a, n in sizes.items() if a in used}),
        "flops": float(body_flops(p["jaxpr"]) * shards),
    }


def pins_of(attrs: dict[str, Any], in_ranks: list[int], out_ranks: list[int]) -> list[Sharding]:
    """The operands' then the results' pinned shardings (the declared specs)."""
    from ...ir.regions import parse_specs

    specs = parse_specs(attrs["in_specs"], len(in_ranks))
    specs += parse_specs(attrs["out_specs"], len(out_ranks))
    return [Sharding(spec) for spec in specs]


def body_flops(jaxpr: Any) -> float:
    """FLOPs of one shard's body: ``2*m*n*k`` per dot, one per result element for the rest,
    none for collectives and views; nested jaxprs counted (a scan's ``length`` times)."""
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    total = 0.0
    for eqn in jaxpr.eqns:
        inner = [v for v in eqn.params.values() if isinstance(v, Jaxpr | ClosedJaxpr)]
        if inner:
            times = int(eqn.params.get("length", 1))
            total += times * sum(body_flops(j) for j in inner)
        elif eqn.primitive.name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out = eqn.outvars[0].aval.shape
            total += 2.0 * math.prod(out) * math.prod(lhs[d] for d in lc)
        elif eqn.primitive.name not in NO_FLOPS:
            total += sum(math.prod(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
    return total
