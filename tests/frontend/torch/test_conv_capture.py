"""Capture of convolutional models: unknown multi-output ops, conv/pool lowerings."""

from __future__ import annotations

import operator

import pytest
import shardplan as sp
import torch
from shardplan.frontend.torch.lower import Lowering, add_input, lower_node
from shardplan.ir import Graph, Role
from torch import fx

pytestmark = pytest.mark.torch


def frobnicate_multi(x: torch.Tensor):  # type: ignore[no-untyped-def]  # pragma: no cover
    return (None, x, None, x)  # traced only: no lowering exists for it


def test_unknown_multi_output_op_keeps_none_positions() -> None:
    """An op without a lowering whose outputs include None (``convolution_backward`` without an
    input gradient) keeps every output at its index: ``getitem(op, 3)`` is the 4th output."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(2, 3)
    call = g.call_function(frobnicate_multi, (x,))
    call.meta["val"] = (None, torch.empty(2, 3), None, torch.empty(4, 3))
    picks = [g.call_function(operator.getitem, (call, i)) for i in range(4)]
    graph = Graph("t")
    low = Lowering(graph)
    add_input(low, x, Role.INPUT, "x")
    with pytest.warns(sp.UnsupportedOpWarning, match="frobnicate_multi"):
        lower_node(low, call)
    for node in picks:
        lower_node(low, node)
    got = [low.env[n] for n in picks]
    assert got[0] is None
    assert got[2] is None
    assert got[1].type.shape == (2, 3)
    assert got[3].type.shape == (4, 3)
    (op,) = [op for op in graph.ops if op.kind == "aten.frobnicate_multi"]
    assert [r.type.shape for r in op.results] == [(2, 3), (4, 3)]
