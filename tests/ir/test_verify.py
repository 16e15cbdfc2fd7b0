"""Verifier: one test per invariant, each breaking a valid graph in one way."""

from __future__ import annotations

import pytest
from shardplan.ir import Graph, IRVerifyError, Mesh, Origin, Role, Sharding, TensorType, Use
from shardplan.ir.rules import ShardingRule
from shardplan.ir.verify import verify


def small_graph() -> Graph:
    """x[4,8] @ w[8,6] -> relu, on a 2x2 mesh."""
    g = Graph("small", Mesh({"dp": 2, "tp": 2}, cluster="cpu-test"))
    x = g.add_input("x", TensorType((4, 8)))
    w = g.add_input("w", TensorType((8, 6)), Role.PARAMETER)
    h = g.add_op("dot", [x, w], [TensorType((4, 6))], origin=Origin("", "layers.0.fc", "m.py:3"))
    r = g.add_op("relu", [h.result], [TensorType((4, 6))])
    g.set_outputs([r.result])
    return g


def test_verify_accepts_valid_graph() -> None:
    verify(small_graph())


def test_verify_rejects_duplicate_names() -> None:
    g = small_graph()
    g.ops[1].result.name = "0"
    with pytest.raises(IRVerifyError, match=r"value name %0 is defined twice"):
        verify(g)


def test_verify_rejects_use_before_definition() -> None:
    g = small_graph()
    g.ops.reverse()
    with pytest.raises(
        IRVerifyError, match=r"relu\(%0\): operand 0 %0 is not defined before its use"
    ):
        verify(g)


def test_verify_rejects_operand_from_another_graph() -> None:
    g, other = small_graph(), small_graph()
    g.ops[1].operands[0] = other.ops[0].result
    with pytest.raises(IRVerifyError, match="hint: ops must be in topological order"):
        verify(g)


def test_verify_rejects_stale_use_list() -> None:
    g = small_graph()
    g.ops[1].operands[0] = g.inputs[0]  # bypasses Graph.set_operand
    g.ops[1].results[0].type = TensorType((4, 8))
    g.ops[1].rule = ShardingRule.from_spec("ab->ab", [(4, 8)], [(4, 8)])
    with pytest.raises(IRVerifyError, match=r"use list of %x does not match .*1 uses recorded, 2"):
        verify(g)


def test_verify_rejects_use_of_erased_op() -> None:
    g = small_graph()
    g.inputs[0].uses.append(Use(g.ops[1], 0))
    with pytest.raises(IRVerifyError, match=r"%x .* stale use by %1 = relu\(%0\)"):
        verify(g)


def test_verify_rejects_rule_arity_mismatch() -> None:
    g = small_graph()
    g.ops[0].rule = ShardingRule.from_spec("ab->ab", [(4, 6)], [(4, 6)])
    with pytest.raises(
        IRVerifyError, match=r"rule 'ab->ab' has 1 operands and 1 results, but the op has 2 and 1"
    ):
        verify(g)


def test_verify_rejects_rule_size_mismatch_with_origin() -> None:
    g = small_graph()
    g.ops[0].rule = ShardingRule.from_spec("ik,kj->ij", [(4, 8), (8, 5)], [(4, 5)])
    with pytest.raises(
        IRVerifyError,
        match=r"operand 1 %w: f32\[8,6\] dim 1 has size 6 but its factors \(j\) multiply to 5",
    ) as info:
        verify(g)
    assert "\n  at layers.0.fc (m.py:3)\n  hint: " in str(info.value)


def test_verify_rejects_rule_rank_mismatch() -> None:
    g = small_graph()
    g.ops[1].rule = ShardingRule.from_spec("a->a", [(4,)], [(4,)])
    with pytest.raises(
        IRVerifyError, match=r"operand 0 %0: f32\[4,6\] has rank 2 but the rule gives it 1 dims"
    ):
        verify(g)


@pytest.mark.parametrize(
    ("sharding", "message"),
    [
        (Sharding.of("dp", "xx"), r"unknown mesh axis 'xx'"),
        (Sharding.of(None, ("dp", "tp")), r"\(size 6\) is not divisible by dpxtp=4"),
        (Sharding.of("dp"), r"has rank 1 but the value f32\[8,6\] has rank 2"),
    ],
)
def test_verify_rejects_sharding_that_does_not_fit(sharding: Sharding, message: str) -> None:
    g = small_graph()
    g.inputs[1].sharding = sharding
    with pytest.raises(IRVerifyError, match=r"input %w: %w: f32\[8,6\] sharding .*" + message):
        verify(g)


def test_verify_rejects_sharding_without_mesh_and_pin_without_sharding() -> None:
    g = small_graph()
    g.mesh = None
    g.inputs[0].sharding = Sharding.of("dp", None)
    with pytest.raises(
        IRVerifyError, match=r"input %x: %x has sharding .* but the graph has no mesh"
    ):
        verify(g)
    g = small_graph()
    g.inputs[1].pinned = True
    with pytest.raises(IRVerifyError, match=r"%w is pinned but has no sharding"):
        verify(g)


def test_verify_rejects_foreign_output() -> None:
    g = small_graph()
    g.outputs.append(small_graph().inputs[0])
    with pytest.raises(
        IRVerifyError, match=r"return of @small: output 1 %x is not a value of the graph"
    ):
        verify(g)


@pytest.mark.parametrize(
    ("aliases", "message"),
    [
        ({0: 5}, r"output alias 0 -> 5 is out of range \(1 outputs, 2 inputs\)"),
        ({-1: 0}, r"output alias -1 -> 0 is out of range"),
        ({0: 1}, r"output 0 %1: f32\[4,6\] aliases input 1 %w: f32\[8,6\] of another type"),
    ],
)
def test_verify_rejects_bad_output_aliases(aliases: dict[int, int], message: str) -> None:
    g = small_graph()
    g.output_aliases = aliases
    with pytest.raises(IRVerifyError, match=message):
        verify(g)


def test_verify_rejects_two_outputs_aliasing_one_input() -> None:
    g = small_graph()
    g.set_outputs([g.inputs[1], g.inputs[1]], {0: 1, 1: 1})
    with pytest.raises(IRVerifyError, match="outputs 0 and 1 both alias input 1"):
        verify(g)
