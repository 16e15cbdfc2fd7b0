"""Lowering of single jaxpr equations to IR ops: the primitive -> canonical kind table.

Each lowering gets the IR operand values and returns the IR values of the equation's results.
Most primitives are one op; embedding gathers/scatters become ``reshape`` + ``embedding``.
Unknown primitives become an op of the primitive's own name, which the registry rules replicated
and warns about (``UnsupportedOpWarning``), so planning never crashes on them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...ir import Graph, Origin, TensorType, Value, op_info, register_rule
from ...ir.shape_rules import elementwise, reduce, rowwise
from .conv import WINDOW_PRIMITIVES, lower_conv, lower_window
from .rules import gather_rule, reverse_rule, scatter_add_rule

_DTYPES = {
    "float64": "f64", "float32": "f32", "bfloat16": "bf16", "float16": "f16",
    "float8_e4m3fn": "f8e4m3", "float8_e5m2": "f8e5m2", "int64": "i64", "int32": "i32",
    "int16": "i16", "int8": "i8", "uint64": "u64", "uint32": "u32", "uint16": "u16",
    "uint8": "u8", "bool": "bool", "complex64": "c64", "complex128": "c128", "float0": "bool",
}  # fmt: skip

# jax primitive name -> canonical elementwise kind (ir/registry.py names).
ELEMENTWISE_KINDS = {
    "add": "add", "add_any": "add", "sub": "sub", "neg": "neg", "mul": "mul", "div": "div",
    "max": "max", "min": "min", "pow": "pow", "integer_pow": "integer_pow", "exp": "exp",
    "log": "log", "tanh": "tanh", "logistic": "logistic", "rsqrt": "rsqrt", "sqrt": "sqrt",
    "erf": "erf", "abs": "abs", "sign": "sign", "floor": "floor", "ceil": "ceil",
    "round": "round", "select_n": "select", "eq": "eq", "ne": "ne", "lt": "lt", "le": "le",
    "gt": "gt", "ge": "ge", "and": "and", "or": "or", "not": "not", "xor": "xor",
    "square": "square", "expm1": "expm1", "log1p": "log1p", "sin": "sin", "cos": "cos",
    "clamp": "clamp", "is_finite": "isfinite", "rem": "rem", "stop_gradient": "stop_gradient",
    "convert_element_type": "convert", "copy": "copy", "copy_p": "copy",
    "exp2": "exp2", "erf_inv": "erf_inv", "tan": "tan", "atan2": "atan2", "cbrt": "cbrt",
    "reduce_precision": "reduce_precision", "nextafter": "nextafter", "sinh": "sinh",
    "cosh": "cosh", "asin": "asin", "acos": "acos", "atan": "atan", "asinh": "asinh",
    "acosh": "acosh", "atanh": "atanh", "imag": "imag", "real": "real", "conj": "conj",
    "shift_left": "shift_left", "shift_right_logical": "shift_right_logical",
    "shift_right_arithmetic": "shift_right_arithmetic", "population_count": "population_count",
}  # fmt: skip

REDUCE_KINDS = {
    "reduce_sum": "reduce_sum", "reduce_max": "reduce_max", "reduce_min": "reduce_min",
    "reduce_prod": "reduce_prod", "reduce_and": "reduce_and", "reduce_or": "reduce_or",
    "reduce_xor": "reduce_xor", "argmax": "argmax", "argmin": "argmin",
}  # fmt: skip

CUMULATIVE_KINDS = {"cumsum": "cumsum", "cumprod": "cumprod", "cummax": "cummax",
                    "cummin": "cummin", "cumlogsumexp": "cumlogsumexp"}  # fmt: skip

# Kinds the core registry does not have: registered here (frontend-owned, see ir/registry.py).
for _kind in sorted(set(ELEMENTWISE_KINDS.values())):
    if op_info(_kind) is None:
        register_rule(_kind, elementwise)
for _kind in ("reduce_prod", "reduce_and", "reduce_or", "reduce_xor"):
    if op_info(_kind) is None:
        register_rule(_kind, reduce)
for _kind in ("cumprod", "cummax", "cummin", "cumlogsumexp"):
    if op_info(_kind) is None:
        register_rule(_kind, rowwise)
register_rule("xla_gather", gather_rule, flops="none")
register_rule("xla_scatter_add", scatter_add_rule)
register_rule("reverse", reverse_rule, flops="none", linear=True)


def ir_type(aval: Any) -> TensorType:
    """IR type of a jax abstract value; extended dtypes (PRNG keys) count as their raw bytes."""
    name = str(getattr(aval.dtype, "name", aval.dtype))
    if name in _DTYPES:
        return TensorType(tuple(aval.shape), _DTYPES[name])
    itemsize = int(getattr(aval.dtype, "itemsize", 4) or 4)
    return TensorType(tuple(aval.shape), {1: "u8", 2: "u16", 8: "u64"}.get(itemsize, "u32"))


class Emitter:
    """Appends IR ops for one equation; ``origin`` is the equation's provenance."""

    def __init__(self, graph: Graph, origin: Origin) -> None:
        self.graph = graph
        self.origin = origin
        self.first_op: int | None = None

    def op(
        self, kind: str, operands: Sequence[Value], types: Sequence[TensorType], **attrs: Any
    ) -> list[Value]:
        if self.first_op is None:
            self.first_op = len(self.graph.ops)
        op = self.graph.add_op(kind, operands, types, attrs=attrs, origin=self.origin)
        return op.results

    def one(self, kind: str, operands: Sequence[Value], type_: TensorType, **attrs: Any) -> Value:
        return self.op(kind, operands, [type_], **attrs)[0]


