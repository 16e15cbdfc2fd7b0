"""Shardy's user priorities (``p0``, ``p1``, ...) on pins, and each sharding's recorded origin."""

from __future__ import annotations

import pytest
from shardplan.ir import Graph, Mesh, Pin, Sharding, ShardingError, TensorType
from shardplan.ir.parser import parse_graph
from shardplan.ir.printer import print_graph
from shardplan.passes.annotate import annotate
from shardplan.passes.propagate import propagate

MESH = Mesh({"dp": 2, "tp": 4}, cluster="cpu-test")


def _t(*shape: int) -> TensorType:
    return TensorType(shape)


def _two_pins(x_pin: Pin, y_pin: Pin) -> Graph:
    """c = relu(x) + relu(y): the two pins meet only at the add, through open tensors."""
    g = Graph("two", mesh=MESH)
    x = g.add_input("x", _t(16, 16))
    y = g.add_input("y", _t(16, 16))
    a = g.add_op("relu", [x], [_t(16, 16)], names=["a"]).result
    b = g.add_op("relu", [y], [_t(16, 16)], names=["b"]).result
    c = g.add_op("add", [a, b], [_t(16, 16)], names=["c"]).result
    g.set_outputs([c])
    annotate(g, {"x": x_pin, "y": y_pin})
    return g


def test_without_priorities_the_first_operand_wins():
    g = _two_pins(Pin(Sharding.of("dp", None)), Pin(Sharding.of(None, "dp")))
    propagate(g)
    assert g.value("c").sharding == Sharding.of("dp", None)


def test_a_lower_priority_number_propagates_first_and_wins():
    """Round p0 sees only y's pin, so b, c and a take it before x's p1 pin is visible (Shardy's
    user-priority propagation); x keeps its own pin."""
    g = _two_pins(Pin(Sharding.of("dp", None), priority=1), Pin(Sharding.of(None, "dp"), 0))
    propagate(g)
    assert g.value("c").sharding == Sharding.of(None, "dp")
    assert g.value("a").sharding == Sharding.of(None, "dp")
    x = g.value("x")
    assert x.pinned
    assert x.sharding == Sharding.of("dp", None)
    assert x.priority == 1
    assert x.sharding_origin == "pin 'x'"


def test_a_pin_without_priority_counts_as_p0():
    """As Shardy (the harness's prio-* cases): no priority beats p1 and ties with p0."""
    g = _two_pins(Pin(Sharding.of("dp", None), priority=1), Pin(Sharding.of(None, "dp")))
    propagate(g)
    assert g.value("c").sharding == Sharding.of(None, "dp")
    g = _two_pins(Pin(Sharding.of("dp", None), priority=0), Pin(Sharding.of(None, "dp")))
    propagate(g)
    assert g.value("c").sharding == Sharding.of("dp", None)


def test_priority_breaks_a_conflict_between_pins_on_one_op():
    """Pins on both operands of one add: the lower number wins the result."""
    g = Graph("direct", mesh=MESH)
    x = g.add_input("x", _t(16, 16))
    y = g.add_input("y", _t(16, 16))
    g.set_outputs([g.add_op("add", [x, y], [_t(16, 16)], names=["c"]).result])
    annotate(g, {"x": Pin(Sharding.of("tp", None), 2), "y": Pin(Sharding.of(None, "tp"), 1)})
    propagate(g)
    assert g.value("c").sharding == Sharding.of(None, "tp")


def test_origins_name_the_pin_and_the_tensor_propagated_from():
    g = _two_pins(Pin(Sharding.of("dp", None), source="with_sharding_constraint at f.py:3"),
                  Pin(Sharding.of(None, "tp"), priority=1))  # fmt: skip
    propagate(g)
    assert g.value("x").sharding_origin == "with_sharding_constraint at f.py:3"
    assert g.value("y").sharding_origin == "pin 'y'"
    assert g.value("b").sharding_origin == "propagated from %y through relu (%b)"
    assert g.value("a").sharding_origin == "propagated from %b through add (%c)"  # not itself
    assert g.value("c").sharding_origin == "propagated from %a through add (%c)"
    assert g.value("c").sharding == Sharding.of("dp", "tp")
    text = print_graph(g, origins=True)
    assert "# %x: with_sharding_constraint at f.py:3" in text
    assert "  # %c: propagated from %a through add (%c)" in text
    again = parse_graph(text)  # the comments are skipped; the priority survives
    assert again.value("y").priority == 1
    assert again.value("x").priority is None
    assert print_graph(again) == print_graph(g)


def test_bad_pins_are_refused_clearly():
    with pytest.raises(ShardingError, match="priority must be an int >= 0"):
        Pin(Sharding.of("dp"), priority=-1)
    with pytest.raises(ShardingError, match="Pin takes a Sharding"):
        Pin(("dp",))  # type: ignore[arg-type]
    g = Graph("g", mesh=MESH)
    g.add_input("x", _t(4))
    with pytest.raises(ShardingError, match="give a Sharding or a Pin"):
        annotate(g, {"x": ("dp",)})  # type: ignore[dict-item]


def test_priority_without_pin_is_a_parse_error():
    text = 'func @g(%x: f32[4] {role = "input", priority = 0}) {\n  return %x\n}\n'
    with pytest.raises(Exception, match="pinned = true"):
        parse_graph(text)
