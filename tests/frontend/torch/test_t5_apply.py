"""Hugging Face T5 with labels applied on (2, 4): loss and every gradient equal the plain model.

Covers issue 37.1 and 37.2 together: both ``relative_attention_bias`` tables split along their
rows over ``{dp, tp}`` and looked up with computed bucket ids (the position bias reaches
attention as a broadcast mask: ``local.py``'s gradient; ``lookup.py``'s masked lookup), and
the label shift's ``fill_`` (``fallback.py``) and slice writes (``view_writes.py``), under
``plan.apply`` alone and under ``follow_plan``.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import shardplan as sp
import torch
from shardplan.frontend.torch import simulate
from shardplan.frontend.torch.capture import capture
from shardplan.frontend.torch.follow import follow_plan
from shardplan.frontend.torch.train import step_loss
from shardplan.ir import Sharding
from shardplan.solver.planner import plan_graph
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

pytestmark = [pytest.mark.torch, pytest.mark.slow]


def test_t5_labels_row_split_bias_tables_match_plain_model() -> None:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(num_layers=1, num_decoder_layers=1, d_model=32, d_ff=64, num_heads=4,
                      d_kv=8, vocab_size=64, dropout_rate=0.0, decoder_start_token_id=0,
                      pad_token_id=0)  # fmt: skip
    model = T5ForConditionalGeneration(config)
    ids = torch.randint(1, 64, (8, 8))
    inputs = ({"input_ids": ids, "labels": ids},)
    mesh = sp.Mesh({"dp": 2, "tp": 4}, cluster="h100-sxm")
    graph, context = capture(model, *inputs, stamp_layers=False)
    tables = [f for f in context.param_values if f.endswith("relative_attention_bias.weight")]
    pins = {context.param_values[f]: Sharding(((("dp", "tp")), ())) for f in tables}
    plan = plan_graph(graph, mesh, pins=pins, time_limit=30, semantics=context.partial_semantics)
    plan = plan.with_context(context)
    reference = copy.deepcopy(model)
    loss = step_loss(reference, inputs)
    loss.backward()
    simulate.simulated_world(mesh.size)
    device_mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    for follow in (False, True):
        with simulate.local_ranks(mesh.size):
            sharded = plan.apply(copy.deepcopy(model), device_mesh)
            for fqn in tables:
                placements = sharded.get_parameter(fqn).placements
                assert placements == (Shard(0), Shard(0)), (fqn, placements)
            replay = follow_plan(plan, device_mesh) if follow else contextlib.nullcontext()
            with replay:
                got = step_loss(sharded, inputs)
                got.backward()
            grads = {n: simulate.rank0(p.grad) for n, p in sharded.named_parameters()}
        torch.testing.assert_close(simulate.rank0(got), loss.detach(), rtol=1e-4, atol=1e-7)
        for n, p in reference.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-7, msg=n)