Lowering = Callable[[Emitter, Any, list[Value]], list[Value]]


def _out_types(eqn: Any) -> list[TensorType]:
    return [ir_type(v.aval) for v in eqn.outvars]


def _ints(values: Sequence[Any] | None) -> tuple[int, ...]:
    return tuple(int(v) for v in (values or ()))


def lower_elementwise(em: Emitter, eqn: Any, ins: list[Value]) -> list[Value]:
    attrs = {"y": int(eqn.params["y"])} if "y" in eqn.params else {}
    return em.op(ELEMENTWISE_KINDS[eqn.primitive.name], ins, _out_types(eqn), **attrs)


def lower_reduce(em: Emitter, eqn: Any, ins: list[Value]) -> list[Value]:
    return em.op(
        REDUCE_KINDS[eqn.primitive.name], ins, _out_types(eqn), axes=_ints(eqn.params["axes"])
    )


def lower_cumulative(em: Emitter, eqn: Any, ins: list[Value]) -> list[Value]:
    axis = int(eqn.params["axis"])
    return em.op(CUMULATIVE_KINDS[eqn.primitive.name], ins, _out_types(eqn), axis=axis)


def lower_dot_general(em: Emitter, eqn: Any, ins: list[Value]) -> list[Value]:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    return em.op(
        "dot_general", ins, _out_types(eqn),
        lhs_contracting=_ints(lc), rhs_contracting=_ints(rc),
        lhs_batch=_ints(lb), rhs_batch=_ints(rb),
    )  # fmt: skip


def lower_broadcast_in_dim(em: Emitter, eqn: Any, ins: list[Value]) -> list[Value]:
    dims = _ints(eqn.params["broadcast_dimensions"])
    return em.op("broadcast_in_dim", ins, _out_types(eqn), dims=dims)


def lower_reshape(em: Emitter, eqn: Any, ins: list[Value]) -> list[Value]:
    """reshape, squeeze and expand_dims are all row-major reshapes."""
    if eqn.primitive.name == "reshape" and eqn.params.get("dimensions"):  # a folded transpose
        raise NotImplementedError("reshape with dimensions")
    return em.op("reshape", ins[:1], _out_types(eqn))


def lower_transpose(em: Emitter, eqn: Any, ins: list[Value]) -> list[Value]:
    return em.op("transpose", ins, _out_types(eqn), perm=_ints(eqn.params["permutation"]))


