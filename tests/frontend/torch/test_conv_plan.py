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
    from shardplan.costmodel.collectives import Collective, collective_time
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


def _bn_cnn() -> nn.Module:
    """A ResNet-style stem and stages: strided convolutions, training-mode batch norms, a wide
    last stage (large weights, little compute: its gradients are ready last) and a classifier."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, stride=2, padding=3), nn.BatchNorm2d(64),
                               nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1)]  # fmt: skip
    for c_in, c_out in ((64, 128), (128, 256), (256, 512), (512, 1024)):
        layers += [nn.Conv2d(c_in, c_out, 3, stride=2, padding=1), nn.BatchNorm2d(c_out),
                   nn.ReLU(), nn.Conv2d(c_out, c_out, 3, padding=1), nn.BatchNorm2d(c_out),
                   nn.ReLU()]  # fmt: skip
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(1024, 1000))


def _gradient_reductions(plan, timeline) -> tuple[list[tuple[float, float, int]], float]:  # type: ignore[no-untyped-def]
    """(ready time, seconds, gradient bytes) of each simulated gradient collective (a backward
    result read by the update) and when the backward's last op ends."""
    from shardplan.costmodel.phases import Phase, op_phases

    graph, phases = plan.graph, op_phases(plan.graph)
    ends = {i: end for kind, i, _, end in timeline if kind == "compute"}
    position = {op: i for i, op in enumerate(graph.ops)}
    by_name = {v.name: v for v in graph.values()}
    backward_end = max(ends[i] for i, op in enumerate(graph.ops) if phases[op] is Phase.BACKWARD)
    out = []
    for kind, n, start, end in timeline:
        r = plan.reshards[n] if kind == "comm" else None
        if r is None or not r.consumer.startswith("op:"):
            continue
        producer = by_name[r.value].producer
        consumer = graph.ops[int(r.consumer.split(":")[1])]
        backward = producer is not None and phases[producer] is Phase.BACKWARD
        if backward and phases[consumer] is Phase.UPDATE:
            out.append((ends[position[producer]], end - start, by_name[r.value].type.nbytes))
    return out, backward_end


def test_batch_norm_cnn_on_8_nodes_hides_its_gradient_reductions() -> None:
    """Batch 2048 of 224x224 images through a batch-norm CNN on 64 H100s (8 nodes), ZeRO-1
    (the update sharded over dp, as the free plan of ResNet-50 there has it).

    Each batch norm's statistics are summed over the split batch (SyncBatchNorm's global
    statistics) by one all-reduce per sum, never a reduce-scatter whose every reader then
    all-gathers the statistic back (follower merging used to pick it: a few bytes cheaper).
    The gradient reductions run under the rest of the backward, as DDP's bucketed all-reduces
    do: what the step still waits for after the backward is at most the last bucket's
    reductions (the gradients ready last, up to DDP's 25 MB ``bucket_cap_mb``; the model runs
    one collective per gradient, so their latencies add up) plus whatever the backward left
    after the first gradient cannot cover."""
    from shardplan.costmodel.simulate import simulate

    with torch.device("meta"):
        model = _bn_cnn()
    mesh = sp.Mesh({"dp": 64}, cluster="h100-sxm")
    x = torch.empty(2048, 3, 224, 224, device="meta")
    plan = sp.evaluate(model, x, mesh=mesh, strategy=sp.strategies.zero(1)).plan
    graph = plan.graph
    (pixels,) = [v for v in graph.inputs if v.role is Role.INPUT]
    assert plan.shardings[pixels.name].dims[0] == ("dp",)
    stats = [i for i, op in enumerate(graph.ops) if op.kind == "batch_norm_stat"]
    assert len(stats) >= 2 * 9  # mean and inverse deviation of each of the 9 batch norms
    channel_stats = {op.operands[0].name for op in graph.ops if op.kind == "batch_norm_stat"}
    channel_stats |= {r.name for i in stats for r in graph.ops[i].results}
    moved = [r for r in plan.reshards if r.value in channel_stats]
    kinds = sorted({c.kind for r in moved for c in r.collectives})
    assert kinds == ["all-reduce"], kinds
    summed = [r for r in moved if r.collectives]
    assert len(summed) == 2 * 9, [(r.value, r.consumer) for r in summed]  # one per sum

    timeline: list = []
    result = simulate(plan, timeline=timeline)
    grads, backward_end = _gradient_reductions(plan, timeline)
    total = sum(t for _, t, _ in grads)
    first = min(ready for ready, _, _ in grads)
    last, held = 0.0, 0
    for _, seconds, nbytes in sorted(grads, reverse=True):  # DDP's last bucket: ready last
        if held + nbytes > 25 * 2**20:
            break
        last, held = last + seconds, held + nbytes
    cover = backward_end - first  # the backward still to run once the first gradient is ready
    assert len(grads) > 10
    assert cover > total > 1.5 * last  # reduced all at the end, the step would wait ~total
    waited = result.exposed_by_phase.get("update", 0.0) + result.exposed_by_phase.get("tail", 0.0)
    assert waited <= max(0.0, total - cover) + last + 1e-9, (waited, total, cover, last)
    assert waited < 0.5 * total
