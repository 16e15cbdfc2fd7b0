"""Mixture-of-experts capture (frontend/torch/moe.py, ir/moe.py) on a tiny HF Mixtral.

- the ``"shardplan"`` experts implementation computes what HF's eager experts compute (loss and
  every gradient), and its custom ops' gradients are right (gradcheck, with dropped tokens);
- the model captures with no unknown op, and plans on ``{"dp": 2, "ep": 4}`` with the expert
  weights split over ``ep`` on the expert dim.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import shardplan as sp
import torch
from moe_models import BATCH, SEQ, VOCAB, tiny_mixtral
from shardplan.frontend.torch import moe
from shardplan.frontend.torch.capture import capture
from shardplan.frontend.torch.train import step_loss
from shardplan.ir import UnsupportedOpWarning

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def inputs() -> tuple:
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return ({"input_ids": ids, "labels": ids},)


def _loss_and_grads(model: torch.nn.Module, inputs: tuple) -> tuple[torch.Tensor, dict]:
    loss = step_loss(model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.detach() for n, p in model.named_parameters()}


def _qwen2_moe() -> torch.nn.Module:
    """Shared experts next to the routed ones (and a sigmoid-gated shared expert)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    return model


@pytest.mark.parametrize("build", [tiny_mixtral, _qwen2_moe], ids=["mixtral", "qwen2_moe"])
def test_dispatch_equals_hf_eager_experts(inputs: tuple, build) -> None:  # type: ignore[no-untyped-def]
    eager = build()
    eager.config._experts_implementation = "eager"
    ours = copy.deepcopy(eager)
    assert moe.use_dispatch(ours, groups=4) == 1  # one layer: one experts module
    loss, grads = _loss_and_grads(eager, inputs)
    our_loss, our_grads = _loss_and_grads(ours, inputs)
    torch.testing.assert_close(our_loss, loss, rtol=1e-5, atol=1e-6)
    assert set(our_grads) == set(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_custom_op_gradients_with_dropped_tokens() -> None:
    torch.manual_seed(2)
    g, s, k, e, h = 2, 5, 2, 3, 4
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(g * s)]).reshape(g, s, k)
    x = torch.randn(g, s, h, dtype=torch.float64, requires_grad=True)
    w = torch.rand(g, s, k, dtype=torch.float64, requires_grad=True)
    slots = moe.capacity(s, k, e, capacity_factor=0.8)  # 3 slots for ~3.3 tokens: drops
    assert slots == 3

    def layer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xe = moe.moe_dispatch(x, idx, None, e, slots)
        return moe.moe_combine(torch.tanh(xe), idx, w)

    assert torch.autograd.gradcheck(layer, (x, w))
    kept = (layer(x, w) != 0).any(-1)
    assert not kept.all()  # some token lost every choice it made, or at least one: dropped


@pytest.fixture(scope="module")
def captured(inputs: tuple):  # type: ignore[no-untyped-def]
    model = tiny_mixtral()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsupportedOpWarning)
        graph, context = capture(model, *inputs, stamp_layers=False)
    return graph, context


def test_capture_lowers_routing_and_expert_ops(captured) -> None:  # type: ignore[no-untyped-def]
    graph, _ = captured
    kinds = [op.kind for op in graph.ops]
    for kind in ("topk", "moe_dispatch", "moe_combine", "moe_combine_wgrad"):
        assert kind in kinds, kind
    assert not [k for k in kinds if k.startswith("aten.")]
    dispatch = next(op for op in graph.ops if op.kind == "moe_dispatch")
    # dropless: every one of a group's BATCH * SEQ / 64 tokens has a slot in every expert
    assert dispatch.attrs == {"experts": 8, "capacity": BATCH * SEQ // 64}


def test_plan_splits_experts_over_ep(captured) -> None:  # type: ignore[no-untyped-def]
    graph, _ = captured
    # cpu-test: on an H100 a model this small runs at the kernel floor and splits nothing
    mesh = sp.Mesh({"dp": 2, "ep": 4}, cluster="cpu-test")
    plan = sp.plan(graph, mesh=mesh, time_limit=60)
    assert any(c.kind == "all-to-all" and c.axes == ("ep",) for c in plan.collectives())
    layouts = {k: v for k, v in plan.parameter_shardings().items() if "experts" in k}
    assert layouts
    for name, sharding in layouts.items():
        assert "ep" in sharding.dims[0], (name, sharding)


def test_expert_parallel_baselines_pin_the_expert_dim(captured) -> None:  # type: ignore[no-untyped-def]
    graph, _ = captured
    mesh = sp.Mesh({"ep": 4, "tp": 2}, cluster="h100-sxm")
    experts = {v.origin.path: v.name for v in graph.inputs if "experts" in v.origin.path}
    experts = {p: n for p, n in experts.items() if "#" not in p}  # parameters, not states
    assert set(experts) == {"model.layers.0.mlp.experts.gate_up_proj",
                            "model.layers.0.mlp.experts.down_proj"}  # fmt: skip
    over_data = sp.strategies.expert_parallel().pins(graph, mesh)  # data axes: ep and tp here
    ep_tp = sp.strategies.expert_parallel("ep", tp="tp").pins(graph, mesh)
    gate_up, down = (
        experts[f"model.layers.0.mlp.experts.{n}"] for n in ("gate_up_proj", "down_proj")
    )
    assert over_data[gate_up].dims == (("ep", "tp"), (), ())
    # gate_up [E, 2F, H] is column-parallel on its output features, down [E, H, F] row-parallel
    assert ep_tp[gate_up].dims == (("ep",), ("tp",), ())
    assert ep_tp[down].dims == (("ep",), (), ("tp",))
    # EP folded over tp (Megatron-Core's expert TP 1): whole experts over (ep, tp), while the
    # attention keeps its tp split
    folded = sp.strategies.expert_parallel(("ep", "tp"), tp="tp").pins(graph, mesh)
    assert folded[gate_up].dims == folded[down].dims == (("ep", "tp"), (), ())
    q = next(
        v.name for v in graph.inputs if v.origin.path == "model.layers.0.self_attn.q_proj.weight"
    )
    assert folded[q].dims == ep_tp[q].dims == (("tp",), ())
    zero = sp.strategies.expert_parallel("ep", shard_states=True).pins(graph, mesh)
    state = next(n for p, n in ((v.origin.path, v.name) for v in graph.inputs)
                 if p.startswith("model.layers.0.mlp.experts.down_proj#"))  # fmt: skip
    assert zero[state].dims[0] == ("ep",)
    assert "tp" in sum(zero[state].dims, ())


def test_plan_is_held_to_the_expert_parallel_baselines(captured) -> None:  # type: ignore[no-untyped-def]
    """The strategies ``sp.plan`` warm-starts from and must not be slower than (memory-bound
    seed, fallback) include the EP ones for a MoE graph, and only for one."""
    from shardplan.ir.models import TransformerConfig, training_step

    graph, _ = captured
    mesh = sp.Mesh({"dp": 2, "ep": 4}, cluster="h100-sxm")
    names = [s.name for s in sp.strategies.for_graph(graph, mesh)]
    assert {"ep[ep]", "ep[ep]-zero1", "ep[data]-fsdp"} <= set(names)
    assert set(names) >= {s.name for s in sp.strategies.baselines(mesh)}
    dense = training_step(TransformerConfig("tiny", 1, 64, 4, 128, 256, 16), batch=4)
    assert not [n for n in (s.name for s in sp.strategies.for_graph(dense, mesh)) if "ep[" in n]
