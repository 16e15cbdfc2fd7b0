"""Emitter: applied plans on simulated ranks match the plain module; collectives; known answers."""

from __future__ import annotations

import copy

import pytest
import shardplan as sp
import torch
from shardplan.frontend.torch import simulate
from shardplan.frontend.torch.train import step_loss
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

pytestmark = pytest.mark.torch


def _mesh(plan: sp.Plan):  # type: ignore[no-untyped-def]
    simulate.simulated_world(plan.mesh.size)
    sizes = tuple(plan.mesh.shape[a] for a in plan.mesh.axis_names)
    return init_device_mesh("cpu", sizes, mesh_dim_names=plan.mesh.axis_names)


def _run_applied(plan, model, inputs):  # type: ignore[no-untyped-def]
    """Loss, {fqn: grad} (rank 0) and observed collectives of one applied fwd+bwd."""
    mesh = _mesh(plan)
    with simulate.local_ranks(plan.mesh.size):
        sharded = plan.apply(copy.deepcopy(model), mesh)
        with CommDebugMode() as comm:
            loss = step_loss(sharded, inputs)
            loss.backward()
        grads = {n: simulate.rank0(p.grad) for n, p in sharded.named_parameters()}
        return simulate.rank0(loss), grads, simulate.observed_collectives(comm)


def _check_numerics(plan, model, inputs) -> None:  # type: ignore[no-untyped-def]
    reference = copy.deepcopy(model)
    ref_loss = step_loss(reference, inputs)
    ref_loss.backward()
    loss, grads, _ = _run_applied(plan, model, inputs)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-4, atol=1e-6)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_apply_mlp_matches_plain_module_on_2x2(examples) -> None:  # type: ignore[no-untyped-def]
    model, inputs = examples["torch_mlp"].make(batch=16, dim=32, hidden=256)
    plan = sp.plan(model, *inputs, mesh=sp.Mesh({"dp": 2, "tp": 2}))
    _check_numerics(plan, model, inputs)


def test_apply_llama_matches_plain_module_on_2x2(examples) -> None:  # type: ignore[no-untyped-def]
    model, inputs = examples["hf_llama"].make(batch=4, layers=1)
    plan = sp.plan(model, *inputs, mesh=sp.Mesh({"dp": 2, "tp": 2}), time_limit=10)
    _check_numerics(plan, model, inputs)


def test_apply_megatron_hand_pins_match_plain_module(examples) -> None:  # type: ignore[no-untyped-def]
    """Pinned column -> row layouts (Megatron) run as planned and give the same gradients."""
    model, inputs = examples["torch_mlp"].make(batch=8, dim=32, hidden=128, bias=False)
    pins = {"fc1.weight": sp.Sharding.of("tp", None), "fc2.weight": sp.Sharding.of(None, "tp")}
    plan = sp.plan(model, *inputs, mesh=sp.Mesh({"dp": 2, "tp": 2}), pins=pins)
    assert plan.to_placements()["fc1.weight"][1] == Shard(0)
    _check_numerics(plan, model, inputs)


def test_apply_collective_counts_match_plan(examples) -> None:  # type: ignore[no-untyped-def]
    """CommDebugMode counts of the applied fwd+bwd equal the plan's predicted collectives."""
    model, inputs = examples["torch_mlp"].make(batch=1024, dim=32, hidden=64, bias=False)
    plan = sp.plan(model, *inputs, mesh=sp.Mesh({"dp": 2, "tp": 2}))
    _, _, observed = _run_applied(plan, model, inputs)
    predicted = simulate.predicted_collectives(plan)
    assert observed == predicted, (
        f"observed (CommDebugMode): {simulate.listing(observed)}\n"
        f"predicted (plan):         {simulate.listing(predicted)}"
    )


def test_known_answer_large_batch_is_data_parallel(examples) -> None:  # type: ignore[no-untyped-def]
    """A large batch through a small MLP: the batch is split over every axis, no TP styles."""
    model, inputs = examples["torch_mlp"].make(batch=4096, dim=32, hidden=64)
    plan = sp.plan(model, *inputs, mesh=sp.Mesh({"dp": 4}))
    context = plan.frontend_context
    assert plan.shardings[context.input_values[0]].dims[0] == ("dp",)
    parallel = plan.to_parallelize_plan()
    assert parallel.tp_axis is None
    assert not parallel.styles
    assert parallel.dp_axes == ("dp",)


def test_known_answer_tiny_batch_is_megatron(examples) -> None:  # type: ignore[no-untyped-def]
    """A tiny batch through a wide MLP: fc1 column-parallel, fc2 row-parallel."""
    model, inputs = examples["torch_mlp"].make(batch=4, dim=256, hidden=8192, bias=False)
    plan = sp.plan(model, *inputs, mesh=sp.Mesh({"tp": 4}))
    placements = plan.to_placements()
    assert placements["fc1.weight"] == (Shard(0),)
    assert placements["fc2.weight"] == (Shard(1),)
    parallel = plan.to_parallelize_plan()
    assert parallel.tp_axis == "tp"
    assert isinstance(parallel.styles["fc1"], ColwiseParallel)
    assert isinstance(parallel.styles["fc2"], RowwiseParallel)
    assert parallel.expressible


def test_to_placements_follow_mesh_axis_order(examples) -> None:  # type: ignore[no-untyped-def]
    model, inputs = examples["torch_mlp"].make(batch=8, dim=32, hidden=128, bias=False)
    pins = {"fc1.weight": sp.Sharding.of("tp", "dp")}
    plan = sp.plan(model, *inputs, mesh=sp.Mesh({"dp": 2, "tp": 2}), pins=pins)
    assert plan.to_placements()["fc1.weight"] == (Shard(1), Shard(0))


def test_to_parallelize_plan_llama_styles_collapse_layers(examples) -> None:  # type: ignore[no-untyped-def]
    model, inputs = examples["hf_llama"].make(batch=2, seq=8, hidden=256, layers=2)
    pins = {
        f"model.layers.{i}.mlp.{name}.weight": sp.Sharding.of(*spec)
        for i in range(2)
        for name, spec in (("up_proj", ("tp", None)), ("gate_proj", ("tp", None)),
                           ("down_proj", (None, "tp")))
    }  # fmt: skip
    pins["input_ids"] = sp.Sharding.of(None, None)
    plan = sp.plan(model, *inputs, mesh=sp.Mesh({"tp": 2}), pins=pins, time_limit=10)
    styles = plan.to_parallelize_plan().styles
    assert isinstance(styles["model.layers.*.mlp.up_proj"], ColwiseParallel)
    assert isinstance(styles["model.layers.*.mlp.down_proj"], RowwiseParallel)


def test_apply_rejects_a_mismatched_mesh(examples) -> None:  # type: ignore[no-untyped-def]
    model, inputs = examples["torch_mlp"].make(batch=8, dim=8, hidden=16)
    plan = sp.plan(model, *inputs, mesh=sp.Mesh({"dp": 2, "tp": 2}))
    simulate.simulated_world(4)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    with pytest.raises(sp.ShardplanError, match="does not match the plan mesh"):
        plan.apply(copy.deepcopy(model), mesh)
