"""Shardy sub-axes ``"x":(pre)size`` in the IR, propagation and the cost model (issue 17)."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shardplan.costmodel import collective_time
from shardplan.costmodel.cluster import get_cluster
from shardplan.costmodel.links import group_link
from shardplan.ir import Graph, Mesh, Sharding, ShardingError, TensorType
from shardplan.ir.axes import atomize, merge_adjacent, overlaps, parse_axis, split_axis
from shardplan.ir.parser import parse_graph
from shardplan.ir.printer import print_graph
from shardplan.passes.factor_projection import project_dim
from shardplan.passes.propagate import PropagateOptions, run_propagation

MESH = Mesh({"dp": 2, "tp": 4}, cluster="cpu-test")


def _t(*shape: int) -> TensorType:
    return TensorType(shape)


# -- IR ---------------------------------------------------------------------------------------


def test_sub_axis_names_sizes_and_overlap() -> None:
    assert parse_axis("tp") == ("tp", 1, None)
    assert parse_axis("tp:(2)2") == ("tp", 2, 2)
    assert MESH.axis_size("tp:(1)2") == MESH.axis_size("tp:(2)2") == 2
    assert MESH.group_size(["dp", "tp:(2)2"]) == 4
    assert MESH.axis_index("tp:(2)2") == MESH.axis_index("tp") == 1
    assert overlaps("tp", "tp:(2)2")
    assert overlaps("tp:(1)4", "tp:(2)2")
    assert not overlaps("tp:(1)2", "tp:(2)2")
    assert not overlaps("dp", "tp:(1)2")
    assert split_axis("tp", 2, MESH.axis_size) == ("tp:(1)2", "tp:(2)2")
    assert merge_adjacent(["tp:(1)2", "tp:(2)2"], MESH.axis_size) == ("tp",)
    assert merge_adjacent(["dp", "tp:(2)2"], MESH.axis_size) == ("dp", "tp:(2)2")
    assert atomize([("tp",), ("tp:(1)2",)], MESH.axis_size) == [
        ("tp:(1)2", "tp:(2)2"),
        ("tp:(1)2",),
    ]
    for bad in ("tp:(3)2", "tp:(1)4", "tp:(1)8", "zz:(1)2"):  # no fit, whole axis, unknown
        with pytest.raises(ShardingError):
            MESH.axis_size(bad)
    with pytest.raises(ShardingError, match="pre-size"):
        parse_axis("tp:(0)2")


def test_sharding_with_sub_axes_checks_counts_and_hashes() -> None:
    s = Sharding((("tp:(1)2",), ("tp:(2)2", "dp")))
    assert s.has_sub_axes
    assert not Sharding.of("tp", None).has_sub_axes
    assert s.shard_count(MESH) == 8
    assert s.local_shape(_t(2, 8), MESH) == (1, 2)
    assert s == Sharding((("tp:(1)2",), ("tp:(2)2", "dp")))
    assert hash(s) == hash(Sharding((("tp:(1)2",), ("tp:(2)2", "dp"))))
    assert s != Sharding((("tp:(2)2",), ("tp:(1)2", "dp")))
    assert str(s) == '[{"tp":(1)2}, {"tp":(2)2, "dp"}]'
    for clash in [(("tp",), ("tp:(2)2",)), (("tp:(1)4",), ("tp:(2)2",))]:
        with pytest.raises(ShardingError, match="overlap"):
            Sharding(clash)
    with pytest.raises(ShardingError, match="not divisible"):
        Sharding((("tp:(1)2",),)).check(_t(3), MESH)


def test_printer_parser_round_trip_sub_axes() -> None:
    g = Graph("sub", mesh=MESH)
    x = g.add_input("x", _t(2, 4, 16), sharding=Sharding((("tp:(1)2",), ("tp:(2)2",), ("dp",))))
    y = g.add_op("reshape", [x], [_t(8, 16)], names=["y"]).result
    y.sharding = Sharding((("tp",), ()), frozenset({"dp"}))
    g.set_outputs([y])
    text = print_graph(g)
    assert '[{"tp":(1)2}, {"tp":(2)2}, {"dp"}]' in text
    again = parse_graph(text)
    assert again.value("x").sharding == x.sharding
    assert print_graph(again) == text


# -- propagation ------------------------------------------------------------------------------


def test_project_dim_splits_a_straddling_axis_into_sub_axes() -> None:
    sizes = {"i": 2, "j": 4, "k": 3}
    assert project_dim(("tp",), ("i", "j"), sizes, MESH.axis_size) == (
        {"i": ("tp:(1)2",), "j": ("tp:(2)2",)},
        False,
    )
    assert project_dim(("tp",), ("i", "j"), sizes, MESH.axis_size, sub_axes=False)[1] is True
    assert project_dim(("tp",), ("k", "j"), sizes, MESH.axis_size)[1] is True  # 3 vs 4


def _split_merge(pin_first: bool) -> tuple[Graph, dict]:
    """(8,16) -> (2,4,16) -> exp -> (8,16), one end pinned on tp over dim 0."""
    g = Graph("split_merge", mesh=MESH)
    a = g.add_input("a", _t(8, 16))
    b = g.add_op("reshape", [a], [_t(2, 4, 16)], names=["b"]).result
    c = g.add_op("exp", [b], [b.type], names=["c"]).result
    d = g.add_op("reshape", [c], [_t(8, 16)], names=["d"]).result
    g.set_outputs([d])
    pinned = a if pin_first else d
    pinned.sharding, pinned.pinned = Sharding.of("tp", "dp"), True
    return g, {"a": a, "b": b, "c": c, "d": d}


@pytest.mark.parametrize("pin_first", [True, False])
def test_propagation_splits_into_sub_axes_and_merges_back(pin_first: bool) -> None:
    g, v = _split_merge(pin_first)
    run_propagation(g, PropagateOptions())
    split = Sharding((("tp:(1)2",), ("tp:(2)2",), ("dp",)))
    assert v["b"].sharding == split
    assert v["c"].sharding == split
    other = v["d"] if pin_first else v["a"]
    assert other.sharding == Sharding.of("tp", "dp")  # merged back to the whole axis


def test_conservative_propagation_forbids_sub_axes() -> None:
    g, v = _split_merge(True)
    run_propagation(g, PropagateOptions(conservative=True))
    assert v["b"].sharding == Sharding.of(None, None, "dp")
    assert v["d"].sharding == Sharding.of(None, "dp")


def test_sub_axis_is_a_prefix_of_its_axis_in_a_merge() -> None:
    """An add of ``[{"tp":(1)2}]`` and ``[{"tp"}]`` (open) agrees: the sub-axis is a prefix."""
    g = Graph("prefix", mesh=MESH)
    a = g.add_input("a", _t(16))
    b = g.add_op("reshape", [a], [_t(2, 8)], names=["b"]).result
    c = g.add_input("c", _t(2, 8))
    d = g.add_op("add", [b, c], [b.type], names=["d"]).result
    a.sharding, a.pinned = Sharding.of("tp"), True
    run_propagation(g, PropagateOptions())
    assert b.sharding == Sharding((("tp:(1)2",), ("tp:(2)2",)))
    assert c.sharding == d.sharding == b.sharding


def test_plan_print_ir_reaches_an_open_tensor_through_a_split_reshape() -> None:
    """``shardplan plan --print-ir`` on a planned graph whose only pin sits behind a
    non-boundary reshape ((8,16) on tp=4 -> (2,4,16)): the open weight gets the sub-axis
    layout (nothing reached it before sub-axes), and the plan itself stays on whole axes."""
    import shardplan as sp
    from shardplan.cli import propagated_ir

    g = Graph("heads", mesh=MESH)
    x = g.add_input("x", _t(8, 16))
    h = g.add_op("reshape", [x], [_t(2, 4, 16)], names=["h"]).result
    w = g.add_input("w", _t(2, 4, 16))
    y = g.add_op("mul", [h, w], [h.type], names=["y"]).result
    g.set_outputs([y])
    plan = sp.plan(g, mesh=MESH, pins={"x": Sharding.of("tp", None)}, time_limit=5)
    text = propagated_ir(plan.graph)
    assert '%w: f32[2,4,16] [{"tp":(1)2}, {"tp":(2)2}, {}]' in text
    assert "# %w: propagated from %h through mul" in text
    assert not any(s.has_sub_axes for s in plan.shardings.values())
    assert plan.sharding_of("x") == Sharding.of("tp", None)


# -- cost model -------------------------------------------------------------------------------


def test_collective_over_a_sub_axis_is_priced_as_its_group() -> None:
    """A sub-axis group of size 2 costs what a size-2 group on the same links costs; on one
    node it is intra-node, and with 2-device nodes the strided x:(1)2 crosses nodes while the
    contiguous x:(2)2 stays inside one."""
    mesh = Mesh({"x": 4, "y": 2}, cluster="h100-sxm")
    two = Mesh({"x": 2, "y": 4}, cluster="h100-sxm")
    for kind in ("all-gather", "all-reduce", "all-to-all"):
        sub = collective_time(kind, 2**20, ["x:(1)2"], mesh)
        assert sub == pytest.approx(collective_time(kind, 2**20, ["x"], two))
        assert 0 < sub < collective_time(kind, 2**20, ["x"], mesh)
    cluster = get_cluster("h100-sxm")
    small = dataclasses.replace(cluster, devices_per_node=4)
    assert group_link(("x:(1)2",), mesh, small).level == "inter-node"
    assert group_link(("x:(2)2",), mesh, small).level == "intra-node"


def test_reshards_between_sub_axis_and_whole_axis_layouts_reach_the_target() -> None:
    """Every pair of these layouts is priced (the walk ends: the sub-axes are distinct names to
    it, so a sub-axis to its whole axis is priced conservatively as gathers), and a permute
    between layouts with one shard count per dim names the parts that move."""
    from shardplan.costmodel.reshard import reshard, reshard_steps

    mesh = Mesh({"dp": 2, "tp": 4}, cluster="h100-sxm")
    layouts = [
        Sharding((("tp:(1)2",), ("tp:(2)2",), ())),
        Sharding((("tp:(1)2",), (), ())),
        Sharding((("dp",), ("tp:(2)2",), ())),
        Sharding((("tp:(2)2",), ("tp:(1)2",), ("dp",))),
        Sharding.of(None, "tp", None),
        Sharding.of(None, None, ("dp", "tp")),
        Sharding.of(None, None, None),
    ]
    t = _t(2, 4, 16)
    for src in layouts:
        for dst in layouts:
            moves = reshard(src, dst, t, mesh)
            if src == dst or src.is_replicated:
                assert not moves
            dropped = [a for a in src.used_axes if not any(overlaps(a, b) for b in dst.used_axes)]
            if dropped:  # a part of the mesh the target does not split over: gathered
                assert moves, (src, dst)
    steps = reshard_steps(layouts[0], layouts[2], mesh)
    assert [(k, set(a)) for k, a, _ in steps] == [("collective-permute", {"dp", "tp:(1)2"})]


# -- semantics: a propagated sub-axis layout is the reshape of the devices' blocks ------------

_MESHES = [
    Mesh({"a": 2, "b": 4}, cluster="cpu-test"),
    Mesh({"a": 4, "b": 2}, cluster="cpu-test"),
    Mesh({"x": 8}, cluster="cpu-test"),
    Mesh({"a": 2, "b": 2, "c": 2}, cluster="cpu-test"),
]


def _blocks(sharding: Sharding, shape: tuple[int, ...], mesh: Mesh) -> list[frozenset[int]]:
    """Per device (row-major over the mesh), the flat indices of the tensor it holds. A sub-axis
    ``x:(p)s`` of axis ``x`` (size n) is the digit ``(c // (n / (p*s))) % s`` of x's coordinate."""
    import itertools

    import numpy as np
    from shardplan.ir.axes import parse_axis

    flat = np.arange(int(np.prod(shape))).reshape(shape)
    names = mesh.axis_names
    out = []
    for coords in itertools.product(*(range(n) for _, n in mesh.axes)):
        at = dict(zip(names, coords, strict=True))
        index = []
        for size, axes in zip(shape, sharding.dims, strict=True):
            k = 0
            for axis in axes:
                base, pre, sub = parse_axis(axis)
                n = mesh.axis_size(base)
                digit = at[base] if sub is None else (at[base] // (n // (pre * sub))) % sub
                k = k * mesh.axis_size(axis) + digit
            step = size // mesh.group_size(axes)
            index.append(slice(k * step, (k + 1) * step))
        out.append(frozenset(flat[tuple(index)].ravel().tolist()))
    return out


@st.composite
def _reshapes(draw: st.DrawFn) -> tuple[Mesh, tuple[int, ...], tuple[int, ...], Sharding]:
    """A mesh, a tensor shape, a reshape target of the same size, and a pin of the source."""
    mesh = draw(st.sampled_from(_MESHES))
    shape = tuple(2 ** draw(st.integers(0, 5)) for _ in range(draw(st.integers(1, 2))))
    total = int(math.prod(shape)).bit_length() - 1
    cuts = sorted(draw(st.lists(st.integers(0, total), max_size=2)))
    bounds = [0, *cuts, total]
    target = tuple(2 ** (hi - lo) for lo, hi in itertools.pairwise(bounds))
    free = list(mesh.axis_names)
    dims = []
    for size in shape:
        axes = []
        for axis in draw(st.permutations(free)):
            if draw(st.booleans()) and size % (mesh.group_size([*axes, axis])) == 0:
                axes.append(axis)
        free = [a for a in free if a not in axes]
        dims.append(tuple(axes))
    return mesh, shape, target, Sharding(tuple(dims))


@settings(max_examples=150, deadline=None)
@given(_reshapes(), st.booleans())
def test_propagated_reshape_layout_is_a_coarsening_of_the_pinned_blocks(case, backward) -> None:
    """Through one reshape, forward or backward: every device's block of the pinned tensor lies
    inside its block of the propagated one (propagation may drop axes, never misplace data;
    equal when none was dropped). A wrong sub-axis order or pre-size fails this."""
    mesh, shape, target, pin = case  # the pin fits ``shape``: the reshape's input or result
    g = Graph("r", mesh=mesh)
    a = g.add_input("a", _t(*(target if backward else shape)))
    b = g.add_op("reshape", [a], [_t(*(shape if backward else target))]).result
    pinned, other = (b, a) if backward else (a, b)
    pinned.sharding, pinned.pinned = pin, True
    run_propagation(g, PropagateOptions())
    got = other.sharding or Sharding.replicated(other.type.rank)
    got.check(other.type, mesh)
    held = _blocks(pin, pinned.type.shape, mesh)
    derived = _blocks(got, other.type.shape, mesh)
    assert all(h <= d for h, d in zip(held, derived, strict=True)), (pin, got)
    if got.shard_count(mesh) == pin.shard_count(mesh):
        assert held == derived


@settings(max_examples=100, deadline=None)
@given(_reshapes())
def test_split_then_merge_back_keeps_the_pinned_blocks(case) -> None:
    """A reshape and its inverse after it: the sub-axes the first makes merge back, so the
    result's blocks contain the pin's (equal when the first reshape lost no axis)."""
    mesh, shape, target, pin = case
    g = Graph("rt", mesh=mesh)
    a = g.add_input("a", _t(*shape), sharding=pin, pinned=True)
    b = g.add_op("reshape", [a], [_t(*target)]).result
    c = g.add_op("reshape", [b], [_t(*shape)]).result
    run_propagation(g, PropagateOptions())
    got = c.sharding or Sharding.replicated(len(shape))
    held, back = _blocks(pin, shape, mesh), _blocks(got, shape, mesh)
    assert all(h <= d for h, d in zip(held, back, strict=True)), (pin, b.sharding, got)
    middle = b.sharding or Sharding.replicated(len(target))
    if middle.shard_count(mesh) == pin.shard_count(mesh):
        assert got == pin
