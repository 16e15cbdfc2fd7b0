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

Until the core registry has a ``convolution`` rule, ``convolution_rule`` below stands in:
batch, output feature and feature groups pass through, the input feature is a reduction (a
partial sum), every spatial dim needs replication (no halos); a batch-grouped conv (the weight
gradient of a grouped conv) is kept whole, as XLA's partitioner computes it (measured: it
all-gathers both operands rather than split the contraction). The core rule replaces it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ...ir import ShardingRule, TensorType, Value, op_info, register_rule
from .rules import _Factors


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
    attrs = conv_attrs(eqn)
    if op_info("convolution") is _STAND_IN:
        attrs["flops"] = conv_flops(ins[0].type, ins[1].type, out, attrs)
    return [em.one("convolution", ins, out, **attrs)]


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


# -- the stand-in convolution rule -----------------------------------------------------------


def conv_flops(
    lhs: TensorType, rhs: TensorType, out: TensorType, attrs: Mapping[str, Any]
) -> float:
    """2 x output elements x input features per group x kernel window (multiply-adds)."""
    rhs_dims = attrs["rhs_dims"]
    window = math.prod(rhs.shape[d] for d in rhs_dims[2:])
    return 2.0 * out.numel * rhs.shape[rhs_dims[1]] * window


def convolution_rule(
    ins: Sequence[TensorType], outs: Sequence[TensorType], attrs: Mapping[str, Any]
) -> ShardingRule:
    """Batch and output features pass through, input features are a reduction, feature groups
    pass through, spatial dims need replication; a batch-grouped conv is kept whole."""
    lhs, rhs, out = ins[0], ins[1], outs[0]
    lb, lf, *ls = attrs["lhs_dims"]
    ro, ri, *rs = attrs["rhs_dims"]
    ob, of, *os_ = attrs["out_dims"]
    groups, batch_groups = attrs["feature_group_count"], attrs["batch_group_count"]
    fs = _Factors()
    lhs_f: list[list[str]] = [[] for _ in lhs.shape]
    rhs_f: list[list[str]] = [[] for _ in rhs.shape]
    out_f: list[list[str]] = [[] for _ in out.shape]
    # XLA's partitioner does not split the contraction of a batch-grouped conv (the weight
    # gradient of a grouped one): it gathers both operands, so the rule keeps it whole.
    cin = fs.new(rhs.shape[ri], batch_groups > 1)
    g = fs.new(groups) if groups > 1 else None
    lhs_f[lf] = [f for f in (g, cin) if f]
    rhs_f[ri] = [cin]
    if batch_groups > 1:  # out features and lhs batch both split by group: kept whole
        lhs_f[lb] = [fs.new(lhs.shape[lb], True)]
        rhs_f[ro] = [fs.new(rhs.shape[ro], True)]
        out_f[ob] = [fs.new(out.shape[ob], True)]
        out_f[of] = [fs.new(out.shape[of], True)]
    else:
        batch = fs.new(lhs.shape[lb])
        cout = fs.new(rhs.shape[ro] // groups)
        lhs_f[lb], out_f[ob] = [batch], [batch]
        rhs_f[ro] = out_f[of] = [f for f in (g, cout) if f]
    for dims, tensor, f in ((ls, lhs, lhs_f), (rs, rhs, rhs_f), (os_, out, out_f)):
        for d in dims:
            f[d] = [fs.new(tensor.shape[d], True)]
    return _compound_rule(fs, [lhs_f, rhs_f], [out_f])


def _compound_rule(
    fs: _Factors, operands: list[list[list[str]]], results: list[list[list[str]]]
) -> ShardingRule:
    ones = {f for f, size in fs.sizes.items() if size == 1}  # a size-1 factor never splits
    operands = [[[f for f in dim if f not in ones] for dim in t] for t in operands]
    results = [[[f for f in dim if f not in ones] for dim in t] for t in results]
    order: list[str] = []
    for t in operands + results:
        for dim in t:
            order.extend(f for f in dim if f not in order)
    return ShardingRule(
        tuple(tuple(tuple(d) for d in t) for t in operands),
        tuple(tuple(tuple(d) for d in t) for t in results),
        tuple((f, fs.sizes[f]) for f in order),
        frozenset(fs.need & set(order)),
    )


_STAND_IN: Any = None
if op_info("convolution") is None:
    register_rule("convolution", convolution_rule, flops="attr")
    _STAND_IN = op_info("convolution")
