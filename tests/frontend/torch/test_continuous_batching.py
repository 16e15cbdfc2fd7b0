"""Continuous batching's throughput regime: ``sp.plan(..., mode="decode", latency_bound=...)``.

The batch found is the largest whose decode step meets the bound and whose KV cache fits (one
more sequence misses the bound or does not fit), it grows with the bound, its tokens/s are
``batch / step``, and a bound that even one sequence misses is refused naming the least latency.
"""

from __future__ import annotations

import pytest
import shardplan as sp
import torch
from shardplan.ir import InfeasiblePlanError
from shardplan.ir.errors import ArgumentError

pytestmark = pytest.mark.torch

CONTEXT = 4096
MESH = sp.Mesh({"tp": 1}, cluster="h100-sxm")


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * CONTEXT,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _ids(batch: int) -> torch.Tensor:
    return torch.zeros((batch, 1), dtype=torch.long)


def _step(tiny: torch.nn.Module, batch: int, **options: object) -> float:
    """Seconds of the decode step planned at exactly ``batch``."""
    plan = sp.plan(tiny, _ids(batch), mesh=MESH, mode="decode", context_len=CONTEXT, **options)
    return plan.step_time


def _bounded(tiny: torch.nn.Module, bound: float, **options: object) -> sp.Plan:
    return sp.plan(tiny, _ids(1), mesh=MESH, mode="decode", context_len=CONTEXT,
                   latency_bound=bound, **options)  # fmt: skip


@pytest.fixture(scope="module")
def least(tiny) -> float:  # type: ignore[no-untyped-def]
    """The decode step of one sequence: the least latency the mesh reaches."""
    return _step(tiny, 1)


@pytest.fixture(scope="module")
def bounded(tiny, least) -> sp.Plan:  # type: ignore[no-untyped-def]
    return _bounded(tiny, 1.6 * least)


def test_the_batch_is_the_largest_that_meets_the_bound(tiny, least, bounded) -> None:
    bound, plan = 1.6 * least, bounded
    report = plan.serving
    assert report.objective == "throughput"
    assert report.latency_bound == bound
    assert report.batch > 1
    assert plan.step_time <= bound
    assert _step(tiny, report.batch + 1) > bound  # one more sequence misses it
    assert report.tokens_per_second == pytest.approx(report.batch / plan.step_time)
    assert f"meets the {bound * 1e3:.3f} ms bound" in report.reason
    tried = {c.batch for c in report.candidates}
    assert {1, report.batch, report.batch + 1} <= tried  # the bisection saw both sides


def test_the_batch_grows_with_the_bound(tiny, least, bounded) -> None:
    tighter = _bounded(tiny, 1.2 * least)
    assert 1 <= tighter.serving.batch < bounded.serving.batch
    assert tighter.serving.tokens_per_second < bounded.serving.tokens_per_second


def test_memory_stops_the_batch_before_a_loose_bound(tiny) -> None:
    plan = _bounded(tiny, 1.0, memory_limit="64MiB")  # a second per token: memory binds
    batch = plan.serving.batch
    assert batch > 1
    assert plan.peak_memory_bytes <= 64 * 2**20
    assert "does not fit" in plan.serving.reason
    with pytest.raises(InfeasiblePlanError):
        _step(tiny, batch + 1, memory_limit="64MiB")


def test_max_batch_caps_the_search(tiny) -> None:
    plan = _bounded(tiny, 1.0, max_batch=6)
    assert plan.serving.batch == 6
    assert max(c.batch for c in plan.serving.candidates) == 6
    assert "max_batch" in plan.serving.reason


def test_a_bound_even_batch_one_misses_names_the_least_latency(tiny, least) -> None:
    with pytest.raises(InfeasiblePlanError, match=rf"even batch 1 takes {least * 1e3:.3f} ms"):
        _bounded(tiny, least / 2)


def test_latency_bound_arguments_are_checked(tiny) -> None:
    with pytest.raises(ArgumentError, match="latency_bound"):
        _bounded(tiny, 0.0)
    with pytest.raises(ArgumentError, match="latency_bound"):
        _bounded(tiny, float("inf"))
    with pytest.raises(ArgumentError, match="objective='throughput'"):
        _bounded(tiny, 0.01, objective="latency")
    with pytest.raises(ArgumentError, match="mode='decode'"):
        sp.plan(tiny, _ids(1), mesh=MESH, latency_bound=0.01)
