"""Lowering of JAX's convolution and window primitives (CNNs, issue 36).

* ``conv_general_dilated`` -> one IR ``convolution`` op (XLA ConvGeneralDilated semantics, the
  IR contract): ``lhs_dims`` / ``rhs_dims`` / ``out_dims`` are the dimension numbers (batch,
  feature, spatial...), ``strides``, ``padding``, ``lhs_dilation``, ``rhs_dilation``,
  ``feature_group_count``, ``batch_group_count``. The backward convs JAX's autodiff emits are
  the same op with other dimension numbers: the input gradient dilates the lhs (transposed
  conv, kernel ``rev``-ed), the weight gradient contracts the batch dim (its lhs "feature").
* ``reduce_window_sum`` / ``_max`` / ``_min`` / ``reduce_window`` (avg / max pooling) and
  ``select_and_scatter_add`` (max-pool backward) -> ops of the same names (rules in
  ``ir/window.py``).

The rules are the core registry's (``ir/conv.py``: batch and output features pass through,
input features are a reduction, groups pass through, same-padded rows may split with a halo;
``ir/window.py``: pooling windows).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...ir import TensorType, Value


def _ints(values: Sequence[Any] | None) -> tuple[int, ...]:
    return tuple(int(v) for v in (values or ()))


def _pairs(values: Sequence[Sequence[Any]]) -> tuple[tuple[int, int], ...]:
    return tuple((int(lo), int(hi)) for lo, hi in values)


def conv_attrs(eqn: Any) -> dict[str, Any]:
    """The IR ``convolution`` attributes of a ``conv_general_dilated`` equation."""
    p = eqn.params
    dn = p["dimension_numbers"]
    return {
        "lhs_dims": _ints(dn.lhs_spec),
        "rhs_dims": _ints(dn.rhs_spec),
        "out_dims": _ints(dn.out_spec),
        "strides": _ints(p["window_strides"]),
        "padding": _pairs(p["padding"]),
        "lhs_dilation": _ints(p["lhs_dilation"]),
        "rhs_dilation": _ints(p["rhs_dilation"]),
        "feature_group_count": int(p["feature_group_count"]),
        "batch_group_count": int(p["batch_group_count"]),
    }


def lower_conv(em: Any, eqn: Any, ins: list[Value]) -> list[Value]:
    (out,) = [_type(v.aval) for v in eqn.outvars]
    return [em.one("convolution", ins, out, **conv_attrs(eqn))]


def window_attrs(eqn: Any) -> dict[str, Any]:
    p = eqn.params
    rank = len(p["window_dimensions"])
    return {
        "window": _ints(p["window_dimensions"]),
        "strides": _ints(p["window_strides"]),
        "padding": _pairs(p["padding"]),
        "base_dilation": _ints(p.get("base_dilation") or (1,) * rank),
        "window_dilation": _ints(p.get("window_dilation") or (1,) * rank),
    }


def lower_window(em: Any, eqn: Any, ins: list[Value]) -> list[Value]:
    """Pooling, and its max backward; a generic ``reduce_window`` of several operands (a
    variadic reduction) is left to the unknown-op path."""
    if eqn.primitive.name == "reduce_window" and len(eqn.outvars) != 1:
        raise NotImplementedError("variadic reduce_window")
    if eqn.primitive.name == "select_and_scatter_add" and eqn.params["select_prim"].name not in (
        "ge",
        "le",
        "gt",
        "lt",
    ):
        raise NotImplementedError("select_and_scatter_add with an unusual select")
    types = [_type(v.aval) for v in eqn.outvars]
    return em.op(eqn.primitive.name, ins, types, **window_attrs(eqn))


WINDOW_PRIMITIVES = (
    "reduce_window_sum",
    "reduce_window_max",
    "reduce_window_min",
    "reduce_window",
    "select_and_scatter_add",
)


def _type(aval: Any) -> TensorType:
    from .lower import ir_type

    return ir_type(aval)
