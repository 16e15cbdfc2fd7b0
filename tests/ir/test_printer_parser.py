"""Text form: exact printer output, print -> parse -> print round trips, and parse errors."""

from __future__ import annotations

import math
import re
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shardplan.ir import Graph, IRParseError, Mesh, Origin, Role, Sharding, TensorType
from shardplan.ir.axes import overlaps
from shardplan.ir.builder import GraphBuilder
from shardplan.ir.parser import parse_graph
from shardplan.ir.printer import print_graph
from shardplan.ir.verify import verify

MLP_TEXT = """\
mesh @m = <["dp"=8, "tp"=8]> {cluster = "h100-sxm"}
func @mlp(%x: bf16[64,4096] [{"dp"}, {}] {role = "input", pinned = true, path = "x"}, \
%w: bf16[4096,1024] {role = "param", path = "w"}) {
  %0 = dot(%x, %w) rule<"ik,kj->ij"> loc(module = "fc1", source = "mlp.py:7") \
: bf16[64,1024] [{"dp"}, {"tp"}]
  %1 = reduce_sum(%0) {axes = [1]} rule<"ab->a"> : bf16[64] [{"dp"}] partial={"tp"}
  return %1, %w {aliases = {1 = 1}}
}
"""


def mlp_graph() -> Graph:
    g = Graph("mlp", Mesh({"dp": 8, "tp": 8}, cluster="h100-sxm"))
    x = g.add_input("x", TensorType((64, 4096), "bf16"), sharding=Sharding.of("dp", None))
    x.pinned = True
    w = g.add_input("w", TensorType((4096, 1024), "bf16"), Role.PARAMETER)
    h = g.add_op(
        "dot", [x, w], [TensorType((64, 1024), "bf16")], origin=Origin("", "fc1", "mlp.py:7")
    )
    h.result.sharding = Sharding.of("dp", "tp")
    s = g.add_op("reduce_sum", [h.result], [TensorType((64,), "bf16")], attrs={"axes": (1,)})
    s.result.sharding = Sharding.of("dp", partial=["tp"])
    g.set_outputs([s.result, w], {1: 1})
    return g


def transformer_block() -> Graph:
    b = GraphBuilder("block", Mesh({"dp": 2, "tp": 4}, cluster="cpu-test"))
    ids = b.input("ids", (4, 8), "i64")
    labels = b.input("labels", (4, 8), "i64")
    emb = b.param("embed.weight", (32, 16))
    with b.scope("layers.0"):
        h = b.embedding(emb, ids)
        h = b.layer_norm(h, b.param("ln.weight", (16,)), b.param("ln.bias", (16,)))
        q = b.transpose(b.reshape(h, (4, 8, 2, 8)), (0, 2, 1, 3))
        a = b.attention(q, q, q, causal=True)
        h = b.add(h, b.reshape(b.transpose(a, (0, 2, 1, 3)), (4, 8, -1)))
        f = b.gelu(b.matmul(h, b.param("mlp.w1", (16, 32))))
        h = b.rms_norm(b.softmax(f, axis=-1), b.param("rms.weight", (32,)))
    loss = b.cross_entropy(h, labels)
    b.output(loss, b.mean(h, axes=(0, 1), keepdims=True))
    return b.build()


def assert_same_graph(a: Graph, b: Graph) -> None:
    """Structural equality: everything the text form must carry."""
    assert (a.name, a.mesh, a.output_aliases) == (b.name, b.mesh, b.output_aliases)
    assert [same_value_fields(v) for v in a.values()] == [same_value_fields(v) for v in b.values()]
    for op_a, op_b in zip(a.ops, b.ops, strict=True):
        assert (op_a.kind, op_a.rule, op_a.origin) == (op_b.kind, op_b.rule, op_b.origin)
        assert [v.name for v in op_a.operands] == [v.name for v in op_b.operands]
        assert attrs_key(op_a.attrs) == attrs_key(op_b.attrs)
    assert [v.name for v in a.outputs] == [v.name for v in b.outputs]


def same_value_fields(v):  # type: ignore[no-untyped-def]
    producer = v.producer.kind if v.producer else None
    return (v.name, v.type, v.role, v.origin, v.sharding, v.pinned, producer, len(v.uses))


