"""GraphBuilder: hand-built graphs for tests and examples, with shape inference.

Example::

    b = GraphBuilder("mlp", Mesh({"dp": 2, "tp": 2}))
    x = b.input("x", (8, 16))
    w = b.param("w1", (16, 32))
    h = b.relu(b.dot(x, w))
    b.output(b.reduce_sum(h, axes=(0, 1)))
    graph = b.build()  # verified
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from .errors import IRVerifyError
from .graph import AttrValue, Graph, Origin, Role, Value
from .mesh import Mesh
from .sharding import Sharding
from .types import TensorType
from .verify import verify

Shape = Sequence[int]


class GraphBuilder:
    """Appends ops with inferred result types; every method returns the new result Value.

    Op kinds are the registry's canonical names, so each op gets its registered rule. Ops take
    their module path from the innermost ``scope()``.
    """

    def __init__(self, name: str = "main", mesh: Mesh | None = None) -> None:
        self.graph = Graph(name, mesh)
        self._scopes: list[str] = []

    # -- inputs, outputs, generic ops --------------------------------------------------------
    def input(
        self,
        name: str,
        shape: Shape,
        dtype: str = "f32",
        role: Role = Role.INPUT,
        sharding: Sharding | None = None,
        pinned: bool = False,
    ) -> Value:
        """A graph input; its origin path is ``name`` (the parameter FQN or pytree path)."""
        origin = Origin(path=name, module=self.module)
        type_ = TensorType(tuple(shape), dtype)
        return self.graph.add_input(name, type_, role, origin, sharding, pinned)

    def param(self, name: str, shape: Shape, dtype: str = "f32", **kwargs: object) -> Value:
        return self.input(name, shape, dtype, Role.PARAMETER, **kwargs)  # type: ignore[arg-type]

    def op(
        self,
        kind: str,
        operands: Sequence[Value],
        result_types: Sequence[TensorType],
        **attrs: AttrValue,
    ) -> Value:
        """Any op with explicit result types; exactly one result (see ``op_results``)."""
        if len(result_types) != 1:
            raise IRVerifyError(f"op() makes one result; use op_results() for {len(result_types)}")
        return self.op_results(kind, operands, result_types, **attrs)[0]

    def op_results(
        self,
        kind: str,
        operands: Sequence[Value],
        result_types: Sequence[TensorType],
        **attrs: AttrValue,
    ) -> tuple[Value, ...]:
        origin = Origin(module=self.module)
        op = self.graph.add_op(kind, operands, result_types, attrs=attrs, origin=origin)
        return tuple(op.results)

    def output(self, *values: Value, aliases: Mapping[int, int] | None = None) -> None:
        self.graph.set_outputs(values, aliases)

    def build(self) -> Graph:
        """The graph, verified (raises IRVerifyError)."""
        verify(self.graph)
        return self.graph

    @property
    def module(self) -> str:
        return ".".join(self._scopes)

    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Ops built inside get ``module`` = the dotted path of the open scopes."""
        self._scopes.append(name)
        try:
            yield
        finally:
            self._scopes.pop()

    def _unary(self, kind: str, x: Value, **attrs: AttrValue) -> Value:
        return self.op(kind, [x], [x.type], **attrs)

    # -- elementwise -----------------------------------------------------------------------
    def add(self, a: Value, b: Value) -> Value:
        return self._binary("add", a, b)

    def sub(self, a: Value, b: Value) -> Value:
        return self._binary("sub", a, b)

    def mul(self, a: Value, b: Value) -> Value:
        return self._binary("mul", a, b)

    def div(self, a: Value, b: Value) -> Value:
        return self._binary("div", a, b)

    def max(self, a: Value, b: Value) -> Value:
        return self._binary("max", a, b)

    def _binary(self, kind: str, a: Value, b: Value) -> Value:
        if a.type.dtype != b.type.dtype:
            raise IRVerifyError(
                f"{kind}(%{a.name}, %{b.name}): dtypes {a.type.dtype} and {b.type.dtype} differ; "
                "convert one operand first (b.convert)"
            )
        shape = broadcast_shapes(a.type.shape, b.type.shape)
        return self.op(kind, [a, b], [TensorType(shape, a.type.dtype)])

    def relu(self, x: Value) -> Value:
        return self._unary("relu", x)

    def gelu(self, x: Value) -> Value:
        return self._unary("gelu", x)

    def exp(self, x: Value) -> Value:
        return self._unary("exp", x)

    def tanh(self, x: Value) -> Value:
        return self._unary("tanh", x)

    def neg(self, x: Value) -> Value:
        return self._unary("neg", x)

    def convert(self, x: Value, dtype: str) -> Value:
        return self.op("convert", [x], [TensorType(x.type.shape, dtype)])

    # -- contractions ----------------------------------------------------------------------
    def dot(self, a: Value, b: Value) -> Value:
        """2-D matrix product ``ik,kj->ij``."""
        (m, k), (k2, n) = _rank(a, 2, "dot"), _rank(b, 2, "dot")
        if k != k2:
            raise IRVerifyError(f"dot(%{a.name}, %{b.name}): contracting sizes {k} and {k2} differ")
        return self.op("dot", [a, b], [TensorType((m, n), a.type.dtype)])

    def matmul(self, a: Value, b: Value) -> Value:
        """numpy matmul: ``[..., m, k] @ [..., k, n]`` with broadcast batch dims (not 1-D)."""
        sa, sb = a.type.shape, b.type.shape
        if len(sa) < 2 or len(sb) < 2 or sa[-1] != sb[-2]:
            raise IRVerifyError(
                f"matmul(%{a.name}, %{b.name}): cannot multiply {a.type} by {b.type}"
            )
        batch = broadcast_shapes(sa[:-2], sb[:-2])
        return self.op("matmul", [a, b], [TensorType((*batch, sa[-2], sb[-1]), a.type.dtype)])

    # -- reductions and shape ops ----------------------------------------------------------
    def reduce_sum(self, x: Value, axes: Sequence[int] | int, keepdims: bool = False) -> Value:
        return self._reduce("reduce_sum", x, axes, keepdims)

    def mean(self, x: Value, axes: Sequence[int] | int, keepdims: bool = False) -> Value:
        return self._reduce("mean", x, axes, keepdims)

    def _reduce(self, kind: str, x: Value, axes: Sequence[int] | int, keepdims: bool) -> Value:
        norm = _norm_axes(x, [axes] if isinstance(axes, int) else axes)
        shape = [1 if d in norm else n for d, n in enumerate(x.type.shape)]
        if not keepdims:
            shape = [n for d, n in enumerate(x.type.shape) if d not in norm]
        extra: dict[str, AttrValue] = {"keepdims": True} if keepdims else {}
        return self.op(kind, [x], [TensorType(shape, x.type.dtype)], axes=norm, **extra)

    def reshape(self, x: Value, shape: Shape) -> Value:
        """Reshape; one dimension may be -1 (inferred)."""
        dims = list(shape)
        if dims.count(-1) == 1:
            known = math.prod(d for d in dims if d != -1)
            dims[dims.index(-1)] = x.type.numel // known if known else 0
        if math.prod(dims) != x.type.numel or any(d < 0 for d in dims):
            raise IRVerifyError(f"reshape(%{x.name}): cannot reshape {x.type} to {tuple(shape)}")
        return self.op("reshape", [x], [TensorType(dims, x.type.dtype)])

    def transpose(self, x: Value, perm: Sequence[int]) -> Value:
        if sorted(perm) != list(range(x.type.rank)):
            raise IRVerifyError(f"transpose(%{x.name}): {tuple(perm)} is not a permutation")
        shape = [x.type.shape[p] for p in perm]
        return self.op("transpose", [x], [TensorType(shape, x.type.dtype)], perm=tuple(perm))

    # -- row-wise ops and model blocks -----------------------------------------------------
    def softmax(self, x: Value, axis: int = -1) -> Value:
        return self._unary("softmax", x, axis=_norm_axes(x, [axis])[0])

    def layer_norm(self, x: Value, weight: Value, bias: Value | None = None) -> Value:
        """Normalise the last dimension; ``weight`` (and ``bias``) have the last dim's size."""
        operands = [x, weight] if bias is None else [x, weight, bias]
        return self._norm("layer_norm", operands)

    def rms_norm(self, x: Value, weight: Value) -> Value:
        return self._norm("rms_norm", [x, weight])

    def _norm(self, kind: str, operands: list[Value]) -> Value:
        x = operands[0]
        for w in operands[1:]:
            if w.type.shape != x.type.shape[-1:]:
                raise IRVerifyError(
                    f"{kind}: weight {w.type} does not match the last dim of {x.type}"
                )
        return self.op(kind, operands, [x.type], axis=x.type.rank - 1)

    def embedding(self, table: Value, ids: Value) -> Value:
        """``table[vocab, hidden]`` looked up by integer ``ids[...]`` -> ``[..., hidden]``."""
        _rank(table, 2, "embedding")
        if not ids.type.dtype.startswith(("i", "u")):
            raise IRVerifyError(f"embedding: ids %{ids.name} must be integers, got {ids.type}")
        shape = (*ids.type.shape, table.type.shape[1])
        return self.op("embedding", [table, ids], [TensorType(shape, table.type.dtype)])

    def attention(self, q: Value, k: Value, v: Value, causal: bool = False) -> Value:
        """Fused attention over ``[batch, heads, seq, head_dim]`` tensors."""
        (b, h, s, d), (_, _, t, d2), (_, _, t2, e) = (_rank(x, 4, "attention") for x in (q, k, v))
        if d != d2 or t != t2 or k.type.shape[:2] != (b, h) or v.type.shape[:2] != (b, h):
            raise IRVerifyError(f"attention: q {q.type}, k {k.type}, v {v.type} do not match")
        extra: dict[str, AttrValue] = {"causal": True} if causal else {}
        return self.op("attention", [q, k, v], [TensorType((b, h, s, e), q.type.dtype)], **extra)

    def cross_entropy(self, logits: Value, labels: Value) -> Value:
        """Mean loss (f32 scalar) of ``logits[..., vocab]`` against integer ``labels[...]``."""
        if labels.type.shape != logits.type.shape[:-1]:
            raise IRVerifyError(f"cross_entropy: labels {labels.type} do not match {logits.type}")
        axis = logits.type.rank - 1
        return self.op("cross_entropy", [logits, labels], [TensorType((), "f32")], axis=axis)


def broadcast_shapes(a: Shape, b: Shape) -> tuple[int, ...]:
    """numpy broadcasting: align right, size-1 dims stretch."""
    out: list[int] = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x != y and 1 not in (x, y):
            raise IRVerifyError(f"shapes {tuple(a)} and {tuple(b)} do not broadcast")
        out.append(y if x == 1 else x)
    return tuple(reversed(out))


def _rank(x: Value, rank: int, kind: str) -> tuple[int, ...]:
    if x.type.rank != rank:
        raise IRVerifyError(f"{kind}: %{x.name} has type {x.type}; expected rank {rank}")
    return x.type.shape


def _norm_axes(x: Value, axes: Sequence[int]) -> tuple[int, ...]:
    rank = x.type.rank
    if any(not -rank <= a < rank for a in axes):
        raise IRVerifyError(f"axes {tuple(axes)} out of range for %{x.name}: {x.type}")
    return tuple(sorted({a % rank for a in axes}))
