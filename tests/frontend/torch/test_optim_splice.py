"""The spliced optimizer update (one trace per parameter class) is the per-parameter trace."""

from __future__ import annotations

import pytest
import torch
from shardplan.frontend.torch import optim
from shardplan.frontend.torch.trace import trace
from torch import nn

pytestmark = pytest.mark.torch


class Mixed(nn.Module):
    """Two parameters per class (l2/l3), a bf16 one, a tied one and an unused one."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.l2 = nn.Linear(16, 16)
        self.l3 = nn.Linear(16, 16)
        self.scale = nn.Parameter(torch.ones(16, dtype=torch.bfloat16))
        self.unused = nn.Parameter(torch.zeros(3))
        self.head = nn.Linear(16, 16, bias=False)
        self.head.weight = self.l2.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))
        return self.head(y * self.scale.float())


def _signature(traced) -> list:  # type: ignore[no-untyped-def]
    """Every node, names left out: op, target, argument positions, value type, custom meta."""
    nodes = list(traced.gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}

    def arg(a):  # type: ignore[no-untyped-def]
        if isinstance(a, torch.fx.Node):
            return ("node", index[a])
        if isinstance(a, (list, tuple)):
            return [arg(b) for b in a]
        return a

    rows = []
    for n in nodes:
        val = n.meta.get("val")
        typ = (tuple(val.shape), val.dtype, val.stride()) if isinstance(val, torch.Tensor) else None
        target = "" if n.op == "placeholder" else str(n.target)
        rows.append((n.op, target, arg(n.args), n.kwargs, typ, n.meta.get("custom")))
    return [rows, traced.placeholders, traced.outputs]


@pytest.mark.parametrize("name", ["adamw", "sgd-momentum", "sgd"])
def test_spliced_update_is_the_per_parameter_trace(name: str) -> None:
    model, x = Mixed(), torch.randn(4, 8)
    spec = optim.OptimizerSpec(name=name)
    spliced = trace(model, [x], True, None, spec)
    reference = trace(model, [x], True, None, spec, optimizer_in_trace=True)
    assert _signature(spliced) == _signature(reference)
    updated = [path for kind, path in spliced.outputs if kind == "param"]
    assert "unused" not in updated  # no gradient
    assert "head.weight" not in updated  # a tied alias
    assert {"l1.weight", "l2.weight", "l3.weight", "scale"} <= set(updated)
    marks = [
        n.meta["custom"]["mark"]
        for n in spliced.gm.graph.nodes
        if str((n.meta.get("custom") or {}).get("mark", "")).startswith("grad:")
    ]
    assert marks == [f"grad:{p}" for p in updated]


def test_spliced_graph_runs_the_optimizer_step() -> None:
    """The spliced graph module computes torch.optim.SGD's momentum step (real tensors)."""
    torch.manual_seed(0)
    model, x = Mixed().float(), torch.randn(4, 8)
    spec = optim.OptimizerSpec(name="sgd-momentum", lr=0.1)
    traced = trace(model, [x], True, None, spec)
    params = dict(model.named_parameters())
    buffers = [b for _, b in model.named_buffers()]
    states = [torch.zeros_like(p) for p in params.values()]
    outs = traced.gm([p.detach() for p in params.values()], buffers, states, [x])
    loss = model(x).float().pow(2).mean()
    loss.backward()
    reference = torch.optim.SGD(model.parameters(), lr=0.1, momentum=spec.momentum,
                                weight_decay=spec.weight_decay)  # fmt: skip
    with torch.no_grad():
        expected = {n: p.detach().clone() for n, p in params.items()}
    reference.step()
    assert torch.allclose(outs[0], loss.detach(), rtol=1e-5)
    new = dict(zip([p for k, p in traced.outputs if k == "param"], outs[1:], strict=False))
    assert new, "no parameter was updated"
    for path, value in new.items():
        assert not torch.equal(value, expected[path]), path
        torch.testing.assert_close(value, params[path].detach(), rtol=1e-4, atol=1e-6)


def test_one_trace_per_rank_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """Contiguous parameters of one rank and dtypes share a trace (Mixed: 2-D f32, 1-D f32,
    1-D bf16), and the copies' values take each parameter's own shape (checked above)."""
    from shardplan.frontend.torch import optim_splice

    traced: list[int] = []
    inner = optim_splice._templates

    def counting(spec, mark, reps):  # type: ignore[no-untyped-def]
        traced.append(len(reps))
        return inner(spec, mark, reps)

    monkeypatch.setattr(optim_splice, "_templates", counting)
    trace(Mixed(), [torch.randn(4, 8)], True, None, optim.OptimizerSpec())
    assert traced == [3]


def test_an_update_that_is_not_elementwise_is_traced_per_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An update with a reduction (a norm-scaled step) has values of other shapes: its wide
    classes are traced again per shape, and the splice is still the per-parameter trace."""
    inner = optim.update

    def normed(spec, param, grad, states):  # type: ignore[no-untyped-def]
        return inner(spec, param, grad / (grad.float().norm() + 1).to(grad.dtype), states)

    monkeypatch.setattr(optim, "update", normed)
    model, x, spec = Mixed(), torch.randn(4, 8), optim.OptimizerSpec()
    spliced = trace(model, [x], True, None, spec)
    reference = trace(model, [x], True, None, spec, optimizer_in_trace=True)
    assert _signature(spliced) == _signature(reference)
