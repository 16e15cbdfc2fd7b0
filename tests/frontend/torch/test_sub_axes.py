"""DTensor cannot express a Shardy sub-axis (``"tp":(1)2``): the torch emitter refuses it.

A sub-axis layout comes from propagation through a reshape that splits a dimension inside a
mesh axis; the planner's own strategies use whole axes, so the test puts the propagated layout
of a parameter into a solved plan, as a plan that follows propagation would hold it.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import shardplan as sp
import torch
from shardplan.frontend.torch.emit import placements_of
from shardplan.ir import FrontendError, Role, Sharding
from shardplan.passes.propagate import propagate
from torch.distributed.tensor import Replicate, Shard

pytestmark = pytest.mark.torch

MESH = sp.Mesh({"dp": 2, "tp": 4}, cluster="cpu-test")


class _Heads(torch.nn.Module):
    """``w1`` (8,16) split into (2,4,16) heads and scaled by ``w2`` (2,4,16)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(8, 16))
        self.w2 = torch.nn.Parameter(torch.randn(2, 4, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.w1.reshape(2, 4, 16) * self.w2).sum()


def test_placements_refuse_a_sub_axis_and_keep_whole_axes() -> None:
    sub = Sharding((("tp:(1)2",), ("tp:(2)2",), ()))
    with pytest.raises(FrontendError, match=r'%h has sharding .*"tp":\(1\)2.*whole mesh'):
        placements_of(sub, MESH, "h")
    assert placements_of(Sharding.of("tp", None, "dp"), MESH) == (Shard(2), Shard(0))
    assert placements_of(Sharding.of(None, None), MESH) == (Replicate(), Replicate())


def test_plan_with_a_propagated_sub_axis_parameter_is_refused_by_name() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = sp.plan(
            _Heads(), torch.randn(2, 4, 16), mesh=MESH, pins={"w1": Sharding.of("tp", None)},
            mode="inference", time_limit=10,
        )  # fmt: skip
    graph = plan.graph
    saved = {v.name: v.sharding for v in graph.values()}
    propagate(graph)
    (w2,) = [v for v in graph.inputs if v.role is Role.PARAMETER and v.origin.path == "w2"]
    layout = w2.sharding
    for value in graph.values():
        value.sharding = saved[value.name]
    assert layout == Sharding((("tp:(1)2",), ("tp:(2)2",), ()))
    assert plan.to_placements()["w2"] is not None  # the solved plan: whole axes
    sub_plan = dataclasses.replace(plan, shardings={**plan.shardings, w2.name: layout})
    with pytest.raises(FrontendError, match=rf'%{w2.name} has sharding .*"tp":\(1\)2'):
        sub_plan.to_placements()


def test_a_sub_axis_pin_on_a_parameter_is_refused_by_name() -> None:
    """The user path: ``pins=`` names a sub-axis for a parameter; the plan holds it and the
    torch emitter refuses it, naming the parameter's value and the sub-axis."""
    sub = Sharding((("tp:(1)2",), ("tp:(2)2",), ()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = sp.plan(
            _Heads(), torch.randn(2, 4, 16), mesh=MESH, pins={"w2": sub}, mode="inference",
            time_limit=10,
        )  # fmt: skip
    (w2,) = [v for v in plan.graph.inputs if v.origin.path == "w2"]
    assert plan.sharding_of(w2.name) == sub
    with pytest.raises(FrontendError, match=rf'%{w2.name} has sharding .*"tp":\(1\)2'):
        plan.to_placements()


def test_annotate_refuses_a_sub_axis() -> None:
    with pytest.raises(FrontendError, match=r"sub-axis 'tp:\(1\)2'.*whole axes"):
        sp.annotate(torch.zeros(2, 4), Sharding((("tp:(1)2",), ("tp:(2)2",))))
