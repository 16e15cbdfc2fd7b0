"""Context parallelism on a tiny HF Llama: planned, applied and followed on simulated ranks.

One sequence of 256 tokens on the ``cpu-test`` cluster: the planner splits attention's
queries (one key/value head, so heads cannot split). Under ``follow_plan`` the step runs in the
head-tail token order the cost model prices (the follower reorders ids and labels, positions
come from the order) and the fused CPU kernel runs on each rank's query rows with the causal
mask of their permuted positions (``frontend/torch/context_parallel.py``); loss and every
gradient must equal the plain model's.
"""

from __future__ import annotations

import copy

import pytest
import shardplan as sp
import torch
from shardplan.costmodel.context_parallel import head_tail_order
from shardplan.frontend.torch import simulate
from shardplan.frontend.torch.follow import follow_plan
from shardplan.frontend.torch.train import step_loss
from torch.distributed.device_mesh import init_device_mesh

pytestmark = [pytest.mark.torch, pytest.mark.slow]

ATTENTION = "model.layers.0.self_attn"


def _plan(examples, axes: dict[str, int], pins=None):  # type: ignore[no-untyped-def]
    model, inputs = examples["hf_llama"].make(batch=1, seq=256, layers=1, heads=2, kv_heads=1)
    mesh = sp.Mesh(axes, cluster="cpu-test")
    return sp.plan(model, *inputs, mesh=mesh, pins=pins, time_limit=30), model, inputs


def _check_numerics(plan, model, inputs, follow: bool, ranks: int = 0) -> None:  # type: ignore[no-untyped-def]
    """Loss and every parameter gradient of the applied plan (rank 0) vs the plain model.
    Followed, the plan runs in the head-tail order over ``ranks`` query devices."""
    reference = copy.deepcopy(model)
    ref_loss = step_loss(reference, inputs)
    ref_loss.backward()
    simulate.simulated_world(plan.mesh.size)
    sizes = tuple(plan.mesh.shape[a] for a in plan.mesh.axis_names)
    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=plan.mesh.axis_names)
    with simulate.local_ranks(plan.mesh.size):
        sharded = plan.apply(copy.deepcopy(model), mesh)
        if not follow:  # DTensor's own attention: contiguous chunks
            loss = step_loss(sharded, inputs)
            loss.backward()
        else:
            with follow_plan(plan, mesh) as follower:
                loss = step_loss(sharded, inputs)
                loss.backward()
            assert follower.order == head_tail_order(inputs[0]["input_ids"].shape[1], ranks)
            assert not [d for d in follower.deviations if "context" in d], follower.deviations
            assert set(follower.reordered) == {"input_ids", "labels"}
        grads = {n: simulate.rank0(p.grad) for n, p in sharded.named_parameters()}
        loss = simulate.rank0(loss)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-4, atol=1e-6)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def _query_axes(plan: sp.Plan) -> set[str]:
    """Mesh axes the backward attention's queries are split over."""
    axes: set[str] = set()
    for i, op in enumerate(plan.graph.ops):
        if op.kind == "attention_backward":
            assert op.attrs.get("causal")  # captured from is_causal
            axes.update(plan.operand_shardings[(i, 1)].dims[2])
    return axes


@pytest.mark.parametrize(
    ("cp", "follow"),
    [(2, False), (2, True), (4, True)],
    ids=["cp2-apply", "cp2-follow", "cp4-follow"],
)
def test_hf_llama_context_parallel_matches_plain_model(examples, cp, follow) -> None:  # type: ignore[no-untyped-def]
    plan, model, inputs = _plan(examples, {"cp": cp})
    assert _query_axes(plan) == {"cp"}
    _check_numerics(plan, model, inputs, follow=follow, ranks=cp)


def test_hf_llama_cp2_with_tp2_matches_plain_model(examples) -> None:  # type: ignore[no-untyped-def]
    """Megatron projections pinned on tp; the queries split over cp (and, nested, tp)."""
    pins = {f"{ATTENTION}.{n}_proj.weight": sp.Sharding.of("tp", None) for n in "qkv"}
    pins[f"{ATTENTION}.o_proj.weight"] = sp.Sharding.of(None, "tp")
    plan, model, inputs = _plan(examples, {"cp": 2, "tp": 2}, pins)
    axes = _query_axes(plan)
    assert "cp" in axes
    _check_numerics(plan, model, inputs, follow=True, ranks=2 * len(axes))


def test_hf_gpt2_context_parallel_follows_absolute_positions(examples) -> None:  # type: ignore[no-untyped-def]
    """GPT-2: learned position embeddings read the positions' ``arange`` and the ids through a
    view; the balanced order must reach both (cp 2, loss and every gradient). One head, so
    attention can split only by its queries (an exact solve may split heads where it can)."""
    model, inputs = examples["hf_gpt2"].make(batch=1, seq=256, layers=1, heads=1)
    plan = sp.plan(model, *inputs, mesh=sp.Mesh({"cp": 2}, cluster="cpu-test"), time_limit=30)
    assert _query_axes(plan) == {"cp"}
    _check_numerics(plan, model, inputs, follow=True, ranks=2)
