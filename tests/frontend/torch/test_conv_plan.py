"""Known answers for convolutional models: a CNN at a large batch plans data parallel."""

from __future__ import annotations

import time

import pytest
import shardplan as sp
import torch
from shardplan.ir import Role
from torch import nn

pytestmark = pytest.mark.torch


def _cnn() -> nn.Module:
    """A VGG-style stack (3x3 convs, a depthwise one, max pools) and a linear classifier."""
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(128, 128, 3, padding=1, groups=128), nn.Conv2d(128, 256, 1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 1000),
    )  # fmt: skip


@pytest.mark.parametrize(("axes", "level"), [({"dp": 8}, "intra"), ({"dp": 64}, "inter")])
def test_cnn_at_large_batch_plans_data_parallel(axes, level) -> None:  # type: ignore[no-untyped-def]
    """Batch 256 (one node) / 2048 (8 nodes) of 224x224 images on H100s: the batch splits over
    dp, every convolution runs on its batch shard, the weight gradients are reduced over dp
    (over InfiniBand on 8 nodes) and the reduction hides behind the backward."""
    with torch.device("meta"):
        model = _cnn()
    batch = 32 * axes["dp"]
    x = torch.empty(batch, 3, 224, 224, device="meta")
    start = time.perf_counter()
    plan = sp.plan(model, x, mesh=sp.Mesh(axes, cluster="h100-sxm"))
    seconds = time.perf_counter() - start
    (pixels,) = [v for v in plan.graph.inputs if v.role is Role.INPUT]
    assert plan.shardings[pixels.name].dims[0] == ("dp",)
    convs = [i for i, op in enumerate(plan.graph.ops) if op.kind == "convolution"]
    assert len(convs) == 4
    assert all(plan.operand_shardings[(i, 0)].dims[0] == ("dp",) for i in convs)
    reductions = [c for c in plan.collectives() if "dp" in c.axes]
    assert reductions, "the weight gradients must be reduced over dp"
    report = str(plan)
    assert "batch over dp" in report
    assert plan.comm_time > 0
    assert plan.exposed_comm_time is not None
    assert plan.exposed_comm_time < 0.25 * plan.comm_time, (plan.exposed_comm_time, plan.comm_time)
    if level == "inter":  # 8 nodes: priced over InfiniBand, slower than inside one node
        from shardplan.costmodel.collectives import collective_time

        c = max(reductions, key=lambda c: c.bytes)
        one_node = collective_time(c.kind, c.bytes, "dp", sp.Mesh({"dp": 8}, cluster="h100-sxm"))
        assert c.time > 1.5 * one_node
    assert seconds < 20
    from shardplan.solver.serialize import plan_from_json

    assert plan_from_json(plan.to_json()).to_json() == plan.to_json()  # saved with grad masks


def test_batch_one_high_resolution_convs_split_rows_with_a_halo() -> None:
    """One 64x1024x1024 image through four same-padded 3x3 convolutions on 8 H100s: the batch
    cannot split, a channel split would all-gather the 256 MiB activations at every layer, so
    the plan splits the rows (GSPMD's windowed split) and pays a halo exchange of one row of
    the local slab each way per convolution, priced as two collective-permutes (the fused
    backward exchanges the input's rows again and sends the input gradient's back: twice that,
    but the first convolution has no input gradient)."""
    from shardplan.costmodel.collective import Collective
    from shardplan.costmodel.collectives import collective_time
    from shardplan.costmodel.conv import halo_collectives, halo_rows, halo_time

    with torch.device("meta"):
        model = nn.Sequential(*[m for _ in range(4) for m in (nn.Conv2d(64, 64, 3, padding=1),
                                                               nn.ReLU())])  # fmt: skip
    mesh = sp.Mesh({"x": 8}, cluster="h100-sxm")
    plan = sp.plan(model, torch.empty(1, 64, 1024, 1024, device="meta"), mesh=mesh)
    convs = [(i, op) for i, op in enumerate(plan.graph.ops) if op.kind.startswith("convolution")]
    assert len(convs) == 8
    assert halo_rows(3, 1, 1, 1) == (1, 1)
    row_bytes = 64 * 1024 * 4  # one row of one image, f32
    permute = collective_time("collective-permute", row_bytes, ("x",), mesh)
    for i, op in convs:
        x = plan.operand_shardings[(i, 1 if op.kind == "convolution_backward" else 0)]
        assert x.dims == ((), (), ("x",), ()), (op.kind, x)  # rows split, nothing else
        operands = [plan.operand_shardings[(i, j)] for j in range(len(op.operands))]
        exchanges = 2  # forward: the input's halo rows; backward: again, and the input
        if op.kind == "convolution_backward" and op.attrs["output_mask"][0]:  # gradient's back
            exchanges = 4
        assert halo_collectives(op, operands, mesh) == exchanges * [
            Collective("collective-permute", ("x",), row_bytes)
        ]
        assert halo_time(op, operands, mesh, "h100-sxm") == pytest.approx(exchanges * permute)
