"""``use_fused_rms_norm``: HF RMSNorms traced as one fused row kernel, priced as one, and a plan
captured with them applies and trains like the plain HF model."""

from __future__ import annotations

import collections
import copy
import warnings

import pytest
import shardplan as sp
import torch
from applied import check_numerics
from shardplan.frontend.torch.norms import rms_norm_fused, use_fused_rms_norm

pytestmark = pytest.mark.torch

VOCAB = 64


def _qwen3(device: str = "cpu"):  # type: ignore[no-untyped-def]
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen3ForCausalLM(config)


def test_the_fused_ops_compute_hf_rms_norm_and_its_gradients() -> None:
    x = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm_fused(x, w, 1e-6)[0], (x, w))
    model, fused = _qwen3(), _qwen3()
    assert use_fused_rms_norm(fused) == 2 * 4 + 1  # per layer: 2 norms + q_norm + k_norm
    ids = torch.randint(0, VOCAB, (2, 8))
    for m in (model, fused):
        m(input_ids=ids, labels=ids).loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), fused.named_parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_non_rms_formula_is_left_alone() -> None:
    class ShiftedRMSNorm(torch.nn.Module):  # Gemma's form: (1 + weight)
        def __init__(self) -> None:
            super().__init__()
            self.weight, self.eps = torch.nn.Parameter(torch.zeros(8)), 1e-6

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)

    assert use_fused_rms_norm(torch.nn.Sequential(ShiftedRMSNorm())) == 0
    from transformers import Gemma2Config, Gemma2ForCausalLM, Olmo2Config, Olmo2ForCausalLM

    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gemma = Gemma2ForCausalLM(Gemma2Config(**small, head_dim=8))  # 1 + weight
        olmo = Olmo2ForCausalLM(Olmo2Config(**small))  # the weight multiplied before the cast
    assert use_fused_rms_norm(gemma) == use_fused_rms_norm(olmo) == 0


def test_a_non_module_is_a_clear_error() -> None:
    from shardplan.ir.errors import ArgumentError

    with pytest.raises(ArgumentError, match=r"takes a torch\.nn\.Module, got str"):
        use_fused_rms_norm("Qwen/Qwen3-0.6B")


def test_t5s_layer_norm_is_an_rms_norm_and_is_switched() -> None:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=VOCAB, d_model=32, d_ff=64, num_layers=1, num_heads=4, d_kv=8,
                      decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)  # fmt: skip
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config)
    fused = copy.deepcopy(model)
    assert use_fused_rms_norm(fused) == 7  # 2 encoder + 3 decoder sublayers, 2 final norms
    ids = torch.randint(0, VOCAB, (2, 8))
    for m in (model, fused):
        m(input_ids=ids, labels=ids).loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), fused.named_parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


def _evaluate(model, batch: int = 8, seq: int = 64):  # type: ignore[no-untyped-def]
    ids = torch.zeros((batch, seq), dtype=torch.long, device="meta")
    mesh = sp.Mesh({"dp": 2, "tp": 2}, cluster="h100-sxm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sp.evaluate(model, {"input_ids": ids, "labels": ids}, mesh=mesh,
                           strategy=sp.strategies.megatron("tp"))  # fmt: skip


def test_fused_norms_capture_as_row_kernels_and_cost_less() -> None:
    plain, fused = _qwen3("meta"), _qwen3("meta")
    use_fused_rms_norm(fused)
    ev_plain, ev_fused = _evaluate(plain), _evaluate(fused)
    kinds = collections.Counter(op.kind for op in ev_fused.plan.graph.ops)
    assert kinds["rms_norm"] == kinds["rms_norm_backward"] == 9
    assert kinds["pow"] == 0
    assert kinds["rsqrt"] == 0
    assert collections.Counter(op.kind for op in ev_plain.plan.graph.ops)["rms_norm"] == 0
    # one read of x and one write of y per norm, where HF's chain writes an fp32 copy
    assert ev_fused.plan.compute_time < ev_plain.plan.compute_time


@pytest.mark.parametrize(("kind", "follow"), [("megatron", False), ("free", False), ("free", True)],
                         ids=["megatron-apply", "free-apply", "free-follow_plan"])  # fmt: skip
def test_a_plan_with_fused_norms_applies_and_matches_hf(kind: str, follow: bool) -> None:
    """Under ``follow_plan`` every op runs at its planned layout: the fused norms' included, no
    deviation. (``megatron("tp")`` is checked under ``apply`` only: HF's embedding gradient
    deviates from that strategy's vocab-parallel layout under ``follow_plan`` with HF's own
    norms too.)"""
    model = _qwen3()
    reference = copy.deepcopy(model)  # HF's own norms
    use_fused_rms_norm(model)
    ids = torch.randint(0, VOCAB, (16, 32))  # enough work that the free plan splits the norms
    inputs = ({"input_ids": ids, "labels": ids},)
    mesh = sp.Mesh({"dp": 2, "tp": 2}, cluster="cpu-test")
    if kind == "megatron":
        plan = sp.evaluate(model, *inputs, mesh=mesh, strategy=sp.strategies.megatron("tp")).plan
    else:
        plan = sp.plan(model, *inputs, mesh=mesh, time_limit=10)
    norms = [i for i, op in enumerate(plan.graph.ops) if op.kind.startswith("rms_norm")]
    split = [i for i in norms if any(plan.operand_shardings[(i, 0)].dims)]
    assert split, "no fused norm runs on split rows: the check would prove nothing"
    applied = check_numerics(plan, model, inputs, follow=follow, reference=reference)
    assert not applied.deviations


def test_an_expert_parallel_moe_plan_with_fused_norms_follows_and_matches_hf() -> None:
    """The bench's configuration in small: a Mixtral with fused norms, its experts split over
    ``ep`` (all-to-all dispatch), run under ``follow_plan``: HF eager's loss and gradients."""
    from moe_models import BATCH, SEQ, tiny_mixtral
    from moe_models import VOCAB as MOE_VOCAB

    model = tiny_mixtral()
    reference = copy.deepcopy(model)
    reference.config._experts_implementation = "eager"  # HF's own experts loop and norms
    assert use_fused_rms_norm(model) == 3
    ids = torch.randint(0, MOE_VOCAB, (BATCH, SEQ))
    inputs = ({"input_ids": ids, "labels": ids},)
    mesh = sp.Mesh({"dp": 2, "ep": 4}, cluster="cpu-test")
    plan = sp.evaluate(model, *inputs, mesh=mesh, strategy=sp.strategies.expert_parallel("ep")).plan
    norms = [i for i, op in enumerate(plan.graph.ops) if op.kind.startswith("rms_norm")]
    assert any(any(plan.operand_shardings[(i, 0)].dims) for i in norms)
    assert any(r.collectives and r.collectives[0].kind == "all-to-all" for r in plan.reshards)
    applied = check_numerics(plan, model, inputs, follow=True, reference=reference)
    assert not applied.deviations
