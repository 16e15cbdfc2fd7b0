"""``shardplan.annotate`` inside forward and DTensor parameters pin the plan (issue 17)."""

from __future__ import annotations

import copy

import pytest
import shardplan as sp
import torch
from shardplan.frontend.torch import simulate
from shardplan.frontend.torch.annotate import from_placements
from shardplan.frontend.torch.capture import capture
from shardplan.frontend.torch.train import step_loss
from shardplan.ir import FrontendError, Sharding
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

pytestmark = pytest.mark.torch

MESH = sp.Mesh({"dp": 2, "tp": 2}, cluster="cpu-test")


class MLP(nn.Module):
    """``fc2(gelu(fc1(x)))`` with an optional pin on the hidden activation."""

    def __init__(self, spec=None, dim: int = 16, hidden: int = 64) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.spec = spec
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.fc1(x))
        if self.spec is not None:
            h = sp.annotate(h, self.spec)
        return self.fc2(h)


def _model(spec=None):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return MLP(spec), (torch.randn(64, 16),)


def _param(plan: sp.Plan, fqn: str) -> Sharding:
    return plan.sharding_of(plan.frontend_context.param_values[fqn])


def test_annotate_is_identity_outside_a_capture() -> None:
    model, (x,) = _model(("dp", None))
    plain, _ = _model()
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(x), plain(x))


def test_annotate_pins_the_value_it_tags() -> None:
    model, inputs = _model((None, "tp"))
    graph, context = capture(model, *inputs, mode="inference")
    ((name, pin),) = context.pins.items()
    assert pin == Sharding.of(None, "tp")
    assert graph.value(name).producer.kind == "gelu"


def test_annotate_decides_the_plan_and_the_applied_plan_matches() -> None:
    """A 64-row batch plans data parallel; pinning the hidden activation column-split makes
    fc1 column-parallel instead, and the applied plan computes the unsharded loss."""
    free_model, free_inputs = _model()
    free = sp.plan(free_model, *free_inputs, mesh=MESH)
    model, inputs = _model((None, "tp"))
    plan = sp.plan(model, *inputs, mesh=MESH)
    (hidden,) = plan.frontend_context.pins
    assert plan.sharding_of(hidden) == Sharding.of(None, "tp")
    assert _param(plan, "fc1.weight") == Sharding.of("tp", None)  # Linear weight: [out, in]
    assert _param(free, "fc1.weight") != _param(plan, "fc1.weight")
    simulate.simulated_world(MESH.size)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    want = step_loss(copy.deepcopy(model), inputs)
    with simulate.local_ranks(MESH.size):
        got = simulate.rank0(step_loss(plan.apply(copy.deepcopy(model), mesh), inputs))
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def test_annotate_takes_placements_and_refuses_a_wrong_rank() -> None:
    simulate.simulated_world(4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.ones(8, 4)
    from shardplan.frontend.torch.annotate import to_sharding

    assert to_sharding(x, None, [Shard(0), Shard(0)], mesh) == Sharding.of(("dp", "tp"), None)
    assert to_sharding(x, None, [Replicate(), Shard(1)], mesh) == Sharding.of(None, "tp")
    with pytest.raises(FrontendError, match="has 1 dimensions but the tensor"):
        to_sharding(x, ("dp",), None, None)
    with pytest.raises(FrontendError, match="cannot be a pin"):
        from_placements([Partial(), Replicate()], ("dp", "tp"), 2, "x")


def _dtensor_model(placements):  # type: ignore[no-untyped-def]
    """The plain MLP whose fc1.weight is a DTensor with ``placements`` on a (dp, tp) mesh."""
    model, inputs = _model()
    simulate.simulated_world(4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with simulate.local_ranks(4):
        weight = distribute_tensor(model.fc1.weight.detach(), mesh, placements)
    model.fc1.weight = nn.Parameter(weight)
    return model, inputs


@pytest.mark.parametrize(
    ("placements", "want"),
    [
        ([Replicate(), Shard(0)], Sharding.of("tp", None)),
        ([Shard(1), Replicate()], Sharding.of(None, "dp")),
        ([Shard(0), Shard(0)], Sharding.of(("dp", "tp"), None)),
    ],
    ids=["colwise-tp", "rowwise-dp", "both"],
)
def test_dtensor_parameters_pin_the_plan(placements, want) -> None:  # type: ignore[no-untyped-def]
    model, inputs = _dtensor_model(placements)
    _, context = capture(model, *inputs)
    assert context.pins == {"fc1.weight": want}
    plan = sp.plan(model, *inputs, mesh=MESH)
    assert _param(plan, "fc1.weight") == want


def test_annotation_on_an_axis_the_planner_mesh_lacks_is_refused() -> None:
    model, inputs = _model((None, "sp"))
    with pytest.raises(FrontendError, match="no axis 'sp'"):
        sp.plan(model, *inputs, mesh=MESH)


def test_pins_follow_layer_stamping() -> None:
    """Deep stacks are traced 3 layers deep and stamped (``stack.py``): a pin on a template
    (layer 1) value is copied to each stamped copy, a traced last layer's pin moves with it,
    FQN pins are grown like the other FQN tables. (Measured on HF Llama with 7 layers and a
    pin per MLP output: 7 pins, one per layer, as a full trace gives.)"""
    from shardplan.frontend.torch.stack import rename_pins
    from shardplan.ir import Graph
    from shardplan.passes.stamp_layers import StampedGraph

    row, col = Sharding.of("dp", None), Sharding.of(None, "tp")
    names = {2: {"t1": "c2"}, 3: {"t1": "c3"}, 4: {"l2": "c4"}}  # 5 layers: 2, 3 copy layer 1
    stamped = StampedGraph(Graph("g"), names, "layers", 5)
    pins = {"t0": row, "t1": col, "l2": row, "layers.1.fc.weight": col}
    assert rename_pins(pins, stamped) == {
        "t0": row, "t1": col, "c2": col, "c3": col, "c4": row,
        "layers.1.fc.weight": col, "layers.2.fc.weight": col, "layers.3.fc.weight": col,
    }  # fmt: skip
