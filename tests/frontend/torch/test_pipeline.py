"""Pipeline emitter: split points and schedule from a pp plan; a 2-stage gloo run matches."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import shardplan as sp
import torch
from shardplan.frontend.torch.gloo import load_factory, run_pipeline_on_gloo
from shardplan.frontend.torch.pipeline import pipeline_schedule, pipeline_spec
from torch.distributed.pipelining import SplitPoint
from torch.distributed.pipelining.schedules import Schedule1F1B
from torch.distributed.tensor import Replicate

pytestmark = pytest.mark.torch

FACTORY = str(Path(__file__).resolve().parents[3] / "examples" / "hf_llama.py") + ":make"
SHAPES = {"batch": 4, "seq": 8, "hidden": 32, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 64}


def assert_pipelined_step_matches(spec, model, inputs, shapes) -> None:  # type: ignore[no-untyped-def]
    """One pipelined step of ``spec`` on gloo gives the plain model's loss and every gradient
    (micro-batch means, averaged by ``scale_grads``), rtol 1e-4."""
    reference = copy.deepcopy(model)
    ref_loss = reference(**inputs).loss
    ref_loss.backward()
    result = run_pipeline_on_gloo(spec, FACTORY, **shapes)
    torch.testing.assert_close(result["loss"], ref_loss.detach(), rtol=1e-4, atol=1e-6)
    assert set(result["grads"]) == {n for n, _ in reference.named_parameters()}
    for name, p in reference.named_parameters():
        torch.testing.assert_close(result["grads"][name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def pp_plan():  # type: ignore[no-untyped-def]
    model, inputs = load_factory(FACTORY)(**SHAPES)
    plan = sp.plan(
        model, *inputs, mesh=sp.Mesh({"pp": 2}, cluster="cpu-test"), microbatches=2, time_limit=10
    )
    return plan, model, inputs


def test_pipeline_split_spec_one_point_per_stage_boundary(pp_plan) -> None:  # type: ignore[no-untyped-def]
    plan = pp_plan[0]
    assert [s.layers for s in plan.pipeline.stages] == [(0,), (1,)]
    assert plan.pipeline_split_spec() == {"model.layers.1": SplitPoint.BEGINNING}
    assert pipeline_schedule(plan) == (Schedule1F1B, 2)


def test_pipeline_spec_refuses_a_plan_without_stages(examples) -> None:  # type: ignore[no-untyped-def]
    model, inputs = examples["torch_mlp"].make(batch=8, dim=8, hidden=16)
    plan = sp.plan(model, *inputs, mesh=sp.Mesh({"dp": 2}, cluster="cpu-test"))
    with pytest.raises(sp.ShardplanError, match='axis named "pp"'):
        pipeline_spec(plan)


@pytest.mark.slow
def test_two_stage_pipeline_on_gloo_matches_plain_model(pp_plan) -> None:  # type: ignore[no-untyped-def]
    """Schedule1F1B over 2 gloo ranks: mean micro-batch loss and gradients (averaged over
    micro-batches by scale_grads) equal the unpipelined model's loss and gradients."""
    plan, model, (inputs,) = pp_plan
    assert_pipelined_step_matches(pipeline_spec(plan), model, inputs, SHAPES)


@pytest.mark.slow
def test_tensor_parallel_stages_on_gloo_match_plain_model() -> None:
    """2 stages x tp=2 on 4 gloo ranks: each stage's parameters are DTensors split over its
    tp pair as planned; loss and every gradient equal the unpipelined model's. The MLPs are
    pinned Megatron-style (the free plan of so small a model may well replicate them)."""
    model, (inputs,) = load_factory(FACTORY)(**SHAPES)
    pins = {}
    for layer in range(SHAPES["layers"]):
        mlp = f"model.layers.{layer}.mlp"
        pins[f"{mlp}.gate_proj.weight"] = pins[f"{mlp}.up_proj.weight"] = sp.Sharding.of("tp", None)
        pins[f"{mlp}.down_proj.weight"] = sp.Sharding.of(None, "tp")
    mesh = sp.Mesh({"pp": 2, "tp": 2}, cluster="cpu-test")
    plan = sp.plan(model, inputs, mesh=mesh, microbatches=2, pins=pins, time_limit=10)
    spec = pipeline_spec(plan)
    assert spec.stage_mesh == (("tp", 2),)
    split = [fqn for fqn, placements in spec.placements if placements != (Replicate(),)]
    assert any(".layers." in fqn for fqn in split), spec.placements  # TP inside the stages
    assert_pipelined_step_matches(spec, model, inputs, SHAPES)


