"""The collective checker: replica-group syntaxes, tuple collectives, CPU reduce-scatter."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from shardplan.costmodel.collectives import Collective
from shardplan.frontend.jax.hlo import (
    CollectiveMismatch,
    HloCollective,
    collectives,
    compare,
    replica_groups,
)
from shardplan.ir import Mesh

pytestmark = pytest.mark.jax

MESH = Mesh({"data": 2, "model": 4}, cluster="cpu-test")


@pytest.mark.parametrize(
    ("attrs", "groups"),
    [
        ("replica_groups={{0,4},{1,5},{2,6},{3,7}}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("replica_groups=[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("replica_groups=[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        (
            "replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}",
            [[0, 1, 2, 3], [4, 5, 6, 7]],
        ),
        ("replica_groups={}", [list(range(8))]),
        # Shardy sub-axes 'name':(pre-size)size: the major, then the minor half of axis_0 = 4
        (
            "replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0':(1)2}",
            [[0, 4], [1, 5], [2, 6], [3, 7]],
        ),
        (
            "replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0':(2)2}",
            [[0, 2], [1, 3], [4, 6], [5, 7]],
        ),
    ],
)
def test_replica_groups_every_syntax(attrs, groups):
    assert replica_groups(attrs + ", to_apply=%add", 8) == groups


def _megatron_hlo(out_spec):
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

    def named(*spec):
        return NamedSharding(mesh, P(*spec))

    def mlp(x, w1, w2):
        return jax.nn.relu(x @ w1) @ w2

    jitted = jax.jit(
        mlp,
        in_shardings=(named("data", None), named(None, "model"), named("model", None)),
        out_shardings=named(*out_spec),
    )
    args = (jnp.ones((16, 64)), jnp.ones((64, 256)), jnp.ones((256, 64)))
    return jitted.lower(*args).compile().as_text()


def test_collectives_megatron_all_reduce():
    found = collectives(_megatron_hlo(("data", None)), MESH)
    assert [(c.kind, c.bytes, c.group_size, c.axes) for c in found] == [
        ("all-reduce", 2048, 4, ("model",))
    ]


def test_collectives_cpu_all_reduce_then_slice_is_reduce_scatter():
    found = collectives(_megatron_hlo(("data", "model")), MESH)
    assert [(c.kind, c.bytes, c.axes) for c in found] == [("reduce-scatter", 512, ("model",))]


def test_collectives_split_combined_tuple_all_reduce():
    hlo = """