def attrs_key(attrs: dict) -> list:
    """Attributes compared exactly, with NaN equal to NaN and the type kept (1 != 1.0 != True)."""
    return [(k, type(v), repr(v)) for k, v in sorted(attrs.items())]


def round_trip(graph: Graph) -> str:
    text = print_graph(graph)
    parsed = parse_graph(text)
    assert print_graph(parsed) == text
    assert_same_graph(graph, parsed)
    return text


def test_printer_mlp_text_is_exact() -> None:
    assert print_graph(mlp_graph()) == MLP_TEXT
    assert str(mlp_graph()) == MLP_TEXT


def test_parser_mlp_text_rebuilds_graph() -> None:
    graph = parse_graph(MLP_TEXT)
    verify(graph)
    assert_same_graph(graph, mlp_graph())
    assert graph.value("0").users == [graph.ops[1]]
    assert graph.ops[1].rule.reduction == {"b"}


def test_printer_parser_round_trip_builder_block() -> None:
    text = round_trip(transformer_block())
    assert 'rule<"abc,c,c->abc", need_replication={c}>' in text
    assert '%ln_weight: f32[16] {role = "param", path = "ln.weight", module = "layers.0"}' in text


def test_printer_parser_round_trip_reshape_compound_sizes() -> None:
    b = GraphBuilder("r")
    x = b.input("x", (8, 4))
    y = b.reshape(x, (2, 16))
    b.output(b.reshape(y, (4, 2, 4)))
    graph = b.build()
    assert 'rule<"(ab)c->a(bc)", sizes={b=4}>' in print_graph(graph)
    round_trip(graph)


def test_printer_parser_round_trip_exotic_names_and_strings() -> None:
    g = Graph("my model/v2", None)
    x = g.add_input(
        "x", TensorType((3,)), Role.CONSTANT, origin=Origin('p["a"]\\b', "m\n", "é.py:1")
    )
    x.name = "weird name"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        op = g.add_op("custom.op-v2", [x], [TensorType((3,)), TensorType((), "i32")])
    g.set_outputs(op.results)
    text = round_trip(g)
    assert '%"weird name"' in text
    assert '"custom.op-v2"(' in text
    assert 'path = "p[\\"a\\"]\\\\b", module = "m\\n"' in text


def test_printer_parser_round_trip_float_attrs_exact() -> None:
    g = Graph("f")
    x = g.add_input("x", TensorType((2,)))
    values = {"a": 0.1, "b": -0.0, "c": 1e-300, "d": float("inf"), "e": float("-inf"),
              "f": float("nan"), "g": 1.0, "h": 1, "i": True, "j": "1.0", "k": (),
              "l": (-1, 2)}  # fmt: skip
    g.add_op("exp", [x], [x.type], attrs=values)
    g.set_outputs([g.ops[0].result])
    text = round_trip(g)
    parsed = parse_graph(text).ops[0].attrs
    assert parsed["a"] == 0.1
    assert math.copysign(1, parsed["b"]) == -1
    assert math.isnan(parsed["f"])
    assert type(parsed["h"]) is int
    assert parsed["i"] is True
    assert parsed["k"] == ()


def test_printer_parser_round_trip_bool_tuples() -> None:
    """A gradient mask (``convolution_backward``'s ``output_mask``) prints and parses back as
    bools: the plan of every conv model is saved with it."""
    g = Graph("f")
    x = g.add_input("x", TensorType((2,)))
    g.add_op("exp", [x], [x.type], attrs={"output_mask": (False, True, True), "p": ((1, 1),)})
    g.set_outputs([g.ops[0].result])
    text = round_trip(g)
    assert "output_mask = [false, true, true]" in text
    parsed = parse_graph(text).ops[0].attrs["output_mask"]
    assert parsed == (False, True, True) and all(type(b) is bool for b in parsed)


