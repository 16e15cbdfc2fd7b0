"""Reshard plans on cpu-test: which collectives, over which axes, with exactly how many bytes.

The tensor is f32[64,128] = 32,768 bytes; on {"dp": 4, "tp": 4} a quarter is 8,192 bytes and a
sixteenth 2,048 bytes.
"""

from __future__ import annotations

import itertools
import math

import pytest
from shardplan.costmodel import get_cluster, reshard, reshard_time
from shardplan.costmodel.reshard import permuted_axes
from shardplan.ir.errors import ShardingError
from shardplan.ir.mesh import Mesh
from shardplan.ir.sharding import Sharding
from shardplan.ir.types import TensorType

CPU = get_cluster("cpu-test")
MESH = Mesh({"dp": 4, "tp": 4}, cluster="cpu-test")
T = TensorType((64, 128), "f32")
FULL, QUARTER, SIXTEENTH = 32768, 8192, 2048

S = Sharding.of


def plan(src: Sharding, dst: Sharding, mesh: Mesh = MESH) -> list[tuple[str, tuple[str, ...], int]]:
    return [(op.kind, op.axes, op.bytes) for op in reshard(src, dst, T, mesh, CPU)]


def test_reshard_equal_is_empty() -> None:
    assert plan(S("dp", "tp"), S("dp", "tp")) == []
    assert reshard_time(S("dp", None), S("dp", None), T, MESH, CPU) == 0.0


def test_reshard_sharded_to_replicated_is_all_gather() -> None:
    assert plan(S("tp", None), S(None, None)) == [("all-gather", ("tp",), FULL)]
    # 1 us + 3/4 * 32768 B / 100 GB/s
    assert reshard_time(S("tp", None), S(None, None), T, MESH, CPU) == pytest.approx(
        1e-6 + 0.75 * FULL / 1e11
    )


def test_reshard_replicated_to_sharded_is_free() -> None:
    assert plan(S(None, None), S("dp", "tp")) == []
    assert plan(S("dp", None), S(("dp", "tp"), None)) == []


def test_reshard_partial_to_replicated_is_all_reduce() -> None:
    src = S(None, None, partial=["tp"])
    assert plan(src, S(None, None)) == [("all-reduce", ("tp",), FULL)]
    assert reshard_time(src, S(None, None), T, MESH, CPU) == pytest.approx(1e-6 + 1.5 * FULL / 1e11)


def test_reshard_partial_to_sharded_is_reduce_scatter() -> None:
    src = S(None, None, partial=["tp"])
    assert plan(src, S(None, "tp")) == [("reduce-scatter", ("tp",), QUARTER)]
    # RS time uses the input size n * out: 1 us + 3/4 * 32768 / 100 GB/s
    assert reshard_time(src, S(None, "tp"), T, MESH, CPU) == pytest.approx(
        1e-6 + 0.75 * FULL / 1e11
    )


def test_reshard_dim_move_is_all_to_all() -> None:
    assert plan(S("dp", None), S(None, "dp")) == [("all-to-all", ("dp",), QUARTER)]
    # dp crosses nodes: 10 us + 3/4 * 8192 B / 10 GB/s (one NIC)
    assert reshard_time(S("dp", None), S(None, "dp"), T, MESH, CPU) == pytest.approx(
        10e-6 + 0.75 * QUARTER / 1e10
    )


def test_reshard_2d_gathers_each_dim_with_bytes_of_that_step() -> None:
    assert plan(S("dp", "tp"), S(None, None)) == [
        ("all-gather", ("dp",), QUARTER),
        ("all-gather", ("tp",), FULL),
    ]


def test_reshard_2d_removing_an_axis_suffix_is_one_all_gather() -> None:
    assert plan(S(("dp", "tp"), None), S("dp", None)) == [("all-gather", ("tp",), QUARTER)]
    assert plan(S(("dp", "tp"), None), S(None, None)) == [("all-gather", ("dp", "tp"), FULL)]


