"""Batch norm as global statistics, eval-mode batch norm and ``as_strided`` lowerings."""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import shardplan as sp
import torch
from shardplan.frontend.torch import simulate
from shardplan.frontend.torch.capture import capture
from shardplan.frontend.torch.train import step_loss
from shardplan.ir import UnsupportedOpWarning
from shardplan.solver.planner import plan_graph
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from vision_models import Activations

pytestmark = pytest.mark.torch


def _dp_plan(model: nn.Module, x: torch.Tensor) -> tuple[sp.Plan, object]:
    graph, context = capture(model, x, stamp_layers=False)
    mesh = sp.Mesh({"dp": 2}, cluster="cpu-test")
    plan = plan_graph(graph, mesh, pins=sp.strategies.dp().pins(graph, mesh), time_limit=20,
                      semantics=context.partial_semantics, merge_followers=True)  # fmt: skip
    plan = plan.with_context(context)
    assert plan.shardings[context.input_values[0]].dims[0] == ("dp",)  # the batch is split
    return plan, graph


class _OddChannels(nn.Module):
    """Batch norm of x[8, 15, 64]: no even channel split, and gathering x costs more than
    all-reducing its statistics, so on 2 ranks the batch stays split through it."""

    def __init__(self) -> None:
        super().__init__()
        self.bn, self.fc = nn.BatchNorm1d(15), nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.bn(x)))


def test_training_batch_norm_prices_the_statistic_all_reduce() -> None:
    """With the batch split, each batch-norm sum [C] is partial over dp: the plan all-reduces
    it (the mean and the centred squares: 2 x 15 floats)."""
    torch.manual_seed(0)
    plan, graph = _dp_plan(_OddChannels(), torch.randn(8, 15, 64))
    sums = [op for op in graph.ops if op.kind in ("reduce_sum", "batch_norm_sqsum")
            and op.results[0].name.startswith("native_batch_norm")]  # fmt: skip
    assert len(sums) == 2
    assert all(plan.shardings[op.results[0].name].partial == {"dp"} for op in sums)
    planned = simulate.planned_collective_list(plan)
    assert planned[("all-reduce", ("dp",), 15 * 4)] >= 2


@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_with_a_split_batch_equals_the_plain_model(training: bool) -> None:
    """apply on 2 ranks, the batch split: training mode uses the global statistics, eval mode
    the running statistics. (The running statistics' update is not compared: on simulated
    ranks every rank adds its update into the one shared buffer.)"""
    torch.manual_seed(0)
    model = Activations().train(training)
    model.bn.running_mean.uniform_(-1, 1)
    model.bn.running_var.uniform_(0.5, 2)
    x = torch.randn(8, 16)
    plan, _ = _dp_plan(model, x)
    reference = copy.deepcopy(model)
    want = step_loss(reference, (x,))
    want.backward()
    simulate.simulated_world(2)
    device_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    with simulate.local_ranks(2):
        sharded = plan.apply(copy.deepcopy(model), device_mesh)
        loss = step_loss(sharded, (x,))
        loss.backward()
        grads = {n: simulate.rank0(p.grad) for n, p in sharded.named_parameters()}
    torch.testing.assert_close(simulate.rank0(loss), want.detach(), rtol=1e-4, atol=1e-6)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


class _Strided(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x).contiguous()  # [8, 4, 6]
        flat = h.as_strided((8, 24), (24, 1))  # in order: a reshape
        windows = h.as_strided((8, 4, 4, 3), (24, 6, 1, 1))  # sliding windows per row
        return flat.sum(-1) + windows.sum((1, 2, 3))


def test_as_strided_lowers_to_a_reshape_or_a_strided_view() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsupportedOpWarning)
        graph, _ = capture(_Strided(), torch.randn(8, 4, 6), stamp_layers=False)
    views = [op for op in graph.ops if op.kind == "strided_view" and op.results[0].type.rank == 4]
    assert views  # the windows (autograd's own as_strided calls are strided views too)
    rule = views[0].rule
    batch = rule.operands[0][0][0]
    assert rule.results[0][0] == (batch,)
    assert batch not in rule.need_replication
    assert any(op.kind == "reshape" and op.results[0].type.shape == (8, 24) for op in graph.ops)


class _Segmenter(nn.Module):
    """A per-pixel classifier: ``cross_entropy`` of logits [N, C, H, W] against labels
    [N, H, W] is aten's ``nll_loss2d`` (a class axis in the middle)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3, padding=1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.conv(x), labels)


@pytest.mark.parametrize("follow", [False, True])
def test_a_per_pixel_loss_lowers_and_runs_with_a_split_batch(follow: bool) -> None:
    """``nll_loss2d`` lowers (no UnsupportedOpWarning) with the labels aligned to the logits'
    batch and pixel dims, not to their trailing dims; with the batch split over 2 ranks the
    applied (and followed) step equals the plain model's loss and gradients."""
    from shardplan.frontend.torch.follow import follow_plan

    torch.manual_seed(0)
    model = _Segmenter()
    x, labels = torch.randn(4, 3, 6, 6), torch.randint(0, 5, (4, 6, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsupportedOpWarning)
        graph, context = capture(model, x, labels, stamp_layers=False, loss_fn=lambda out, *_: out)
    loss_op = next(op for op in graph.ops if op.kind == "nll_loss")
    rule = loss_op.rule
    assert rule.operands[1] == (rule.operands[0][0], *rule.operands[0][2:])  # N, H, W
    mesh = sp.Mesh({"dp": 2}, cluster="cpu-test")
    plan = plan_graph(graph, mesh, pins=sp.strategies.dp().pins(graph, mesh), time_limit=20,
                      semantics=context.partial_semantics, merge_followers=True)  # fmt: skip
    plan = plan.with_context(context)
    assert plan.shardings[context.input_values[0]].dims[0] == ("dp",)
    reference = copy.deepcopy(model)
    want = reference(x, labels)
    want.backward()
    simulate.simulated_world(2)
    device_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    with simulate.local_ranks(2):
        sharded = plan.apply(copy.deepcopy(model), device_mesh)
        with follow_plan(plan, device_mesh) if follow else contextlib.nullcontext():
            loss = sharded(x, labels)
            loss.backward()
        grads = {n: simulate.rank0(p.grad) for n, p in sharded.named_parameters()}
    torch.testing.assert_close(simulate.rank0(loss), want.detach(), rtol=1e-4, atol=1e-6)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
