"""Calling conventions of a torch model: example inputs as the model is called.

Positional and keyword inputs bound by ``forward``'s signature, mixed, one dict, pytrees
(lists, dicts, dataclasses, ``None``), loss-only targets (``loss_inputs=``), the errors for a
call ``forward`` cannot take, the same for ``sp.evaluate`` / ``whatif`` / the CLI, and an
applied plan called by keyword with the plain model's numerics (``frontend/torch/inputs.py``).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import shardplan as sp
import torch
from shardplan.api.whatif import whatif
from shardplan.cli import main as cli_main
from shardplan.cli_inputs import parse_input
from shardplan.frontend.torch import simulate
from shardplan.frontend.torch.capture import capture
from shardplan.frontend.torch.train import distribute_loss_inputs
from shardplan.ir import FrontendError
from shardplan.ir.errors import ArgumentError
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

pytestmark = pytest.mark.torch

MESH = sp.Mesh({"dp": 2}, cluster="h100-sxm")


class Tagger(nn.Module):
    """``forward(input_ids, attention_mask=None, labels=None)`` like a HF model."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, input_ids, attention_mask=None, labels=None):  # type: ignore[no-untyped-def]
        logits = self.head(self.embed(input_ids))
        if attention_mask is not None:
            logits = logits * attention_mask.unsqueeze(-1)
        if labels is None:
            return logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


@dataclasses.dataclass
class Batch:
    features: torch.Tensor
    mask: torch.Tensor | None = None
    scale: float = 1.0


class Pytree(nn.Module):
    """``forward(xs, batch, extra=None)``: a list, a dataclass and a dict of tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, xs, batch, extra=None):  # type: ignore[no-untyped-def]
        h = self.a(xs[0]) + self.b(xs[1]) * batch.scale
        if batch.mask is not None:
            h = h * batch.mask
        if extra is not None:
            h = h + extra["bias"]
        return h


def _ids() -> torch.Tensor:
    return torch.randint(0, 16, (8, 4), generator=torch.Generator().manual_seed(0))


def test_positional_keyword_mixed_and_dict_calls_bind_alike() -> None:
    """Every way to give ``input_ids`` and ``labels`` binds them by name: the same inputs."""
    model, ids = Tagger(), _ids()
    calls = [
        ((), {"input_ids": ids, "labels": ids}),
        ((ids,), {"labels": ids}),
        ((ids, {"labels": ids}), {}),
        (({"input_ids": ids, "labels": ids},), {}),
    ]
    for args, kwargs in calls:
        graph, context = capture(model, *args, **kwargs)
        assert context.input_slots == ["input_ids", "labels"], (args, kwargs)
        assert context.input_binding == "input_ids=i64[8,4], labels=i64[8,4]"
        assert any(op.kind.startswith("log_softmax") or "softmax" in op.kind for op in graph.ops)


def test_second_positional_binds_to_the_second_parameter() -> None:
    """``sp.plan(model, ids, ids)`` binds the second tensor to ``attention_mask``, as calling
    ``model(ids, ids)`` does, and says so (``input_binding``, the progress line)."""
    _, context = capture(Tagger(), _ids(), _ids())
    assert context.input_slots == ["input_ids", "attention_mask"]


def test_sp_plan_takes_keyword_inputs_and_rejects_unknown_ones() -> None:
    model, ids = Tagger(), _ids()
    plan = sp.plan(model, input_ids=ids, labels=ids, mesh=MESH, time_limit=5)
    assert plan.frontend_context.input_slots == ["input_ids", "labels"]
    with pytest.raises(ArgumentError, match=r"'lables'; did you mean 'labels'\?.*input_ids"):
        sp.plan(model, input_ids=ids, lables=ids, mesh=MESH)
    with pytest.raises(ArgumentError, match=r"Tagger.forward.*no parameter 'mask'"):
        capture(model, ids, mask=ids)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((_ids(), _ids(), _ids(), _ids()), {}, r"takes 3 positional input\(s\) but 4.*loss_inputs"),
        ((_ids(),), {"input_ids": _ids()}, r"'input_ids' is given twice"),
        ((), {"labels": _ids()}, r"missing a required argument: 'input_ids'"),
        ((np.zeros((8, 4)),), {}, r"input_ids of Tagger is a numpy.ndarray.*torch.as_tensor"),
        (([_ids(), object()],), {}, r"input_ids\[1\] of Tagger is a builtins.object"),
    ],
    ids=["too-many", "twice", "missing", "numpy", "object-leaf"],
)
def test_calls_forward_cannot_take_name_the_argument(args, kwargs, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ArgumentError, match=match):
        capture(Tagger(), *args, **kwargs)


def _pytree_call() -> tuple[list, Batch, dict]:
    torch.manual_seed(1)
    xs = [torch.randn(8, 4), torch.randn(8, 4)]
    return xs, Batch(torch.randn(8, 4), mask=None, scale=0.5), {"bias": torch.randn(8, 4)}


def test_pytree_inputs_are_graph_inputs_by_path() -> None:
    xs, batch, extra = _pytree_call()
    graph, context = capture(Pytree(), xs, batch, extra=extra)
    assert context.input_slots == ["xs[0]", "xs[1]", "batch.features", "extra['bias']"]
    assert [v.origin.path for v in graph.inputs if v.role.value == "input"] == context.input_slots


class DictBatch(nn.Module):
    """``forward(batch, **kwargs)``: one dict is the batch, not keywords."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, batch, **kwargs):  # type: ignore[no-untyped-def]
        return self.a(batch["x"])