@pytest.mark.slow
def test_interleaved_pipeline_on_gloo_matches_plain_model() -> None:
    """schedule="interleaved": each of 2 gloo ranks runs two model chunks (virtual stages r and
    r + 2) under ScheduleInterleaved1F1B; loss and every gradient equal the plain model's."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    shapes = {**SHAPES, "layers": 4}
    model, (inputs,) = load_factory(FACTORY)(**shapes)
    plan = sp.plan(model, inputs, mesh=sp.Mesh({"pp": 2}, cluster="cpu-test"), microbatches=2,
                   schedule="interleaved", time_limit=10)  # fmt: skip
    spec = pipeline_spec(plan)
    assert (spec.schedule, spec.chunks) == ("interleaved", 2)
    assert spec.stage_layers == ((0,), (1,), (2,), (3,))
    assert [spec.rank_stages(rank) for rank in (0, 1)] == [(0, 2), (1, 3)]
    assert pipeline_schedule(plan) == (ScheduleInterleaved1F1B, 2)
    assert_pipelined_step_matches(spec, model, inputs, shapes)


def test_flattened_hf_loss_splits_tokens_within_a_micro_batch(examples) -> None:  # type: ignore[no-untyped-def]
    """HF's loss flattens the logits to ``((b s), V)``. Under a pipeline's batch cap the
    whole-batch sub-mesh solve used to split that merged dim at most ``cap`` ways (its major
    factor is the batch), and no reshape could split ``s`` under an unsplit ``b``: the loss
    activations of 2 x 16K tokens x 32K vocab did not fit 4 GiB on the 4-device stage mesh
    (InfeasiblePlanError). On a micro-batch of ``cap`` samples ``b`` is fully split at ``cap``,
    so ``s`` may be split further; such a plan runs on micro-batches of exactly that size."""
    batch, seq, vocab = 2, 16384, 32000
    model, (inputs,) = examples["hf_llama"].make(
        batch=batch, seq=seq, hidden=64, layers=4, vocab=vocab, device="meta"
    )
    mesh = sp.Mesh({"pp": 2, "dp": 2, "tp": 2}, cluster="h100-sxm")
    plan = sp.plan(model, inputs, mesh=mesh, memory_limit="2GiB", time_limit=10)
    from shardplan.solver.batch import microbatch_fits

    m = plan.pipeline.microbatches
    micro = batch // m
    assert microbatch_fits(plan, micro)
    graph = plan.graph
    loss = [i for i, op in enumerate(graph.ops) if op.kind == "log_softmax"]
    assert loss
    for i in loss:
        rows = plan.operand_shardings[(i, 0)].dims[0]
        split = mesh.group_size(rows)
        assert split > micro  # the tokens of one micro-batch, split past its samples
        local = graph.ops[i].results[0].type.nbytes // split
        assert local == batch * seq * vocab * 4 // split  # priced at that split (f32 logits)
    # such a plan runs on no other micro-batch size: the micro-batch count is forced
    assert not any(microbatch_fits(plan, size) for size in (1, 2) if size != micro)
    # a loaded plan has no strategies: its splits read back from the layouts say the same
    plan = dataclasses.replace(plan, assignments={})
    assert [microbatch_fits(plan, size) for size in (1, 2)] == [size == micro for size in (1, 2)]
    assert [s.layers for s in plan.pipeline.stages] in ([(0, 1), (2, 3)], [(0,), (1, 2, 3)],
                                                         [(0, 1, 2), (3,)])  # fmt: skip


def test_whole_batch_cap_keeps_merged_token_splits_within_the_cap(examples) -> None:  # type: ignore[no-untyped-def]
    """The fallback space (``cap_batch_split(micro=False)``) is the cap before micro-batch
    sizes: every batch factor, a merged ``(b s)`` too, split over a divisor of the cap; with
    micro-batch sizes (``micro_rules``) the merged tokens may be split past it."""
    from shardplan.frontend.torch.capture import capture
    from shardplan.solver.batch import batch_marks, cap_batch_split, micro_rules
    from shardplan.solver.costs import build_space

    model, (inputs,) = examples["hf_llama"].make(batch=2, seq=64, layers=1, device="meta")
    captured = capture(model, inputs)
    graph = captured[0] if isinstance(captured, tuple) else captured
    mesh = sp.Mesh({"dp": 2, "tp": 2}, cluster="h100-sxm")
    marks = batch_marks(graph).factors
    merged = [i for i, found in marks.items()
              if any(n > 2 for f, n in graph.ops[i].rule.sizes if f in found)]  # fmt: skip
    assert merged  # HF flattens the tokens: (b s) factors carry the batch

    def widest(space, ops) -> int:  # type: ignore[no-untyped-def]
        splits = [
            mesh.group_size(axes)
            for i in ops
            for s in space.strategies[space.op_node(i)]
            for f, axes in s.assignment
            if f in marks[i]
        ]
        return max(splits, default=1)

    whole = build_space(graph, mesh)
    cap_batch_split(whole, 1, micro=False)
    assert widest(whole, marks) == 1
    micro = build_space(graph, mesh, rules=micro_rules(graph, 1))
    cap_batch_split(micro, 1)
    assert widest(micro, merged) == 4
