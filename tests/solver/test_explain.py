"""``plan.explain(name)`` / ``shardplan explain plan.json NAME``: the chosen layout, the runner-up
layouts with their modelled cost difference, and the constraint or cost that decided."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import shardplan as sp
from shardplan.cli import main
from shardplan.ir import Sharding
from shardplan.ir.models import TransformerConfig, training_step
from shardplan.solver.explain import Alternative, UnknownTensorError, _Pricer, _verdict

ROOT = Path(__file__).resolve().parents[2]
CONFIG = TransformerConfig("tiny", 2, 256, 4, 1024, 512, 128)
MESH = {"dp": 2, "tp": 4}


@pytest.fixture
def plan(tiny_llama_plan):
    return tiny_llama_plan


def _matmul_result(plan, weight: str) -> str:
    """The forward GEMM output that reads ``weight`` (through its bf16 copy)."""
    value = next(v for v in plan.graph.inputs if v.origin.path == weight)
    copies = [u.op.results[0] for u in value.uses if u.op.kind == "convert"]
    return next(u.op.results[0].name for c in copies for u in c.uses if u.op.kind == "einsum")


def test_weight_names_chosen_layout_runner_up_and_cost(plan):
    name = "layers.1.mlp.up_proj.weight"
    why = plan.explain(name)
    assert why.chosen == plan.parameter_shardings()[name]
    assert why.repeats == CONFIG.layers  # alike layers share the decision
    runner = why.runner_up
    assert runner is not None
    assert runner.layout != why.chosen
    assert runner.compute == 0  # an input's layout changes no op's compute
    assert runner.memory == (
        why.value.type.nbytes // runner.layout.shard_count(plan.mesh) - why.bytes_per_device
    )
    text = str(why)
    assert str(runner.layout) in text
    assert "decided by" in text
    assert why.considered > len(why.alternatives) >= 1


def test_activation_names_runner_up_with_cost_difference(plan):
    name = _matmul_result(plan, "layers.0.mlp.up_proj.weight")
    why = plan.explain(name)
    assert why.chosen == plan.shardings[name]
    runner = why.runner_up
    assert runner is not None
    assert runner.time != 0  # a cost difference, compute or communication
    assert runner.time >= 0  # the plan's layout is no worse than the runner-up on its edges
    assert "cost" in why.decided_by or "memory" in why.decided_by
    assert str(runner.layout) in str(why)


def test_pricing_equals_the_plans_own_reshards(plan):
    """The counterfactual prices the chosen layout exactly as the plan's reshards do: every
    edge out of the tensor (to ops, and as a graph output or updated parameter)."""
    pricer = _Pricer(plan)
    results = [r for op in plan.graph.ops for r in op.results]
    for value in plan.graph.inputs[:40] + results[::5]:
        planned = sum(
            r.time
            for r in plan.reshards
            if r.value == value.name and not r.consumer.startswith(("pin:", "reduce:"))
        )
        priced = pricer.to_consumers(value, plan.shardings[value.name])
        assert priced == pytest.approx(planned, rel=1e-9, abs=1e-15), value.name


def test_memory_budget_is_named_when_a_faster_layout_does_not_fit():
    """The verdict's rule (a faster alternative over the budget); real plans rarely show it at
    test size, so the alternatives are given."""
    value = training_step(CONFIG, batch=8).inputs[1]
    fast = Alternative(Sharding.replicated(2), 0.0, -2e-3, 3 * 2**20, fits=False)
    slow = Alternative(Sharding.of("tp", None), 0.0, 1e-3, 0, fits=True)
    assert _verdict(value, [fast, slow], 1).startswith("the memory budget: [{}, {}] would be 2 ms")
    assert _verdict(value, [slow], 1).startswith("communication cost")
    assert _verdict(value, [fast], 1).startswith("the memory budget")


def test_pinned_layout_is_decided_by_the_pin():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from mlp_graph import make
    finally:
        sys.path.remove(str(ROOT / "examples"))
    pin = Sharding.of(None, "tp")
    mesh = sp.Mesh(MESH, cluster="h100-sxm")
    plan = sp.plan(make(), mesh=mesh, pins={"mlp.fc1.weight": pin})
    why = plan.explain("mlp.fc1.weight")
    assert why.chosen == pin
    assert why.decided_by.startswith("a user pin")
    assert why.runner_up is not None  # the alternatives are still priced


def test_unknown_name_suggests_close_ones(plan):
    with pytest.raises(UnknownTensorError, match=r"did you mean layers\.1\.mlp\.up_proj\.weight"):
        plan.explain("layers.1.mlp.upproj.weight")
    with pytest.raises(sp.ShardplanError):
        plan.explain("nothing_like_it_at_all_0000")


def test_cli_explain(plan, tmp_path, capsys):
    path = tmp_path / "plan.json"
    plan.save(path)
    name = "layers.1.mlp.up_proj.weight"
    assert main(["explain", str(path), name]) == 0
    out = capsys.readouterr().out
    assert out.strip() == str(sp.load_plan(path).explain(name))
    assert main(["explain", str(path), "layers.1.mlp.upproj.weight"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "did you mean" in err[0]
    assert main(["explain", str(path)]) == 0  # without NAME: the summary, as show
    assert capsys.readouterr().out.startswith("graph ")
