"""Batch factors: found on every op that touches the batch, and capping their split holds."""

from __future__ import annotations

import pytest
import shardplan as sp
from shardplan.ir import Role
from shardplan.models import GPT_125M, LLAMA3_8B, training_step
from shardplan.solver.batch import batch_inputs, batch_marks, plan_batch_split
from shardplan.solver.planner import plan_graph


@pytest.mark.parametrize("config", [GPT_125M, LLAMA3_8B])
def test_batch_reaches_forward_backward_and_weight_gradients_but_no_state(config) -> None:
    graph = training_step(config, batch=4, layers=2, seq=128)
    marks = batch_marks(graph)
    assert {v.name for v in batch_inputs(graph)} >= {"batch_input_ids", "batch_labels"}
    assert not any(v.role is not Role.INPUT for v in graph.inputs if v in marks.dims)
    # every weight matmul (forward, input gradient, weight gradient) carries the batch
    dots = [i for i, op in enumerate(graph.ops) if op.kind in ("einsum", "dot_general", "matmul")]
    assert dots
    assert all(i in marks.factors for i in dots)
    # the optimizer update never does
    assert not any(i in marks.factors for i, op in enumerate(graph.ops) if op.kind == "adamw")


@pytest.mark.parametrize("cap", [1, 2, 4])
def test_capped_plan_never_splits_the_batch_wider_than_the_cap(cap: int) -> None:
    graph = training_step(GPT_125M, batch=8, layers=2, seq=256)
    plan = plan_graph(graph, sp.Mesh({"dp": 4}, cluster="h100-sxm"), batch_split_limit=cap)
    assert cap % plan_batch_split(plan) == 0
