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