def test_a_dict_for_a_required_positional_is_that_input() -> None:
    _, context = capture(DictBatch(), {"x": torch.randn(8, 4)})
    assert context.input_slots == ["batch['x']"]


def _simulated(plan: sp.Plan):  # type: ignore[no-untyped-def]
    simulate.simulated_world(plan.mesh.size)
    sizes = tuple(plan.mesh.shape[a] for a in plan.mesh.axis_names)
    return init_device_mesh("cpu", sizes, mesh_dim_names=plan.mesh.axis_names)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: simulate.rank0(p.grad) for n, p in model.named_parameters()}


def _assert_numerics(loss, grads, ref_loss, ref_model) -> None:  # type: ignore[no-untyped-def]
    torch.testing.assert_close(simulate.rank0(loss), ref_loss.detach(), rtol=1e-4, atol=1e-6)
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_applied_plan_takes_the_pytree_call_by_keyword() -> None:
    """An FSDP plan of the pytree model, applied and called by keyword (``xs=[...]``,
    ``batch=Batch(...)``): loss and every gradient equal the plain model's; the inputs and
    parameters are split over dp."""
    torch.manual_seed(0)
    model = Pytree()
    xs, batch, extra = _pytree_call()
    plan = sp.evaluate(
        model, xs, batch, extra=extra, mesh=MESH, strategy=sp.strategies.fsdp(), time_limit=5
    ).plan
    context = plan.frontend_context
    for slot, value in zip(context.input_slots, context.input_values, strict=True):
        assert plan.shardings[value].dims[0] == ("dp",), slot
    reference = copy.deepcopy(model)
    ref_loss = reference(xs, batch, extra).float().pow(2).mean()
    ref_loss.backward()
    device_mesh = _simulated(plan)
    with simulate.local_ranks(plan.mesh.size):
        sharded = plan.apply(copy.deepcopy(model), device_mesh)
        loss = sharded(batch=batch, xs=xs, extra=extra).float().pow(2).mean()
        loss.backward()
        grads = _grads(sharded)
    _assert_numerics(loss, grads, ref_loss, reference)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


@pytest.mark.slow
def test_loss_inputs_reach_only_the_loss() -> None:
    """``sp.plan(m, x, loss_fn=fn, loss_inputs=(y,))`` traces ``fn(m(x), y)``: ``y`` is a graph
    input split with the batch; the applied plan's loss and gradients equal the plain model's
    (``y`` distributed by ``distribute_loss_inputs``)."""
    torch.manual_seed(0)
    model, x, y = nn.Linear(4, 4), torch.randn(8, 4), torch.randn(8, 4)
    plan = sp.evaluate(
        model, x, loss_fn=_mse, loss_inputs=(y,), mesh=MESH, strategy=sp.strategies.dp(),
        time_limit=5,
    ).plan  # fmt: skip
    context = plan.frontend_context
    assert context.input_slots == ["input", "loss_inputs[0]"]
    assert plan.shardings[context.input_values[1]].dims[0] == ("dp",)
    reference = copy.deepcopy(model)
    ref_loss = _mse(reference(x), y)
    ref_loss.backward()
    device_mesh = _simulated(plan)
    with simulate.local_ranks(plan.mesh.size):
        sharded = plan.apply(copy.deepcopy(model), device_mesh)
        (target,) = distribute_loss_inputs(plan, device_mesh, (y,))
        loss = _mse(sharded(input=x), target)
        loss.backward()
        grads = _grads(sharded)
    _assert_numerics(loss, grads, ref_loss, reference)


