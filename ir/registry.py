"""The rule registry: canonical op kind -> sharding rule builder, FLOP model and (for a few
kinds) an HBM-bytes model; and the table of the core's canonical ops.

Adding an op is one line::

    register_rule("gelu", elementwise)              # shape-generic builder
    register_rule("dot", "ik,kj->ij", flops="dot")  # fixed factor spec

A builder gets the operand and result types and the op attributes and returns a ShardingRule
(builders: ``shape_rules``, ``contraction_rules``; their vocabulary: ``rule_helpers``; what an
op costs: ``op_cost``). An unknown kind gets the safe rule (every factor need-replication) and
an UnsupportedOpWarning.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

from .contraction_rules import (
    attention,
    attention_backward,
    dot_general,
    einsum,
    embedding,
    embedding_backward,
    gather_rows,
    index_copy,
    matmul,
)
from .errors import UnsupportedOpWarning
from .rule_helpers import Attrs, RuleBuilder, Types, replicated_rule
from .rules import ShardingRule
from .shape_rules import (
    _topk,
    argreduce,
    broadcast_in_dim,
    elementwise,
    iota,
    norm,
    norm_backward,
    reduce,
    reshape,
    resize,
    rowwise,
    scan_slice,
    transpose,
)

FlopModel = (
    str  # "dot": 2 x product of factor sizes; "elementwise": result elements; "attention"; "none";
    # "attr": attrs["flops"]
    | Callable[[Types, Types, Attrs], float]  # a function of the shapes (convolution)
)


@dataclass(frozen=True, slots=True)
class OpInfo:
    build: RuleBuilder
    flops: FlopModel = "elementwise"
    linear: bool = False
    """f(sum of partials) == sum of f(partials) with *every* operand partial (add, reshape,
    convert, reduce_sum...), so pending sums may flow through unchanged. Bilinear ops (dot) are
    not linear in this sense."""


_REGISTRY: dict[str, OpInfo] = {}
_BUILT: dict[tuple, ShardingRule] = {}
"""Rules already built, by (kind, operand types, result types, attrs): a layer stack lowers the
same ops over and over, and rules are immutable. Cleared whenever a rule is registered."""


def register_rule(
    kind: str,
    rule: str | RuleBuilder,
    need_replication: str = "",
    flops: FlopModel = "elementwise",
    linear: bool = False,
) -> None:
    """Register a canonical op: a fixed spec like ``"ik,kj->ij"`` or a builder function."""
    _BUILT.clear()
    if isinstance(rule, str):
        spec = rule

        def build(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
            return ShardingRule.from_spec(
                spec, [t.shape for t in ins], [t.shape for t in outs], need_replication
            )

        _REGISTRY[kind] = OpInfo(build, flops, linear)
    else:
        _REGISTRY[kind] = OpInfo(rule, flops, linear)


BytesModel = Callable[..., float]
"""``(ins, outs, in_shards, out_shards, attrs, split) -> bytes`` one device moves for an op
whose HBM traffic is not its operands and results (a lookup reads rows, not the table)."""
_BYTES: dict[str, BytesModel] = {}


def register_bytes(kind: str, model: BytesModel) -> None:
    """Give ``kind`` its own HBM-bytes model (``op_bytes`` uses it instead of the sizes)."""
    _BYTES[kind] = model


def bytes_model(kind: str) -> BytesModel | None:
    """``kind``'s own HBM-bytes model (``register_bytes``); ``None``: its operands and results."""
    return _BYTES.get(kind)


def known_kinds() -> list[str]:
    return sorted(_REGISTRY)


def op_info(kind: str) -> OpInfo | None:
    return _REGISTRY.get(kind)


