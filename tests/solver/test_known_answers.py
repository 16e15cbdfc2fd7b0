"""Known answers on hand-built graphs: data parallel, Megatron column/row, and 2-D splits."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import shardplan as sp
from shardplan.ir import Role, Sharding
from shardplan.ir.builder import GraphBuilder


def mlp(batch: int, model: int, hidden: int, dtype: str = "bf16", out: Sharding | None = None):
    """Forward of a 2-layer MLP: relu(x @ w1) @ w2, optionally with the output layout pinned."""
    b = GraphBuilder("mlp")
    x = b.input("x", (batch, model), dtype, role=Role.INPUT)
    w1 = b.param("w1", (model, hidden), dtype)
    w2 = b.param("w2", (hidden, model), dtype)
    y = b.dot(b.relu(b.dot(x, w1)), w2)
    b.output(y)
    graph = b.build()
    if out is not None:  # what the next layer wants (a residual stream is replicated)
        y.sharding, y.pinned = out, True
    return graph


def test_huge_batch_small_hidden_is_pure_batch_split() -> None:
    mesh = sp.Mesh({"x": 8}, cluster="h100-sxm")
    plan = sp.plan(mlp(batch=65536, model=256, hidden=1024), mesh=mesh)
    assert plan.sharding_of("x") == Sharding.of("x", None)
    assert plan.sharding_of("w1") == Sharding.of(None, None)
    assert plan.sharding_of("w2") == Sharding.of(None, None)
    assert plan.collectives() == [], [str(c) for c in plan.collectives()]


def test_tiny_batch_huge_hidden_is_megatron_column_then_row() -> None:
    mesh = sp.Mesh({"x": 8}, cluster="h100-sxm")
    for out, kind in (
        (Sharding.of(None, None), "all-reduce"),
        (Sharding.of("x", None), "reduce-scatter"),
    ):
        plan = sp.plan(mlp(batch=8, model=16384, hidden=16384, out=out), mesh=mesh)
        assert plan.sharding_of("w1") == Sharding.of(None, "x")  # column parallel
        assert plan.sharding_of("w2") == Sharding.of("x", None)  # row parallel
        collectives = [(c.kind, c.axes) for c in plan.collectives()]
        assert collectives == [(kind, ("x",))], [str(c) for c in plan.collectives()]


def _training_mlp(**shape) -> sp.Graph:
    """The shipped MLP training step (forward, backward, SGD update aliasing the weights)."""
    path = Path(__file__).resolve().parents[2] / "examples" / "mlp_graph.py"
    spec = importlib.util.spec_from_file_location("mlp_graph_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make(**shape)


def test_2d_mesh_with_both_pressures_splits_batch_and_hidden_on_different_axes() -> None:
    # Gradient all-reduce (favours sharding weights) and activation all-reduce (favours
    # splitting the batch) are of similar size at this shape: the plan mixes both.
    mesh = sp.Mesh({"dp": 2, "tp": 4}, cluster="h100-sxm")
    plan = sp.plan(_training_mlp(batch=8192, model=4096, hidden=16384), mesh=mesh)
    x, w1, w2 = (plan.sharding_of(n) for n in ("x", "w1", "w2"))
    assert x.dims[0] == ("dp",), x
    assert w1.dims[1] == ("tp",), w1
    assert w2.dims[0] == ("tp",), w2