def test_reshard_2d_slices_before_gathering() -> None:
    # slice tp on dim 1 first (free), then gather dp: the AG result is a quarter, not the full
    assert plan(S("dp", None), S(None, "tp")) == [("all-gather", ("dp",), QUARTER)]


def test_reshard_2d_partial_over_both_axes_is_one_all_reduce() -> None:
    src = S(None, None, partial=["dp", "tp"])
    assert plan(src, S(None, None)) == [("all-reduce", ("dp", "tp"), FULL)]
    assert plan(src, S(("dp", "tp"), None)) == [("reduce-scatter", ("dp", "tp"), SIXTEENTH)]


def test_reshard_2d_keeps_target_partial_axes_pending() -> None:
    src = S(None, None, partial=["dp", "tp"])
    assert plan(src, S(None, None, partial=["tp"])) == [("all-reduce", ("dp",), FULL)]
    assert plan(src, S("dp", None, partial=["tp"])) == [("reduce-scatter", ("dp",), QUARTER)]


def test_reshard_2d_all_to_all_then_reduce_scatter() -> None:
    src = S("tp", None, partial=["dp"])
    assert plan(src, S("dp", "tp")) == [
        ("all-to-all", ("tp",), QUARTER),
        ("reduce-scatter", ("dp",), SIXTEENTH),
    ]


def test_reshard_2d_partial_with_sharded_dim_reduces_local_shard() -> None:
    # the partial sum is over the dp-local quarter: AR bytes are a quarter
    assert plan(S("dp", None, partial=["tp"]), S("dp", None)) == [("all-reduce", ("tp",), QUARTER)]


def test_reshard_2d_same_tiling_other_order_is_collective_permute() -> None:
    assert plan(S(("dp", "tp"), None), S(("tp", "dp"), None)) == [
        ("collective-permute", ("dp", "tp"), SIXTEENTH)
    ]
    assert plan(S("dp", "tp"), S("tp", "dp")) == [("collective-permute", ("dp", "tp"), SIXTEENTH)]
    assert plan(S("dp", None), S("tp", None)) == [("collective-permute", ("dp", "tp"), QUARTER)]


