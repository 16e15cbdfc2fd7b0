"""Capture: aten training-step graphs of nn.Modules lowered to the IR without unknown ops."""

from __future__ import annotations

import resource
import warnings

import pytest
import shardplan as sp
import torch
from shardplan.frontend.torch.capture import capture
from shardplan.ir import Role
from torch import nn

pytestmark = pytest.mark.torch


class TiedLM(nn.Module):
    """Embedding -> MLP -> logits through the same (tied) embedding matrix."""

    def __init__(self, vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.ReLU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.mlp(self.embed(ids)))


def _models(examples):  # type: ignore[no-untyped-def]
    yield "mlp", examples["torch_mlp"].make()
    yield "llama", examples["hf_llama"].make(batch=8)
    yield "gpt2", examples["hf_gpt2"].make(batch=8, layers=1)
    yield "tied", (TiedLM(), (torch.randint(0, 64, (8, 16)),))


@pytest.mark.parametrize("axes", [{"x": 8}, {"dp": 2, "tp": 4}], ids=["8", "2x4"])
def test_capture_models_plan_without_unknown_ops(examples, axes) -> None:  # type: ignore[no-untyped-def]
    """Llama, GPT-2, an MLP and a tied-embedding model plan with no UnsupportedOpWarning."""
    for name, (model, inputs) in _models(examples):
        with warnings.catch_warnings():
            warnings.simplefilter("error", sp.UnsupportedOpWarning)
            plan = sp.plan(model, *inputs, mesh=sp.Mesh(axes, cluster="cpu-test"), time_limit=10)
        placements = plan.to_placements()
        expected = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        assert set(placements) == expected, name
        assert all(len(p) == len(axes) for p in placements.values()), name


def test_capture_training_step_roles_and_aliases(examples) -> None:  # type: ignore[no-untyped-def]
    """Params, AdamW moments and inputs are tagged; updates alias the inputs they replace."""
    model, inputs = examples["torch_mlp"].make(batch=8, dim=4, hidden=8)
    graph, context = capture(model, *inputs)
    roles = [v.role for v in graph.inputs]
    assert roles.count(Role.PARAMETER) == 4
    assert roles.count(Role.OPTIMIZER_STATE) == 8
    assert roles.count(Role.INPUT) == 1
    assert set(context.grad_values) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    paths = {graph.inputs[i].origin.path for i in graph.output_aliases.values()}
    assert "fc1.weight" in paths
    assert "fc1.weight#exp_avg_sq" in paths
    assert len(graph.output_aliases) == 12
    assert graph.outputs[0].name == context.loss_value
    matmuls = [op for op in graph.ops if op.kind == "matmul"]
    assert len(matmuls) == 5  # 2 forward, 2 weight grads, 1 input grad of fc2 (x needs none)
    assert {op.origin.module for op in matmuls[:2]} == {"fc1", "fc2"}


def test_capture_frozen_parameter_has_no_gradient_or_update(examples) -> None:  # type: ignore[no-untyped-def]
    """A parameter with ``requires_grad=False`` (Whisper's encoder positions) gets no gradient
    and no update: its weight-gradient matmul is not in the step (it was, and the plan priced
    an all-reduce the run never made)."""
    model, inputs = examples["torch_mlp"].make(batch=8, dim=4, hidden=8)
    model.fc1.weight.requires_grad_(False)
    graph, context = capture(model, *inputs)
    assert set(context.grad_values) == {"fc1.bias", "fc2.weight", "fc2.bias"}
    paths = {graph.inputs[i].origin.path for i in graph.output_aliases.values()}
    assert "fc1.weight" not in paths
    assert "fc2.weight" in paths
    assert len(graph.output_aliases) == 9  # 3 parameters and their 2 AdamW moments each
    assert len([op for op in graph.ops if op.kind == "matmul"]) == 4  # fc1's weight grad gone


def test_capture_inference_mode_is_forward_only(examples) -> None:  # type: ignore[no-untyped-def]
    model, inputs = examples["torch_mlp"].make(batch=8, dim=4, hidden=8)
    graph, _ = capture(model, *inputs, mode="inference")
    assert [op.kind for op in graph.ops if op.kind == "matmul"] == ["matmul", "matmul"]
    assert not graph.output_aliases
    assert not any(v.role is Role.OPTIMIZER_STATE for v in graph.inputs)


def test_capture_sgd_has_no_states(examples) -> None:  # type: ignore[no-untyped-def]
    model, inputs = examples["torch_mlp"].make(batch=8, dim=4, hidden=8)
    graph, _ = capture(model, *inputs, optimizer="sgd")
    assert not any(v.role is Role.OPTIMIZER_STATE for v in graph.inputs)
    assert len(graph.output_aliases) == 4


def test_capture_meta_model_allocates_nothing(examples) -> None:  # type: ignore[no-untyped-def]
    """A Llama with ~0.9 B parameters captured from meta tensors stays far below its size."""
    model, inputs = examples["hf_llama"].make(
        batch=1, seq=64, hidden=2048, layers=16, heads=16, kv_heads=8, vocab=32000, device="meta"
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    graph, _ = capture(model, *inputs)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    params = sum(v.type.nbytes for v in graph.inputs if v.role is Role.PARAMETER)
    assert params > 2.5e9
    assert grown_mib < 1000


def test_capture_unknown_op_warns_with_module_path() -> None:
    class Flipper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.flip(self.proj(x), dims=[0])

    model = nn.Sequential(Flipper())
    with pytest.warns(sp.UnsupportedOpWarning, match=r"'flip'.*at 0 "):
        graph, _ = capture(model, torch.randn(2, 4))
    assert any(op.kind == "aten.flip" for op in graph.ops)
    plan = sp.plan(model, torch.randn(2, 4), mesh=sp.Mesh({"x": 2}, cluster="cpu-test"))
    assert plan.to_placements()


def test_capture_custom_loss_fn(examples) -> None:  # type: ignore[no-untyped-def]
    model, (x,) = examples["torch_mlp"].make(batch=8, dim=4, hidden=8)
    graph, _ = capture(model, x, loss_fn=lambda out, x: (out - x).abs().sum())
    assert any(op.kind == "abs" for op in graph.ops)


def test_capture_attention_dropout_is_the_fused_kernel() -> None:
    """A GPU runs attention dropout inside flash attention; the CPU trace must not fall back to
    the math path (score matrices, softmax, dropout as ops) that the cost model prices unfused."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=16,
                        attn_pdrop=0.1)  # fmt: skip
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (2, 16))
    graph, _ = capture(model, {"input_ids": ids, "labels": ids})
    kinds = [op.kind for op in graph.ops]
    assert kinds.count("attention") == 1
    assert "softmax" not in kinds  # the loss uses log_softmax; scores would add softmax