def test_printer_parser_round_trip_result_meta_and_zero_results() -> None:
    g = Graph("meta", Mesh({"x": 2}, cluster="cpu-test"))
    a = g.add_input("a", TensorType((4,)), Role.OPTIMIZER_STATE)
    op = g.add_op("add", [a, a], [a.type], origin=Origin(module="opt"))
    op.result.role, op.result.pinned = Role.PARAMETER, True
    op.result.sharding = Sharding.of("x")
    op.result.origin = Origin()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g.add_op("print_tensor", [op.result], [])
    g.set_outputs([op.result], {0: 0})
    text = round_trip(g)
    assert '[{"x"}] {role = "param", pinned = true, path = ""}' in text
    assert '  () = print_tensor(%0) rule<"a->", need_replication={a}> : ()' in text


def test_printer_empty_graph_and_scalar_rules() -> None:
    assert print_graph(Graph("empty")) == "func @empty() {\n  return\n}\n"
    round_trip(Graph("empty"))
    b = GraphBuilder("s")
    x = b.input("x", ())
    b.output(b.add(b.exp(x), x))
    assert 'add(%0, %x) rule<",->"> : f32[]' in round_trip(b.build())


def test_parser_ignores_comments_and_layout() -> None:
    text = '# RUN: nothing\nfunc @g(%x: f32[2] {role = "input"})\n'
    text += '{ %y = neg(%x)\n rule<"a->a">  # a comment\n: f32[2] return %y }'
    graph = parse_graph(text)
    assert [v.name for v in graph.values()] == ["x", "y"]
    assert graph.outputs == [graph.value("y")]


# -- parse errors -----------------------------------------------------------------------------


def caret_column(error: IRParseError) -> int:
    lines = str(error).splitlines()
    return lines[-1].index("^") - 1  # the caret line is indented by two spaces


HEAD = 'func @g(%x: f32[2] {role = "input"}) {\n'
PARSE_ERRORS = [
    (HEAD + "  return %y\n}", r"2:10: use of undefined value %y", 10),
    (HEAD + '  %0 = neg(%x rule<"a->a"> : f32[2]\n  return\n}',
     r"2:15: expected ',' or '\)' in the operands, found 'rule'", 15),
    ('func @g(%x: f33[2] {role = "input"}) {\n  return\n}', r"1:13: unknown dtype 'f33'", 13),
    ('func @g(%x: f32[2] {role = "boss"}) {\n  return\n}', r"1:21: unknown role 'boss'", 21),
    (HEAD + '  %x = neg(%x) rule<"a->a"> : f32[2]\n  return\n}',
     r"2:3: redefinition of value %x", 3),
    (HEAD + '  %0 = neg(%x) rule<"ab->ab"> : f32[2]\n  return\n}',
     r"2:16: rule 'ab->ab': a tensor of rank 1 is given 2 dims", 16),
    (HEAD + '  %0 = neg(%x) rule<"a->a"> : f32[2], f32[2]\n  return\n}',
     r"2:8: the op names 1 results but gives 2 result types", 8),
    ("func @g() {\n  return $\n}", r"2:10: unexpected character '\$'", 10),
    ("func @g() {\n  return\n", r"3:1: expected '}' to close the function body, found end of", 1),
    ('func @g(%x: f32[2] [{"a"}, {"a"}]) {\n  return\n}', r"1:20: sharding .* more than once", 20),
    (HEAD + '  %0 = neg(%x) {k = @a} rule<"a->a"> : f32[2]\n  return\n}',
     r"2:21: expected an attribute value", 21),
    ('mesh @m = <["dp"=0]>\nfunc @g() {\n  return\n}', r"1:1: mesh axis 'dp' has size 0", 1),
]  # fmt: skip


@pytest.mark.parametrize(("text", "message", "column"), PARSE_ERRORS)
def test_parser_errors_point_at_the_fault(text: str, message: str, column: int) -> None:
    with pytest.raises(IRParseError, match=message) as info:
        parse_graph(text)
    assert caret_column(info.value) == column
    line = int(re.match(r"(\d+):", str(info.value)).group(1))  # type: ignore[union-attr]
    assert str(info.value).splitlines()[1] == "  " + text.split("\n")[line - 1]


# -- hypothesis: random small graphs round-trip -------------------------------------------------

AXES = ["dp", "tp", "sp", "pp"]
DTYPES = ["f32", "bf16", "f16", "i32", "i64", "bool"]
names = st.text('abcxyz_0123456789 ."\\é', min_size=1, max_size=6)
texts = st.text(max_size=8)