def test_reshard_2d_axis_changing_dims_across_each_other() -> None:
    # dp (4) -> dim 1 and tp (4) -> dim 0 on a mesh where they differ in size: gather one,
    # then move the other
    mesh = Mesh({"dp": 2, "tp": 4}, cluster="cpu-test")
    ops = plan(S("dp", "tp"), S("tp", "dp"), mesh)
    assert [op[0] for op in ops] == ["all-gather", "all-to-all"]
    assert ops[0] == ("all-gather", ("dp",), FULL // 4)
    assert ops[1] == ("all-to-all", ("tp",), FULL // 4)


def test_reshard_to_new_partial_is_impossible() -> None:
    src, dst = S(None, None), S(None, None, partial=["tp"])
    assert reshard_time(src, dst, T, MESH, CPU) == math.inf
    with pytest.raises(ShardingError, match=r"partial over \['tp'\]"):
        reshard(src, dst, T, MESH, CPU)


def test_reshard_rejects_shardings_that_do_not_fit() -> None:
    with pytest.raises(ShardingError, match="rank"):
        reshard(S("dp"), S(None, None), T, MESH, CPU)


def test_reshard_single_device_axes_cost_nothing() -> None:
    mesh = Mesh({"dp": 1, "tp": 4}, cluster="cpu-test")
    assert plan(S("dp", None), S(None, None), mesh) == []
    assert plan(S(None, None, partial=["dp"]), S(None, None), mesh) == []


def test_reshard_bytes_on_a_node_spanning_axis() -> None:
    mesh = Mesh({"x": 8}, cluster="cpu-test")
    ops = reshard(S("x", None), S(None, None), T, mesh, CPU)
    # x spans 2 nodes with 4 members each: 10 us + 7/8 * 32768 B / 40 GB/s
    assert [(op.kind, op.bytes) for op in ops] == [("all-gather", FULL)]
    assert ops[0].time == pytest.approx(10e-6 + 7 / 8 * FULL / 4e10)


def test_reshard_refine_or_coarsen_a_dim_in_another_order_goes_through_a_permute() -> None:
    # XLA's route (partial replication <-> a compatible tiling): slice the free axis locally and
    # permute into the target's device order, or permute the kept axis first and gather the
    # rest, rather than gathering the whole dim.
    mesh = Mesh({"dp": 2, "tp": 4}, cluster="cpu-test")
    eighth = FULL // 8
    assert plan(S("tp", None), S(("dp", "tp"), None), mesh) == [
        ("collective-permute", ("dp", "tp"), eighth)
    ]
    assert plan(S(("dp", "tp"), None), S("tp", None), mesh) == [
        ("collective-permute", ("dp", "tp"), eighth),
        ("all-gather", ("dp",), FULL // 4),
    ]


def test_permute_axes_are_those_its_device_pairs_cross() -> None:
    """A permute moves data along the axes where a device and its partner differ, pairing the
    two layouts' tile assignments position by position as XLA does (replicas in mesh order)."""
    mesh = Mesh({"dp": 2, "fsdp": 2, "tp": 2}, cluster="cpu-test")
    # dp keeps its place in the middle: only fsdp and tp swap
    ops = plan(S(None, ("tp", "dp", "fsdp")), S(None, ("fsdp", "dp", "tp")), mesh)
    assert ops == [("collective-permute", ("fsdp", "tp"), FULL // 8)]
    # a staged slice of fsdp (dp free, replicated on both sides): dp stays put
    ops = plan(S("tp", None), S(("fsdp", "tp"), None), mesh)
    assert ops == [("collective-permute", ("fsdp", "tp"), FULL // 4)]
    # one axis for another: dp-shard i of replica (fsdp, tp) = r goes to the tp-shard i of
    # replica (dp, fsdp) = r, so every axis moves
    assert permuted_axes([["dp"], []], [["tp"], []], mesh) == {"dp", "fsdp", "tp"}
    assert permuted_axes([["dp", "tp"]], [["dp", "tp"]], mesh) == set()


def _brute_force_permuted_axes(src, dst, mesh: Mesh) -> set[str]:
    """Pair every device with the device at its tile-assignment position in ``dst`` (XLA's
    permute pairs) and collect the axes where the two differ."""
    names, sizes = mesh.axis_names, dict(mesh.axes)

    def order(layout):
        used = [a for d in layout for a in d]
        return used + [a for a in names if a not in used]

    src_order, dst_order = order(src), order(dst)
    moved = set()
    for coords in itertools.product(*(range(sizes[a]) for a in names)):
        at = dict(zip(names, coords, strict=True))
        flat = 0
        for a in src_order:
            flat = flat * sizes[a] + at[a]
        partner = {}
        for a in reversed(dst_order):
            flat, partner[a] = divmod(flat, sizes[a])
        moved |= {a for a in names if partner[a] != at[a]}
    return moved


@pytest.mark.parametrize("shape", [(2, 2, 2), (2, 4), (4, 2), (2, 1, 4), (2, 3)])
def test_permuted_axes_closed_form_equals_the_device_pairs(shape) -> None:
    mesh = Mesh(dict(zip(("x", "y", "z"), shape, strict=False)), cluster="cpu-test")
    names = mesh.axis_names
    layouts = []
    for assign in itertools.product((None, 0, 1), repeat=len(names)):
        dims = [[a for a, d in zip(names, assign, strict=True) if d == k] for k in (0, 1)]
        for first in itertools.permutations(dims[0]):
            for second in itertools.permutations(dims[1]):
                layouts.append([list(first), list(second)])
    checked = 0
    for src in layouts:
        for dst in layouts:
            counts = [mesh.group_size(tuple(d)) for d in src]
            if counts == [mesh.group_size(tuple(d)) for d in dst]:
                assert permuted_axes(src, dst, mesh) == _brute_force_permuted_axes(src, dst, mesh)
                checked += 1
    assert checked > len(layouts)
