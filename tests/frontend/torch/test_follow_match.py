"""Matching run-time calls to traced ones (``frontend/torch/follow_match.py``).

A run-time operand whose IR value is unknown used to match any traced call of the same target.
SegFormer's eager backward sums a bias gradient over a 3-D ``[1, 1, C]`` shape where the trace
viewed it to 2-D first: the follower named that sum after the traced ``[1, C]`` one and moved
it to the traced value's layout (``Shard(1)`` of a size-1 dim), and the next ``view`` raised
DTensor's "would remove or reshape sharded dimension 1". Unknown DTensor operands now match
only at the traced value's global shape.
"""

from __future__ import annotations

import copy

import pytest
import shardplan as sp
import torch
from shardplan.frontend.torch import simulate
from shardplan.frontend.torch.capture import AtenStep
from shardplan.frontend.torch.emit import context_of
from shardplan.frontend.torch.follow import follow_plan
from shardplan.frontend.torch.follow_match import TraceMatcher
from torch.distributed.device_mesh import init_device_mesh

pytestmark = pytest.mark.torch

SUM = "aten.sum.dim_IntList"


def _matcher(deviations: list[str]) -> TraceMatcher:
    steps = [AtenStep(SUM, ("g2d",), ("s",), range(0, 1), "")]
    return TraceMatcher(steps, {}, set(), deviations, {"g2d": (64, 32), "s": (1, 32)})


def test_an_unknown_operand_matches_only_at_the_traced_shape() -> None:
    deviations: list[str] = []
    assert _matcher(deviations).match(SUM, [None], [(4, 16, 32)]) is None
    assert deviations == [f"call not in the trace: {SUM}"]
    assert _matcher([]).match(SUM, [None], [(64, 32)]) is not None
    assert _matcher([]).match(SUM, [None], [None]) is not None  # a plain tensor: not checked
    assert _matcher([]).match(SUM, ["g2d"], [(4, 16, 32)]) is not None  # a known value


def _segformer() -> tuple[torch.nn.Module, dict]:
    from transformers import SegformerConfig, SegformerForImageClassification

    torch.manual_seed(0)
    config = SegformerConfig(num_channels=3, num_encoder_blocks=2, depths=[1, 1],
                             sr_ratios=[2, 1], hidden_sizes=[16, 32], patch_sizes=[7, 3],
                             strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                             classifier_dropout_prob=0.0, drop_path_rate=0.0,
                             num_labels=4)  # fmt: skip
    inputs = {"pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.randint(0, 4, (4,))}
    return SegformerForImageClassification(config), inputs


@pytest.mark.slow
def test_followed_segformer_free_plan_equals_the_plain_model() -> None:
    """A family no other test uses, through the front door: the free plan (batch 4 on 8
    devices) shards parameters and activations; the reshard it needs broke the follower."""
    model, inputs = _segformer()
    model.config._attn_implementation = "sdpa"
    mesh = sp.Mesh({"dp": 8}, cluster="cpu-test")
    plan = sp.plan(model, **inputs, mesh=mesh)
    params = context_of(plan).param_values.values()
    assert any(any(plan.shardings[v].dims) for v in params), "no parameter is sharded"
    reference = copy.deepcopy(model)
    want = reference(**inputs).loss
    want.backward()
    simulate.simulated_world(mesh.size)
    device_mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    with simulate.local_ranks(mesh.size):
        sharded = plan.apply(copy.deepcopy(model), device_mesh)
        with follow_plan(plan, device_mesh):
            loss = sharded(**inputs).loss
            loss.backward()
        grads = {n: simulate.rank0(p.grad) for n, p in sharded.named_parameters()}
    torch.testing.assert_close(simulate.rank0(loss), want, rtol=1e-4, atol=1e-6)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
