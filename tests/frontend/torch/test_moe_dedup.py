"""The DeepEP dispatcher's pricing (``frontend.torch.moe.dispatcher("deepep")``): captured under
it, the MoE ops carry ``dedup``, and the plan's expert all-to-alls move ``distinct ranks /
top_k`` of the slot buffer's bytes (``ir.moe.wire_type``), so the same EP layout is cheaper."""

from __future__ import annotations

import math
import warnings

import pytest
import shardplan as sp
import torch
from shardplan.costmodel import reshard
from shardplan.costmodel.cluster import cluster_of
from shardplan.frontend.torch import moe
from shardplan.ir.errors import ArgumentError
from shardplan.ir.moe import dedup_buffers, distinct_ranks

pytestmark = pytest.mark.torch

EXPERTS, TOP_K = 16, 4


def _model() -> torch.nn.Module:
    """HF Mixtral with 16 experts, top-4: 4 experts a rank on ``ep`` 4, so a token's 4 picks
    often share a rank (2.91 ranks of 4 on average)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    return model


def _evaluate(name: str):  # type: ignore[no-untyped-def]
    ids = torch.zeros((64, 64), dtype=torch.long)
    mesh = sp.Mesh({"dp": 2, "ep": 4}, cluster="h100-sxm")
    with warnings.catch_warnings(), moe.dispatcher(name):
        warnings.simplefilter("ignore")
        strategy = sp.strategies.expert_parallel("ep")
        return sp.evaluate(_model(), {"input_ids": ids, "labels": ids}, mesh=mesh,
                           strategy=strategy, memory_limit=math.inf)  # fmt: skip


@pytest.fixture(scope="module")
def plans():  # type: ignore[no-untyped-def]
    return {name: _evaluate(name).plan for name in ("gshard", "deepep")}


def _expert_all_to_alls(plan) -> list:  # type: ignore[no-untyped-def]
    buffers = dedup_buffers(plan.graph)
    return [r for r in plan.reshards if plan.graph.value(r.value) in buffers
            and any(c.kind == "all-to-all" and "ep" in c.axes for c in r.collectives)]  # fmt: skip


def test_the_deepep_capture_marks_its_moe_ops(plans) -> None:  # type: ignore[no-untyped-def]
    kinds = ("moe_dispatch", "moe_combine", "moe_combine_wgrad")
    marked = {n: [op.attrs.get("dedup") for op in p.graph.ops if op.kind in kinds]
              for n, p in plans.items()}  # fmt: skip
    assert marked["deepep"]
    assert all(marked["deepep"])
    assert marked["gshard"]
    assert not any(marked["gshard"])
    assert not dedup_buffers(plans["gshard"].graph)
    assert moe.DISPATCHER == "gshard"  # the block restored it


def test_expert_all_to_alls_move_the_deduplicated_bytes(plans) -> None:  # type: ignore[no-untyped-def]
    plan = plans["deepep"]
    moves = _expert_all_to_alls(plan)
    assert moves, "an EP plan moves its dispatch buffers by all-to-all over ep"
    ratio = distinct_ranks(EXPERTS, TOP_K, 4) / TOP_K
    cluster = cluster_of(plan.mesh)
    for r in moves:
        full = reshard(r.src, r.dst, plan.graph.value(r.value).type, plan.mesh, cluster)
        sent = sum(c.bytes for c in r.collectives if c.kind == "all-to-all")
        whole = sum(c.bytes for c in full if c.kind == "all-to-all")
        assert sent == pytest.approx(ratio * whole, rel=0.1), (r.value, r.src, r.dst)
    gshard = sum(r.time for r in _expert_all_to_alls(plans["gshard"]))
    assert gshard == 0  # no buffer is marked without the dispatcher
    assert sum(r.time for r in moves) < sum(
        sum(c.time for c in reshard(r.src, r.dst, plan.graph.value(r.value).type, plan.mesh,
                                    cluster)) for r in moves
    )  # fmt: skip


def test_an_unknown_dispatcher_is_refused() -> None:
    with (
        pytest.raises(ArgumentError, match="unknown MoE dispatcher 'nccl'"),
        moe.dispatcher("nccl"),
    ):
        pass