ENTRY %main (p0: f32[8], p1: f32[4,4]) -> (f32[8], f32[4,4]) {
  %p0 = f32[8]{0} parameter(0)
  %p1 = f32[4,4]{1,0} parameter(1)
  %ar = (f32[8]{0}, f32[4,4]{1,0}) all-reduce(%p0, %p1), replica_groups=[2,4]<=[8], to_apply=%add
  %a = f32[8]{0} get-tuple-element(%ar), index=0
  %b = f32[4,4]{1,0} get-tuple-element(%ar), index=1
  ROOT %t = (f32[8]{0}, f32[4,4]{1,0}) tuple(%a, %b)
}
"""
    found = collectives(hlo, MESH)
    assert [(c.kind, c.bytes, c.axes) for c in found] == [
        ("all-reduce", 32, ("model",)),
        ("all-reduce", 64, ("model",)),
    ]


def test_compare_prints_both_lists_on_mismatch():
    predicted = [Collective("all-gather", ("model",), 2048)]
    compiled = [HloCollective("all-reduce", 2048, 4, ("model",), "all-reduce.1")]
    with pytest.raises(
        CollectiveMismatch, match=r"(?s)predicted by the plan.*all-gather.*XLA.*all-reduce"
    ):
        compare(predicted, compiled, MESH)
    compare([Collective("all-reduce", ("model",), 2048)], compiled, MESH)


def test_all_reduce_read_as_a_smaller_slice_stays_an_all_reduce():
    """Readers that slice an all-reduce over 8 devices into quarters (a sub-group's split) read
    a reduced tensor: XLA keeps the all-reduce (GQA decoder on (2, 4), where the checker once
    counted it as a reduce-scatter of the quarter)."""
    hlo = """
%fused (param_0: f32[8,8,32], param_1: s32[]) -> f32[8,8,8] {
  %param_0 = f32[8,8,32]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %ds = f32[8,8,8]{2,1,0} dynamic-slice(%param_0, %zero, %zero, %param_1),
      dynamic_slice_sizes={8,8,8}
}

ENTRY %main (p0: f32[8,8,32], p1: s32[]) -> f32[8,8,8] {
  %p0 = f32[8,8,32]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %ar = f32[8,8,32]{2,1,0} all-reduce(%p0), replica_groups=[1,8]<=[8], to_apply=%add
  ROOT %f = f32[8,8,8]{2,1,0} fusion(%ar, %p1), kind=kLoop, calls=%fused
}
"""
    found = collectives(hlo, MESH)
    assert [(c.kind, c.bytes, c.axes) for c in found] == [("all-reduce", 8192, ("data", "model"))]
    eighth = hlo.replace("f32[8,8,8]", "f32[8,8,4]").replace("sizes={8,8,8}", "sizes={8,8,4}")
    found = collectives(eighth, MESH)
    assert [(c.kind, c.bytes, c.axes) for c in found] == [
        ("reduce-scatter", 1024, ("data", "model"))
    ]


def test_all_reduce_sliced_along_different_dims_stays_an_all_reduce():
    """Two readers that each take a quarter, one along dim 2 and one along dim 0, read the
    whole reduced tensor between them: an all-reduce, not a reduce-scatter (GQA decoder on
    (2, 2, 2), free plan: the plan's all-reduce of 8 KiB was once counted as a 2 KiB
    reduce-scatter because both slices were 2 KiB)."""
    hlo = """
%by_last (param_0: f32[8,8,32], param_1: s32[]) -> f32[8,8,8] {
  %param_0 = f32[8,8,32]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %ds = f32[8,8,8]{2,1,0} dynamic-slice(%param_0, %zero, %zero, %param_1),
      dynamic_slice_sizes={8,8,8}
}

%by_first (param_2: f32[8,8,32], param_3: s32[]) -> f32[2,8,32] {
  %param_2 = f32[8,8,32]{2,1,0} parameter(0)
  %param_3 = s32[] parameter(1)
  %zero.1 = s32[] constant(0)
  ROOT %ds.1 = f32[2,8,32]{2,1,0} dynamic-slice(%param_2, %param_3, %zero.1, %zero.1),
      dynamic_slice_sizes={2,8,32}
}

ENTRY %main (p0: f32[8,8,32], p1: s32[]) -> (f32[8,8,8], f32[2,8,32]) {
  %p0 = f32[8,8,32]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %ar = f32[8,8,32]{2,1,0} all-reduce(%p0), replica_groups=[2,4]<=[8], to_apply=%add
  %a = f32[8,8,8]{2,1,0} fusion(%ar, %p1), kind=kLoop, calls=%by_last
  %b = f32[2,8,32]{2,1,0} fusion(%ar, %p1), kind=kLoop, calls=%by_first
  ROOT %t = (f32[8,8,8]{2,1,0}, f32[2,8,32]{2,1,0}) tuple(%a, %b)
}
"""
    found = collectives(hlo, MESH)
    assert [(c.kind, c.bytes, c.axes) for c in found] == [("all-reduce", 8192, ("model",))]
    alike = hlo.replace("f32[2,8,32]", "f32[8,8,8]").replace("sizes={2,8,32}", "sizes={8,8,8}")
    found = collectives(alike, MESH)
    assert [(c.kind, c.bytes, c.axes) for c in found] == [("reduce-scatter", 2048, ("model",))]
