"""Calling conventions at every entry point: ``**kwargs`` forwards, ``sp.evaluate`` and
``sp.whatif`` bound like ``sp.plan``, and the idle-devices finding saved with the plan.

- A keyword that no ``forward`` parameter names goes to ``**kwargs``; when the traced step
  never reads it (a misspelt name Hugging Face's ``**kwargs`` drops on the way), capture
  refuses it, naming it; one the model reads is an input like any other.
- ``sp.plan``, ``sp.evaluate`` and ``sp.whatif`` take the example call in the same forms
  (positional, keyword, mixed, one dict, pytrees, ``loss_inputs=``) and bind the same graph
  inputs.
- ``plan.idle`` (``solver/idle.py``) travels with ``plan.save`` / ``sp.load_plan``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TypedDict, Unpack

import pytest
import shardplan as sp
import torch
from shardplan.frontend.torch.capture import capture
from shardplan.ir import Role
from shardplan.ir.errors import ArgumentError
from torch import nn

pytestmark = pytest.mark.torch

MESH = sp.Mesh({"dp": 2}, cluster="h100-sxm")


class Keywords(nn.Module):
    """``forward(x, **kwargs)`` reading ``kwargs["mask"]`` when given."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, **kwargs):  # type: ignore[no-untyped-def]
        h = self.lin(x)
        if "mask" in kwargs:
            h = h * kwargs["mask"]
        return h


@dataclasses.dataclass
class Pair:
    a: torch.Tensor
    b: torch.Tensor


class Tagger(nn.Module):
    """``forward(input_ids, extra=None, labels=None)``; ``extra`` a ``Pair`` pytree."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, input_ids, extra=None, labels=None):  # type: ignore[no-untyped-def]
        h = self.embed(input_ids)
        if extra is not None:
            h = h + extra.a.unsqueeze(-1) * extra.b.unsqueeze(-1)
        logits = self.head(h)
        if labels is None:
            return logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


class Declared(TypedDict, total=False):
    output_attentions: bool


class TypedKeywords(Keywords):
    """``forward(x, **kwargs: Unpack[Declared])``, as Hugging Face types its ``**kwargs``."""

    def forward(self, x, **kwargs: Unpack[Declared]):  # type: ignore[no-untyped-def]
        return self.lin(x)


def test_a_keyword_a_typed_kwargs_does_not_declare_is_refused_before_tracing() -> None:
    x = torch.randn(8, 4)
    capture(TypedKeywords(), x, output_attentions=True)  # declared
    with pytest.raises(ArgumentError, match=r"'output_atentions' goes to TypedKeywords.forward's "
                                            r"\*\*kwargs, which declares only output_attentions; "
                                            r"forward's parameters are x; "
                                            r"did you mean 'output_attentions'\?"):  # fmt: skip
        capture(TypedKeywords(), x, output_atentions=True)
    capture(Keywords(), x, flag=True)  # untyped **kwargs: a non-tensor keyword is not checked


def test_sp_plan_given_a_strategy_keyword_points_at_sp_evaluate() -> None:
    """``strategy=`` is ``sp.evaluate``'s; ``sp.plan`` used to pass it to ``forward``'s
    ``**kwargs`` as an example input and return a free plan."""
    with pytest.raises(ArgumentError, match=r"strategy= is a shardplan ParallelStrategy, not an "
                                            r"input of Keywords.forward.*sp.evaluate"):  # fmt: skip
        sp.plan(Keywords(), torch.randn(8, 4), mesh=MESH, strategy=sp.strategies.dp())


def _ids() -> torch.Tensor:
    return torch.randint(0, 16, (8, 4), generator=torch.Generator().manual_seed(0))


def test_unread_keyword_into_kwargs_is_an_error_naming_it() -> None:
    x, mask = torch.randn(8, 4), torch.ones(8, 4)
    _, context = capture(Keywords(), x, mask=mask)
    assert context.input_slots == ["x", "mask"]
    with pytest.raises(ArgumentError, match=r"'maks' goes to Keywords.forward's \*\*kwargs.*"
                                            r"never reads it"):  # fmt: skip
        capture(Keywords(), x, maks=mask)
    _, context = capture(Keywords(), x, flag=True)  # a non-tensor keyword: not checked
    assert context.input_slots == ["x"]


@pytest.mark.slow
def test_hf_model_refuses_a_keyword_its_kwargs_drop() -> None:
    """BERT's ``forward(..., **kwargs)`` passes unknown keywords on and never reads them."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=8,
    )  # fmt: skip
    model, ids = BertForMaskedLM(config), _ids()
    with pytest.raises(ArgumentError, match=r"'sample_weights'.*declares only.*labels"):
        sp.plan(model, input_ids=ids, labels=ids, sample_weights=ids, mesh=MESH, time_limit=5)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def _calls() -> list[tuple[str, tuple, dict, list[str]]]:
    ids, pair = _ids(), Pair(torch.randn(8, 4), torch.randn(8, 4))
    slots = ["input_ids", "extra.a", "extra.b", "labels"]
    return [
        ("keyword", (), {"input_ids": ids, "extra": pair, "labels": ids}, slots),
        ("positional", (ids, pair, ids), {}, slots),
        ("mixed", (ids,), {"extra": pair, "labels": ids}, slots),
        ("dict", ({"input_ids": ids, "extra": pair, "labels": ids},), {}, slots),
        ("loss_inputs", (ids,), {"loss_fn": _mse, "loss_inputs": (torch.randn(8, 4, 16),)},
         ["input_ids", "loss_inputs[0]"]),
    ]  # fmt: skip


@pytest.mark.parametrize(("form", "args", "kwargs", "slots"), _calls(), ids=lambda c: c
                         if isinstance(c, str) else "")  # fmt: skip
def test_plan_evaluate_and_whatif_bind_the_call_alike(form, args, kwargs, slots) -> None:  # type: ignore[no-untyped-def]
    """The same call to the three entry points: the same graph inputs, in the same order."""
    model = Tagger()
    plan = sp.plan(model, *args, **kwargs, mesh=MESH, time_limit=5)
    evaluation = sp.evaluate(
        model, *args, **kwargs, mesh=MESH, strategy=sp.strategies.dp(), time_limit=5
    )
    for got in (plan, evaluation.plan):
        assert got.frontend_context.input_slots == slots, form
    first = evaluation.plan.frontend_context.input_values[0]
    assert evaluation.plan.shardings[first].dims[0] == ("dp",)  # the pinned strategy took
    result = sp.whatif(model, *args, **kwargs, mesh=MESH, vary={"link_bandwidth": [1.0, 2.0]},
                       time_limit=5)  # fmt: skip
    assert [r.status for r in result.rows] == ["ok", "ok"], form
    inputs = [v for v in plan.graph.inputs if v.role is Role.INPUT]
    assert [v.type for v in inputs] == [plan.graph.value(n).type
                                        for n in plan.frontend_context.input_values]  # fmt: skip


def test_idle_devices_finding_is_saved_with_the_plan(tmp_path: Path) -> None:
    """A tiny model's free plan repeats the work on both devices: ``plan.idle`` says so, and a
    saved and loaded plan keeps it (and its summary line)."""
    plan = sp.plan(Tagger(), input_ids=_ids(), labels=_ids(), mesh=MESH, time_limit=5)
    assert plan.idle is not None
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = sp.load_plan(path)
    assert loaded.idle == plan.idle
    assert "idle devices" in str(loaded)
    assert loaded.to_json() == plan.to_json()
