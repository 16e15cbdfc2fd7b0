"""GraphBuilder: inferred result types, canonical kinds and their rules, and shape errors."""

from __future__ import annotations

import warnings

import pytest
from shardplan.ir import IRVerifyError, Mesh, Role, Sharding, TensorType
from shardplan.ir.builder import GraphBuilder, broadcast_shapes
from shardplan.ir.registry import known_kinds


def test_builder_mlp_infers_types_and_verifies() -> None:
    b = GraphBuilder("mlp", Mesh({"dp": 2, "tp": 2}, cluster="cpu-test"))
    x = b.input("x", (8, 16), sharding=Sharding.of("dp", None), pinned=True)
    w1, w2 = b.param("w1", (16, 32)), b.param("w2", (32, 16), "f32")
    h = b.relu(b.dot(x, w1))
    y = b.dot(h, w2)
    loss = b.mean(b.reduce_sum(b.mul(y, y), axes=1), axes=0)
    b.output(loss)
    graph = b.build()
    assert [op.kind for op in graph.ops] == ["dot", "relu", "dot", "mul", "reduce_sum", "mean"]
    assert h.type == TensorType((8, 32))
    assert loss.type == TensorType(())
    assert w1.role is Role.PARAMETER
    assert x.role is Role.INPUT
    assert x.pinned
    assert str(graph.ops[0].rule) == "ik,kj->ij {i=8, k=16, j=32} reduction={k}"


def test_builder_elementwise_broadcasting() -> None:
    b = GraphBuilder()
    a, c = b.input("a", (3, 1, 5)), b.input("c", (4, 1))
    for method in (b.add, b.sub, b.mul, b.div, b.max):
        assert method(a, c).type.shape == (3, 4, 5)
    assert str(b.graph.ops[0].rule) == "a1c,b1->abc {a=3, c=5, b=4}"
    assert broadcast_shapes((), (2, 3)) == (2, 3)
    with pytest.raises(IRVerifyError, match=r"shapes \(3,\) and \(4,\) do not broadcast"):
        broadcast_shapes((3,), (4,))


def test_builder_binary_refuses_mixed_dtypes() -> None:
    b = GraphBuilder()
    x, y = b.input("x", (2,), "bf16"), b.input("y", (2,))
    with pytest.raises(IRVerifyError, match="dtypes bf16 and f32 differ; convert"):
        b.add(x, y)
    assert b.add(b.convert(x, "f32"), y).type == TensorType((2,), "f32")


def test_builder_unary_keep_type() -> None:
    b = GraphBuilder()
    x = b.input("x", (2, 3), "bf16")
    for method in (b.relu, b.gelu, b.exp, b.tanh, b.neg):
        assert method(x).type == x.type
    assert [op.kind for op in b.graph.ops] == ["relu", "gelu", "exp", "tanh", "neg"]


def test_builder_matmul_batches_broadcast() -> None:
    b = GraphBuilder()
    y = b.matmul(b.input("a", (2, 1, 3, 5)), b.input("c", (4, 5, 7)))
    assert y.type.shape == (2, 4, 3, 7)
    b.build()
    with pytest.raises(IRVerifyError, match=r"cannot multiply f32\[3,5\] by f32\[4,7\]"):
        b.matmul(b.input("d", (3, 5)), b.input("e", (4, 7)))
    with pytest.raises(IRVerifyError, match="contracting sizes 5 and 4 differ"):
        b.dot(b.input("f", (3, 5)), b.input("g", (4, 7)))


def test_builder_reductions_axes_and_keepdims() -> None:
    b = GraphBuilder()
    x = b.input("x", (2, 3, 5))
    assert b.reduce_sum(x, axes=(-1, 0)).type.shape == (3,)
    assert b.mean(x, axes=1, keepdims=True).type.shape == (2, 1, 5)
    assert b.graph.ops[0].attrs == {"axes": (0, 2)}
    assert b.graph.ops[1].attrs == {"axes": (1,), "keepdims": True}
    with pytest.raises(IRVerifyError, match="axes \\(3,\\) out of range"):
        b.reduce_sum(x, axes=3)
    b.build()


def test_builder_reshape_transpose() -> None:
    b = GraphBuilder()
    x = b.input("x", (8, 4))
    assert b.reshape(x, (2, -1)).type.shape == (2, 16)
    assert str(b.graph.ops[0].rule) == "(ab)c->a(bc) {a=2, b=4, c=4}"
    assert b.transpose(x, (1, 0)).type.shape == (4, 8)
    with pytest.raises(IRVerifyError, match=r"cannot reshape f32\[8,4\] to \(3, 11\)"):
        b.reshape(x, (3, 11))
    with pytest.raises(IRVerifyError, match="not a permutation"):
        b.transpose(x, (0, 0))


def test_builder_model_blocks_use_registered_kinds() -> None:
    b = GraphBuilder("block")
    ids, labels = b.input("ids", (2, 8), "i64"), b.input("labels", (2, 8), "i64")
    h = b.embedding(b.param("emb", (50, 16)), ids)
    h = b.layer_norm(h, b.param("g", (16,)), b.param("bias", (16,)))
    h = b.rms_norm(b.softmax(h, axis=-1), b.param("r", (16,)))
    q = b.reshape(h, (2, 8, 4, 4))
    o = b.attention(q, q, q, causal=True)
    loss = b.cross_entropy(b.reshape(o, (2, 8, 16)), labels)
    b.output(loss)
    graph = b.build()
    assert h.type == TensorType((2, 8, 16))
    assert o.type == TensorType((2, 8, 4, 4))
    assert loss.type == TensorType((), "f32")
    assert all(op.kind in known_kinds() for op in graph.ops)
    assert graph.ops[-1].rule.reduction == {"a", "b"}  # the mean over tokens leaves partial sums


def test_builder_model_block_shape_errors() -> None:
    b = GraphBuilder()
    x = b.input("x", (2, 8))
    with pytest.raises(IRVerifyError, match=r"weight f32\[4\] does not match the last dim"):
        b.layer_norm(x, b.input("w", (4,)))
    with pytest.raises(IRVerifyError, match="ids %x must be integers"):
        b.embedding(b.input("t", (10, 4)), x)
    with pytest.raises(IRVerifyError, match="expected rank 4"):
        b.attention(x, x, x)
    with pytest.raises(IRVerifyError, match=r"labels .* do not match"):
        b.cross_entropy(x, b.input("l", (3,), "i64"))


def test_builder_generic_op_scope_and_aliases() -> None:
    b = GraphBuilder("step")
    w = b.param("w", (4,))
    with b.scope("opt"), b.scope("adam"):
        new_w = b.op("sub", [w, w], [w.type])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a, c = b.op_results("my_split", [w], [TensorType((2,)), TensorType((2,))])
    assert "my_split" in str(caught[0].message)
    b.output(new_w, a, c, aliases={0: 0})
    graph = b.build()
    assert graph.ops[0].origin.module == "opt.adam"
    assert graph.output_aliases == {0: 0}
    with pytest.raises(IRVerifyError, match="use op_results"):
        b.op("add", [w], [w.type, w.type])