@st.composite
def meshes(draw: st.DrawFn) -> Mesh:
    count = draw(st.integers(1, 3))
    sizes = draw(st.lists(st.sampled_from([1, 2, 3, 4]), min_size=count, max_size=count))
    return Mesh(
        dict(zip(AXES, sizes, strict=False)), cluster=draw(st.sampled_from(["cpu-test", 'x"y']))
    )


@st.composite
def shardings(draw: st.DrawFn, shape: tuple[int, ...], mesh: Mesh) -> Sharding | None:
    if draw(st.booleans()):
        return None
    free = list(mesh.axis_names)
    for name, size in mesh.axes:  # and the two halves of an axis: sub-axes "a":(1)2, "a":(2)n
        if size >= 4 and size % 2 == 0:
            free += [f"{name}:(1)2", f"{name}:(2){size // 2}"]
    dims: list[tuple[str, ...]] = []
    for size in shape:
        fits = [a for a in free if size % (mesh.axis_size(a)) == 0]
        axes = tuple(draw(st.lists(st.sampled_from(fits), unique=True, max_size=1))) if fits else ()
        free = [a for a in free if not any(overlaps(a, b) for b in axes)]
        dims.append(axes)
    partial: list[str] = []
    for axis in draw(st.lists(st.sampled_from(free), unique=True)) if free else []:
        if not any(overlaps(axis, b) for b in partial):
            partial.append(axis)
    return Sharding(tuple(dims), frozenset(partial))


@st.composite
def graphs(draw: st.DrawFn) -> Graph:
    mesh = draw(meshes())
    g = Graph(draw(names), mesh)
    for _ in range(draw(st.integers(1, 3))):
        shape = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 4, 6]), max_size=3)))
        origin = Origin(draw(texts), draw(texts), draw(texts))
        type_ = TensorType(shape, draw(st.sampled_from(DTYPES)))
        role, sharding = draw(st.sampled_from(list(Role))), draw(shardings(shape, mesh))
        value = g.add_input(draw(names), type_, role, origin, sharding)
        value.pinned = value.sharding is not None and draw(st.booleans())
    for _ in range(draw(st.integers(0, 4))):
        add_random_op(draw, g)
    values = list(g.values())
    outs = draw(st.lists(st.sampled_from(values), max_size=3))
    aliases: dict[int, int] = {}
    for i, v in enumerate(outs):
        if v in g.inputs and g.inputs.index(v) not in aliases.values():
            aliases[i] = g.inputs.index(v)
    g.set_outputs(outs, aliases)
    return g


def add_random_op(draw: st.DrawFn, g: Graph) -> None:
    x = draw(st.sampled_from(list(g.values())))
    kind = draw(st.sampled_from(["exp", "reduce_sum", "reshape", "transpose", "add"]))
    shape, attrs = x.type.shape, {}
    operands = [x]
    if kind == "reduce_sum":
        axes = (
            tuple(draw(st.lists(st.integers(0, max(len(shape) - 1, 0)), unique=True)))
            if shape
            else ()
        )
        attrs = {"axes": tuple(sorted(axes))}
        shape = tuple(s for d, s in enumerate(shape) if d not in axes)
    elif kind == "reshape":
        shape = (math.prod(shape),)
    elif kind == "transpose":
        attrs = {"perm": tuple(reversed(range(len(shape))))}
        shape = tuple(reversed(shape))
    elif kind == "add":
        operands = [x, x]
    attrs["note"] = draw(st.one_of(st.floats(), st.integers(), st.booleans(), texts))
    op = g.add_op(kind, operands, [TensorType(shape, x.type.dtype)], attrs=attrs,
                  origin=Origin(module=draw(texts)), names=[draw(names)])  # fmt: skip
    op.result.sharding = draw(shardings(shape, g.mesh)) if g.mesh else None
    op.result.pinned = op.result.sharding is not None and draw(st.booleans())


@settings(max_examples=150, deadline=None)
@given(graphs())
def test_printer_parser_round_trip_random_graphs(graph: Graph) -> None:
    verify(graph)
    round_trip(graph)