def rule_for(kind: str, ins: Types, outs: Types, attrs: Attrs, origin: object = "") -> ShardingRule:
    """The rule for one op; unknown kinds get the safe rule and a warning naming op and origin."""
    info = _REGISTRY.get(kind)
    if info is None:
        where = f" at {origin}" if str(origin) else ""
        warnings.warn(
            f"no sharding rule for op {kind!r}{where}; it will run replicated "
            "(register one with shardplan.ir.register_rule to let it shard)",
            UnsupportedOpWarning,
            stacklevel=3,
        )
        return replicated_rule(ins, outs)
    try:
        key = (kind, tuple(ins), tuple(outs), tuple(sorted(attrs.items())))
        hash(key)
    except TypeError:  # an unhashable attribute: build it every time
        return info.build(ins, outs, attrs)
    if key not in _BUILT:
        _BUILT[key] = info.build(ins, outs, attrs)
    return _BUILT[key]


# -- the canonical op set ---------------------------------------------------------------------

ELEMENTWISE_LINEAR = "add sub neg convert copy sum_n".split()
ELEMENTWISE = """mul div max min pow exp log tanh logistic sigmoid rsqrt sqrt erf relu gelu silu
abs sign floor ceil round where select eq ne lt le gt ge and or not xor integer_pow square
reciprocal expm1 log1p sin cos clamp stop_gradient dropout relu_backward gelu_backward
silu_backward tanh_backward sigmoid_backward threshold_backward fill isfinite rem""".split()

for _kind in ELEMENTWISE_LINEAR:
    register_rule(_kind, elementwise, linear=True)
for _kind in ELEMENTWISE:
    register_rule(_kind, elementwise)
for _kind in ("reduce_sum", "sum", "mean", "reduce_mean"):
    register_rule(_kind, reduce, linear=True)
for _kind in ("reduce_max", "reduce_min", "max_reduce", "amax", "amin"):
    register_rule(_kind, reduce)
for _kind in ("argmax", "argmin"):
    register_rule(_kind, argreduce)
for _kind in ("layer_norm", "rms_norm"):
    register_rule(_kind, norm)
for _kind in """softmax log_softmax softmax_backward log_softmax_backward cross_entropy
cross_entropy_backward nll_loss nll_loss_backward cumsum sort""".split():
    register_rule(_kind, rowwise)
for _kind in ("layer_norm_backward", "rms_norm_backward"):
    register_rule(_kind, norm_backward)
register_rule("topk", lambda ins, outs, attrs: _topk(ins, outs, attrs))
register_rule("reshape", reshape, flops="none", linear=True)
register_rule("transpose", transpose, flops="none", linear=True)
register_rule("broadcast_in_dim", broadcast_in_dim, flops="none", linear=True)
register_rule("broadcast", broadcast_in_dim, flops="none", linear=True)
register_rule("dot", "ik,kj->ij", flops="dot")
register_rule("dot_general", dot_general, flops="dot")
register_rule("matmul", matmul, flops="dot")
register_rule("einsum", einsum, flops="dot")
register_rule("slice", resize, flops="none", linear=True)
register_rule("dynamic_slice", resize, flops="none")
register_rule("pad", resize, flops="none")
register_rule("concat", resize, flops="none", linear=True)
register_rule("embedding", embedding, flops="none")
register_rule("embedding_backward", embedding_backward)
register_rule("attention", attention, flops="attention")
register_rule("attention_backward", attention_backward, flops="attention_backward")
register_rule("iota", iota, flops="none")
register_rule("constant", iota, flops="none")
register_rule("gather", gather_rows, flops="none")
register_rule("index_copy", index_copy, flops="none")
register_rule("scan_carry", elementwise, flops="none")  # a loop's carry on entry
register_rule("scan_loop", elementwise, flops="none")  # carried to the next iteration
register_rule("scan_index", scan_slice, flops="none")
register_rule("scan_stack", scan_slice, flops="none")

CORE_KINDS: frozenset[str] = frozenset(_REGISTRY)
"""The canonical kinds the core registers (frontends may add their own afterwards)."""


def core_kinds() -> list[str]:
    return sorted(CORE_KINDS)


from . import embedding_bag, nn_rules  # noqa: E402, F401  (rule blocks: bag lookups, norms...)