def lower_rev(em: Emitter, eqn: Any, ins: list[Value]) -> list[Value]:
    return em.op("reverse", ins, _out_types(eqn), dims=_ints(eqn.params["dimensions"]))


def lower_iota(em: Emitter, eqn: Any, ins: list[Value]) -> list[Value]:
    return em.op("iota", [], _out_types(eqn), dimension=int(eqn.params["dimension"]))


def lower_concatenate(em: Emitter, eqn: Any, ins: list[Value]) -> list[Value]:
    return em.op("concat", ins, _out_types(eqn), dimension=int(eqn.params["dimension"]))


def lower_slice(em: Emitter, eqn: Any, ins: list[Value]) -> list[Value]:
    p = eqn.params
    attrs = {"start": _ints(p["start_indices"]), "limit": _ints(p["limit_indices"])}
    if p.get("strides"):
        attrs["strides"] = _ints(p["strides"])
    return em.op("slice", ins, _out_types(eqn), **attrs)


def lower_dynamic_slice(em: Emitter, eqn: Any, ins: list[Value]) -> list[Value]:
    return em.op("dynamic_slice", ins, _out_types(eqn), sizes=_ints(eqn.params["slice_sizes"]))


def lower_dynamic_update_slice(em: Emitter, eqn: Any, ins: list[Value]) -> list[Value]:
    return em.op("dynamic_update_slice", ins, _out_types(eqn))


def lower_pad(em: Emitter, eqn: Any, ins: list[Value]) -> list[Value]:
    low, high, interior = zip(*eqn.params["padding_config"], strict=True)
    return em.op(
        "pad", ins, _out_types(eqn), low=_ints(low), high=_ints(high), interior=_ints(interior)
    )


def lower_split(em: Emitter, eqn: Any, ins: list[Value]) -> list[Value]:
    """``split`` is one slice per piece."""
    axis, start, outs = int(eqn.params["axis"]), 0, []
    for t in _out_types(eqn):
        begin = [0] * t.rank
        begin[axis] = start
        limit = list(t.shape)
        limit[axis] = start + t.shape[axis]
        outs.append(em.one("slice", ins, t, start=tuple(begin), limit=tuple(limit)))
        start += t.shape[axis]
    return outs


def lower_sort(em: Emitter, eqn: Any, ins: list[Value]) -> list[Value]:
    return em.op("sort", ins, _out_types(eqn), axis=int(eqn.params["dimension"]))


def lower_top_k(em: Emitter, eqn: Any, ins: list[Value]) -> list[Value]:
    axis = int(eqn.params.get("axis", ins[0].type.rank - 1))
    return em.op("topk", ins, _out_types(eqn), axis=axis)


def _squeeze_index_vector(em: Emitter, indices: Value) -> Value:
    """``[..., 1]`` index arrays become ``[...]`` token ids (a reshape op)."""
    shape = indices.type.shape[:-1]
    return em.one("reshape", [indices], TensorType(shape, indices.type.dtype))


def _gather_attrs(eqn: Any) -> dict[str, tuple[int, ...]]:
    dn = eqn.params["dimension_numbers"]
    return {
        "offset_dims": _ints(dn.offset_dims),
        "collapsed_slice_dims": _ints(dn.collapsed_slice_dims),
        "start_index_map": _ints(dn.start_index_map),
        "operand_batching_dims": _ints(dn.operand_batching_dims),
        "start_indices_batching_dims": _ints(dn.start_indices_batching_dims),
        "slice_sizes": _ints(eqn.params["slice_sizes"]),
    }  # fmt: skip


def lower_gather(em: Emitter, eqn: Any, ins: list[Value]) -> list[Value]:
    """Row lookups ``table[ids]`` are ``embedding``; other gathers get a rule from their dims."""
    attrs = _gather_attrs(eqn)
    table, indices = ins
    (out,) = _out_types(eqn)
    is_embedding = (
        table.type.rank == 2 and indices.type.shape[-1:] == (1,)
        and attrs["collapsed_slice_dims"] == (0,) and attrs["start_index_map"] == (0,)
        and not attrs["operand_batching_dims"]
        and attrs["slice_sizes"] == (1, table.type.shape[1])
        and attrs["offset_dims"] == (indices.type.rank - 1,)
    )  # fmt: skip
    if is_embedding:
        return [em.one("embedding", [table, _squeeze_index_vector(em, indices)], out)]
    return [em.one("xla_gather", ins, out, **attrs)]


