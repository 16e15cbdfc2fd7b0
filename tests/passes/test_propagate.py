"""Tests of the propagate pass: projection, merging, conflicts, pins, partial, fixed point."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shardplan.ir import Graph, Mesh, Sharding, ShardingError, ShardingRule, TensorType, Value
from shardplan.passes.factor_projection import dim_axes, project_dim
from shardplan.passes.propagate import (
    PropagateOptions,
    propagate,
    propagate_shardings,
    run_propagation,
)

MESH = Mesh({"dp": 2, "tp": 4}, cluster="cpu-test")


def _t(*shape: int) -> TensorType:
    return TensorType(shape)


def _mlp(w2_pin: Sharding | None = None) -> tuple[Graph, dict[str, Value]]:
    """relu(x @ w1) @ w2 with x [{"dp"}, {}] and w1 [{}, {"tp"}] pinned (reference §9)."""
    g = Graph("mlp", mesh=MESH)
    x = g.add_input("x", _t(16, 64), sharding=Sharding.of("dp", None), pinned=True)
    w1 = g.add_input("w1", _t(64, 256), sharding=Sharding.of(None, "tp"), pinned=True)
    w2 = g.add_input("w2", _t(256, 64), sharding=w2_pin, pinned=w2_pin is not None)
    h = g.add_op("dot", [x, w1], [_t(16, 256)], names=["h"]).result
    r = g.add_op("relu", [h], [_t(16, 256)], names=["r"]).result
    y = g.add_op("dot", [r, w2], [_t(16, 64)], names=["y"]).result
    g.set_outputs([y])
    return g, {"x": x, "w1": w1, "w2": w2, "h": h, "r": r, "y": y}


def _shardings(g: Graph) -> dict[str, Sharding | None]:
    return {v.name: v.sharding for v in g.values()}


def test_propagate_mlp_matches_shardy_oracle() -> None:
    g, v = _mlp()
    propagate(g)
    assert v["h"].sharding == Sharding.of("dp", "tp")
    assert v["r"].sharding == Sharding.of("dp", "tp")
    assert v["w2"].sharding == Sharding.of("tp", None)  # backward: row parallel
    assert v["y"].sharding == Sharding.of("dp", None, partial={"tp"})
    assert not v["w2"].pinned
    assert not v["y"].pinned


def test_propagate_forward_only_leaves_operands() -> None:
    g, v = _mlp()
    propagate(g, PropagateOptions(direction="forward"))
    assert v["w2"].sharding is None
    assert v["h"].sharding == Sharding.of("dp", "tp")
    assert v["y"].sharding == Sharding.of("dp", None, partial={"tp"})


def test_propagate_backward_only_fills_operands_from_results() -> None:
    g = Graph("bw", mesh=MESH)
    a = g.add_input("a", _t(8, 16))
    b = g.add_op("relu", [a], [_t(8, 16)]).result
    b.sharding, b.pinned = Sharding.of("dp", "tp"), True
    propagate(g, PropagateOptions(direction="backward"))
    assert a.sharding == Sharding.of("dp", "tp")


def test_propagate_reshape_follows_compound_factor() -> None:
    """[4,8,128] split on dim 2 by tp=4 lands on dim 2 of [4,8,8,16] (reference §9)."""
    g = Graph("reshape", mesh=MESH)
    a = g.add_input("a", _t(4, 8, 128), sharding=Sharding.of(None, None, "tp"), pinned=True)
    op = g.add_op("reshape", [a], [_t(4, 8, 8, 16)])
    propagate(g)
    assert op.result.sharding == Sharding.of(None, None, "tp", None)


def test_propagate_attention_chain_matches_shardy_oracle() -> None:
    """einsum -> reshape [4,8,128]->[4,8,8,16] -> transpose -> sum: heads follow tp (§9)."""
    g = Graph("attn", mesh=MESH)
    x = g.add_input("x", _t(4, 8, 32), sharding=Sharding.of("dp", None, None), pinned=True)
    w = g.add_input("w", _t(32, 128), sharding=Sharding.of(None, "tp"), pinned=True)
    q = g.add_op("einsum", [x, w], [_t(4, 8, 128)], attrs={"equation": "bsh,hf->bsf"}).result
    r = g.add_op("reshape", [q], [_t(4, 8, 8, 16)]).result
    t = g.add_op("transpose", [r], [_t(4, 8, 8, 16)], attrs={"perm": (0, 2, 1, 3)}).result
    out = g.add_op("reduce_sum", [t], [_t(4, 8, 8)], attrs={"axes": (3,)}).result
    propagate(g)
    assert out.sharding == Sharding.of("dp", "tp", None)


def test_propagate_reshape_backward_merges_into_compound_dim() -> None:
    """[4,8,8,16] sharded on dims 2 (tp=4 of 8) and 3: dim 3 cannot follow an unsplit major."""
    g = Graph("reshape_bw", mesh=MESH)
    a = g.add_input("a", _t(4, 8, 128))
    b = g.add_op("reshape", [a], [_t(4, 8, 8, 16)]).result
    b.sharding, b.pinned = Sharding.of("dp", None, "tp", None), True
    propagate(g)
    assert a.sharding == Sharding.of("dp", None, "tp")
    full = Graph("reshape_full", mesh=Mesh({"x": 8, "y": 2}, cluster="cpu-test"))
    c = full.add_input("c", _t(128))
    d = full.add_op("reshape", [c], [_t(8, 16)]).result
    d.sharding, d.pinned = Sharding.of("x", "y"), True
    propagate(full)
    assert c.sharding == Sharding.of(("x", "y"))  # x fills the major factor, so y may follow


def test_propagate_reshape_inside_an_axis_splits_it_into_sub_axes() -> None:
    """tp=4 on [16] reshaped to [2,8]: Shardy's sub-axes ("tp":(1)2, "tp":(2)2); an axis that
    would straddle factors whose sizes do not divide it (3 of 12) still overflows."""
    g = Graph("overflow", mesh=MESH)
    a = g.add_input("a", _t(16), sharding=Sharding.of("tp"), pinned=True)
    b = g.add_op("reshape", [a], [_t(2, 8)]).result
    propagate(g)
    assert b.sharding == Sharding((("tp:(1)2",), ("tp:(2)2",)))
    g = Graph("overflow3", mesh=MESH)
    a = g.add_input("a", _t(12), sharding=Sharding.of("tp"), pinned=True)
    b = g.add_op("reshape", [a], [_t(3, 4)]).result
    propagate(g)
    assert b.sharding is None


def test_project_dim_splits_axes_major_first() -> None:
    sizes, axis_sizes = {"i": 2, "j": 8}, {"x": 2, "y": 4, "z": 4}
    assert project_dim(("x", "y"), ("i", "j"), sizes, axis_sizes) == (
        {"i": ("x",), "j": ("y",)},
        False,
    )
    assert project_dim(("y",), ("i", "j"), sizes, axis_sizes) == (
        {"i": ("y:(1)2",), "j": ("y:(2)2",)},
        False,
    )  # y straddles i and j: sub-axes
    assert project_dim(("x", "y", "z"), ("i", "j"), sizes, axis_sizes)[1] is True
    assert dim_axes(("i", "j"), {"i": (), "j": ("y",)}, sizes, axis_sizes) == ()
    assert dim_axes(("i", "j"), {"i": ("x",), "j": ("y",)}, sizes, axis_sizes) == ("x", "y")


def test_propagate_need_replication_factor_blocks() -> None:
    g = Graph("softmax", mesh=MESH)
    a = g.add_input("a", _t(8, 16), sharding=Sharding.of("dp", "tp"), pinned=True)
    b = g.add_op("softmax", [a], [_t(8, 16)], attrs={"axis": 1}).result
    propagate(g)
    assert b.sharding == Sharding.of("dp", None)


def test_propagate_never_overwrites_pins() -> None:
    pin = Sharding.of(None, "dp")
    g, v = _mlp(w2_pin=pin)
    before = {k: (x.sharding, x.pinned) for k, x in v.items() if x.pinned}
    propagate(g)
    assert {k: (x.sharding, x.pinned) for k, x in v.items() if x.pinned} == before
    assert v["w2"].sharding == pin
    # j takes "dp" from the pinned w2 first, so i (from the unpinned r) cannot reuse it
    assert v["y"].sharding == Sharding.of(None, "dp", partial={"tp"})


def test_propagate_conflict_resolution_prefers_pins_then_larger_tensors() -> None:
    g = Graph("conflict", mesh=MESH)
    small = g.add_input("small", _t(8, 16), sharding=Sharding.of("dp", None))
    big = g.add_input("big", _t(8, 16), sharding=Sharding.of("tp", None))
    out = g.add_op("add", [small, big], [_t(8, 16)]).result
    propagate(g)
    assert out.sharding == Sharding.of("dp", None)  # equal size: lower operand index wins
    g2 = Graph("conflict_pin", mesh=MESH)
    a = g2.add_input("a", _t(8, 16), sharding=Sharding.of("dp", None))
    b = g2.add_input("b", _t(8, 16), sharding=Sharding.of("tp", None), pinned=True)
    out2 = g2.add_op("add", [a, b], [_t(8, 16)]).result
    propagate(g2)
    assert out2.sharding == Sharding.of("tp", None)  # the pinned tensor wins
    assert a.sharding == Sharding.of("dp", None)  # a conflict never rewrites a known dim


def test_propagate_larger_tensor_wins_broadcast_conflict() -> None:
    g = Graph("bcast", mesh=MESH)
    bias = g.add_input("bias", _t(16), sharding=Sharding.of("dp"))
    act = g.add_input("act", _t(8, 16), sharding=Sharding.of(None, "tp"))
    out = g.add_op("add", [bias, act], [_t(8, 16)]).result
    propagate(g)
    assert out.sharding == Sharding.of(None, "tp")


def test_propagate_conservative_stops_at_conflicts() -> None:
    g = Graph("conservative", mesh=MESH)
    a = g.add_input("a", _t(8, 16), sharding=Sharding.of("dp", None), pinned=True)
    b = g.add_input("b", _t(8, 16), sharding=Sharding.of("tp", None), pinned=True)
    out = g.add_op("add", [a, b], [_t(8, 16)]).result
    propagate(g, PropagateOptions(conservative=True))
    assert out.sharding is None


def test_propagate_axis_used_once_per_op() -> None:
    """i (from x) and k (from w) both want tp: the pass-through factor i keeps it whichever
    tensor is larger, so the result is row-split rather than a pending sum (what Shardy does:
    ``conflict-matmul-rows-small-lhs`` in tests/frontend/jax/shardy_cases.py)."""
    for x_rows in (64, 16):
        g = Graph("axis_once", mesh=MESH)
        x = g.add_input("x", _t(x_rows, 64), sharding=Sharding.of("tp", None), pinned=True)
        w = g.add_input("w", _t(64, 32), sharding=Sharding.of("tp", None), pinned=True)
        y = g.add_op("dot", [x, w], [_t(x_rows, 32)]).result
        propagate(g)
        assert y.sharding == Sharding.of("tp", None)


def test_propagate_reduction_factor_takes_a_free_axis() -> None:
    """Without a conflict the contracting factor keeps its axis: the result is partial."""
    g = Graph("contract", mesh=MESH)
    x = g.add_input("x", _t(16, 64), sharding=Sharding.of(None, "tp"), pinned=True)
    w = g.add_input("w", _t(64, 32))
    y = g.add_op("dot", [x, w], [_t(16, 32)]).result
    propagate(g)
    assert y.sharding == Sharding.of(None, None, partial={"tp"})
    assert w.sharding == Sharding.of("tp", None)


def test_propagate_refines_minor_axes_of_hints() -> None:
    g = Graph("refine", mesh=MESH)
    a = g.add_input("a", _t(16, 8), sharding=Sharding.of(("dp", "tp"), None), pinned=True)
    b = g.add_op("relu", [a], [_t(16, 8)]).result
    b.sharding = Sharding.of("dp", None)  # an earlier hint, not pinned: may grow minor axes
    propagate(g)
    assert b.sharding == Sharding.of(("dp", "tp"), None)


def test_propagate_is_deterministic() -> None:
    results = []
    for _ in range(3):
        g, _v = _mlp()
        propagate(g)
        results.append(_shardings(g))
    assert results[0] == results[1] == results[2]


def test_propagate_reports_fixed_point_and_is_idempotent() -> None:
    g, _v = _mlp()
    stats = run_propagation(g, PropagateOptions())
    assert stats.converged
    assert stats.updates == 4
    again = run_propagation(g, PropagateOptions())
    assert again.updates == 0
    assert again.sweeps == 1


def test_propagate_shardings_returns_known_values() -> None:
    g, v = _mlp()
    found = propagate_shardings(g)
    assert found[v["w2"]] == Sharding.of("tp", None)
    assert set(found) == set(v.values())


def test_propagate_without_mesh_or_pins_is_a_no_op() -> None:
    g = Graph("nomesh")
    a = g.add_input("a", _t(4))
    g.add_op("relu", [a], [_t(4)])
    assert run_propagation(g, PropagateOptions()).updates == 0
    a.sharding = Sharding.of("dp")
    with pytest.raises(ShardingError, match="no mesh"):
        propagate(g)


def test_propagate_rejects_bad_options() -> None:
    with pytest.raises(Exception, match="max_iterations"):
        PropagateOptions(max_iterations=0)
    with pytest.raises(Exception, match="direction"):
        PropagateOptions(direction="sideways")  # type: ignore[arg-type]


def test_propagate_custom_rule_reduction_makes_partial() -> None:
    g = Graph("sum", mesh=MESH)
    a = g.add_input("a", _t(8, 16), sharding=Sharding.of("dp", "tp"), pinned=True)
    rule = ShardingRule.from_spec("ij->i", [(8, 16)], [(8,)])
    s = g.add_op("reduce_sum", [a], [_t(8)], rule=rule).result
    propagate(g)
    assert s.sharding == Sharding.of("dp", partial={"tp"})


# -- properties and scale ----------------------------------------------------------------------

_UNARY = ("relu", "exp", "neg")
_AXES = st.sampled_from([None, "dp", "tp", ("dp", "tp")])


@st.composite
def _chains(draw: st.DrawFn) -> Graph:
    """Random chains of elementwise / transpose / dot / reshape ops with random pins.

    ``add`` takes an earlier value of the same shape when there is one (residuals, ``x + x``).
    """
    g = Graph("chain", mesh=MESH)
    cur = g.add_input("x", _t(8, 16))
    for i in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["unary", "transpose", "dot", "reshape", "add"]))
        rows, cols = cur.type.shape
        if kind == "unary":
            cur = g.add_op(draw(st.sampled_from(_UNARY)), [cur], [cur.type]).result
        elif kind == "transpose":
            cur = g.add_op("transpose", [cur], [_t(cols, rows)], attrs={"perm": (1, 0)}).result
        elif kind == "dot":
            w = g.add_input(f"w{i}", _t(cols, 16))
            cur = g.add_op("dot", [cur, w], [_t(rows, 16)]).result
        elif kind == "reshape":
            cur = g.add_op("reshape", [cur], [_t(rows * cols // 8, 8)]).result
        else:
            same = [v for v in g.values() if v.type == cur.type]
            other = draw(st.sampled_from(same)) if draw(st.booleans()) else None
            other = other or g.add_input(f"b{i}", _t(rows, cols))
            cur = g.add_op("add", [cur, other], [cur.type]).result
    for value in g.values():
        if draw(st.integers(0, 3)) == 0:
            dims = draw(st.tuples(_AXES, _AXES))
            try:
                sharding = Sharding.of(*dims)
                sharding.check(value.type, MESH)
            except ShardingError:
                continue
            value.sharding, value.pinned = sharding, draw(st.booleans())
    return g


@settings(max_examples=200, deadline=None)
@given(_chains(), st.sampled_from(["both", "forward", "backward"]), st.booleans())
def test_propagate_idempotent_on_random_chains(
    g: Graph, direction: str, conservative: bool
) -> None:
    options = PropagateOptions(direction=direction, conservative=conservative)  # type: ignore[arg-type]
    pins = {v.name: v.sharding for v in g.values() if v.pinned}
    first = run_propagation(g, options)
    assert first.converged
    snapshot = _shardings(g)
    assert run_propagation(g, options).updates == 0
    assert _shardings(g) == snapshot
    assert {v.name: v.sharding for v in g.values() if v.pinned} == pins
    for value in g.values():
        if value.sharding is not None:
            value.sharding.check(value.type, MESH)


def test_propagate_scales_to_ten_thousand_ops() -> None:
    """A 10k-op chain settles in two sweeps: each op is revisited only next to a change."""
    g = Graph("long", mesh=MESH)
    cur = g.add_input("x", _t(64, 128), sharding=Sharding.of("dp", None), pinned=True)
    for i in range(2500):
        w = g.add_input(f"w{i}", _t(128, 128))
        cur = g.add_op("dot", [cur, w], [_t(64, 128)]).result
        cur = g.add_op("relu", [cur], [cur.type]).result
        cur = g.add_op("reshape", [cur], [_t(64, 8, 16)]).result
        cur = g.add_op("reshape", [cur], [_t(64, 128)]).result
    stats = run_propagation(g, PropagateOptions())
    assert stats.converged
    assert stats.sweeps <= 3
    assert cur.sharding == Sharding.of("dp", None)


def test_propagate_through_a_slice_of_a_sharded_dim() -> None:
    """Shardy's permutation factors: the sliced dim keeps its axes where they divide both
    sizes (``slice-sharded-dim`` in the Shardy harness); the planner's rule is unchanged."""
    g = Graph("slice", mesh=MESH)
    x = g.add_input("x", _t(16, 32), sharding=Sharding.of("dp", "tp"), pinned=True)
    op = g.add_op("slice", [x], [_t(8, 32)], attrs={"start": (0, 0), "limit": (8, 32)})
    c = g.add_op("concat", [op.result, op.result], [_t(16, 32)], attrs={"dimension": 0})
    propagate(g)
    assert op.result.sharding == Sharding.of("dp", "tp")
    assert c.result.sharding == Sharding.of("dp", "tp")
    assert op.rule.need_replication  # enumeration still prices the sliced dim as replicated


def test_propagate_ties_a_scan_carry_to_its_next_iteration_value() -> None:
    """A weight pinned inside the body reaches the open carry, and through it the loop's
    initial value (``scan-carry-from-pinned-w`` in the Shardy harness)."""
    g = Graph("scan", mesh=MESH)
    x = g.add_input("x", _t(16, 32))
    w = g.add_input("w", _t(32, 32), sharding=Sharding.of(None, "tp"), pinned=True)
    carry = g.add_op("scan_carry", [x], [_t(16, 32)]).result
    h = g.add_op("dot", [carry, w], [_t(16, 32)]).result
    out = g.add_op("scan_loop", [h], [_t(16, 32)], attrs={"carry": carry.name}).result
    g.set_outputs([out])
    propagate(g)
    assert h.sharding == Sharding.of(None, "tp")
    assert carry.sharding == Sharding.of(None, "tp")
    assert x.sharding == Sharding.of(None, "tp")