def test_loss_only_target_errors_say_how() -> None:
    model, x, y = nn.Linear(4, 4), torch.randn(8, 4), torch.randn(8, 4)
    with pytest.raises(ArgumentError, match=r"loss_inputs=\(y,\) with loss_fn"):
        capture(model, x, y, loss_fn=_mse)
    with pytest.raises(ArgumentError, match="give loss_fn= too"):
        capture(model, x, loss_inputs=(y,))
    with pytest.raises(FrontendError, match=r"closure.*loss_inputs=\(y,\)"):
        capture(model, x, loss_fn=lambda out, _: _mse(out, y))


def test_evaluate_and_whatif_take_keyword_inputs() -> None:
    model, ids = Tagger(), _ids()
    evaluation = sp.evaluate(
        model, input_ids=ids, labels=ids, mesh=MESH, strategy=sp.strategies.dp(), time_limit=5
    )
    assert evaluation.plan.frontend_context.input_slots == ["input_ids", "labels"]
    result = whatif(
        model, input_ids=ids, labels=ids, mesh=MESH, vary={"link_bandwidth": [1.0, 2.0]},
        time_limit=5,
    )  # fmt: skip
    assert "link_bandwidth" in result.table()
    with pytest.raises(ArgumentError, match="did you mean 'labels'"):
        sp.evaluate(model, input_ids=ids, label=ids, mesh=MESH, strategy=sp.strategies.dp())


def test_cli_input_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--input NAME=SHAPE[:DTYPE]`` passes named example tensors; the factory returns the
    model alone."""
    assert parse_input("input_ids=8x4:int64") == ("input_ids", (8, 4), "int64")
    assert parse_input("x=8,4") == ("x", (8, 4), "float32")
    source = Path(__file__).read_text()
    start, end = source.index("class Tagger"), source.index("@dataclasses.dataclass")
    target = tmp_path / "tagger.py"
    target.write_text(f"import torch\nfrom torch import nn\n\n{source[start:end]}\n"
                      "def make():\n    return Tagger()\n")  # fmt: skip
    code = cli_main([
        "plan", str(target), "--mesh", "dp=2", "--time-limit", "5", "--quiet",
        "--input", "input_ids=8x4:int64", "--input", "labels=8x4:int64",
    ])  # fmt: skip
    assert code == 0
    assert "Tagger" in capsys.readouterr().out
    code = cli_main(["plan", str(target), "--mesh", "dp=2", "--input", "input_ids=8x4:int65"])
    assert code == 1
    assert "unknown dtype 'int65'" in capsys.readouterr().err


@pytest.mark.slow
def test_hf_decoder_planned_and_applied_by_keyword() -> None:
    """A decoder family of the emission matrix (Qwen2) through ``sp.plan(model,
    input_ids=ids, labels=ids, mesh=...)`` (FSDP pinned, so it shards), applied and called
    by keyword: the plain model's loss and every gradient."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(0, 64, (8, 8))
    graph, _ = capture(model, input_ids=ids, labels=ids, stamp_layers=False)
    pins = sp.strategies.fsdp().pins(graph, MESH)
    plan = sp.plan(
        model, input_ids=ids, labels=ids, mesh=MESH, pins=pins, time_limit=10, stamp_layers=False
    )
    assert plan.frontend_context.input_slots == ["input_ids", "labels"]
    assert any(plan.shardings[v].dims and plan.shardings[v].dims[0] for v in pins)
    reference = copy.deepcopy(model)
    ref_loss = reference(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    device_mesh = _simulated(plan)
    with simulate.local_ranks(plan.mesh.size):
        sharded = plan.apply(copy.deepcopy(model), device_mesh)
        loss = sharded(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = _grads(sharded)
    _assert_numerics(loss, grads, ref_loss, reference)