def _scatter_attrs(eqn: Any) -> dict[str, tuple[int, ...]]:
    dn = eqn.params["dimension_numbers"]
    return {
        "update_window_dims": _ints(dn.update_window_dims),
        "inserted_window_dims": _ints(dn.inserted_window_dims),
        "scatter_dims_to_operand_dims": _ints(dn.scatter_dims_to_operand_dims),
        "operand_batching_dims": _ints(dn.operand_batching_dims),
        "scatter_indices_batching_dims": _ints(dn.scatter_indices_batching_dims),
    }


def lower_scatter_add(em: Emitter, eqn: Any, ins: list[Value]) -> list[Value]:
    """Embedding gradients (rows added at ids) are ``embedding_backward`` + ``add``."""
    attrs = _scatter_attrs(eqn)
    operand, indices, updates = ins
    (out,) = _out_types(eqn)
    is_embedding = (
        operand.type.rank == 2 and indices.type.shape[-1:] == (1,)
        and attrs["inserted_window_dims"] == (0,) and attrs["scatter_dims_to_operand_dims"] == (0,)
        and not attrs["operand_batching_dims"]
        and attrs["update_window_dims"] == (updates.type.rank - 1,)
        and updates.type.shape[-1] == operand.type.shape[1]
    )  # fmt: skip
    if not is_embedding:
        return [em.one("xla_scatter_add", ins, out, **attrs)]
    ids = _squeeze_index_vector(em, indices)
    rows = em.one("embedding_backward", [updates, ids], out)
    # The base (usually zeros) stays an operand, so the plan gives it the result's layout.
    return [em.one("add", [operand, rows], out)]


LOWERINGS: dict[str, Lowering] = {
    **dict.fromkeys(ELEMENTWISE_KINDS, lower_elementwise),
    **dict.fromkeys(REDUCE_KINDS, lower_reduce),
    **dict.fromkeys(CUMULATIVE_KINDS, lower_cumulative),
    "dot_general": lower_dot_general, "broadcast_in_dim": lower_broadcast_in_dim,
    "reshape": lower_reshape, "squeeze": lower_reshape, "expand_dims": lower_reshape,
    "transpose": lower_transpose, "rev": lower_rev, "iota": lower_iota,
    "concatenate": lower_concatenate, "slice": lower_slice, "dynamic_slice": lower_dynamic_slice,
    "dynamic_update_slice": lower_dynamic_update_slice, "pad": lower_pad, "split": lower_split,
    "sort": lower_sort, "top_k": lower_top_k, "gather": lower_gather,
    "scatter-add": lower_scatter_add, "scatter_add": lower_scatter_add,
    "conv_general_dilated": lower_conv, **dict.fromkeys(WINDOW_PRIMITIVES, lower_window),
}  # fmt: skip


def lower_unknown(em: Emitter, eqn: Any, ins: list[Value]) -> list[Value]:
    """No rule: an op named after the primitive; the registry warns and replicates it."""
    return em.op(eqn.primitive.name, ins, _out_types(eqn))


def lower_equation(em: Emitter, eqn: Any, ins: list[Value]) -> list[Value]:
    lowering = LOWERINGS.get(eqn.primitive.name, lower_unknown)
    try:
        return lowering(em, eqn, ins)
    except NotImplementedError:
        return lower_unknown(em, eqn, ins)


def literal_attrs(value: Any) -> dict[str, float | int | bool]:
    """A scalar literal's value as an op attribute (arrays keep only their shape)."""
    array = np.asarray(value)
    if array.ndim or array.dtype.kind not in "biuf":
        return {}
    item = array.item()
    return {"value": item if isinstance(item, bool | int) else float(item)}
