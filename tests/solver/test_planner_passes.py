"""The planner as a pipeline of registered passes: the default is what runs and what is printed;
replacing or adding a pass changes the plan; bad pipelines say what is wrong."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import shardplan as sp
from shardplan.cli import main
from shardplan.ir import ShardplanError
from shardplan.ir.errors import ArgumentError
from shardplan.passes import PlannerPass, planner_pass, register_planner_pass
from shardplan.solver.planner import DEFAULT_PIPELINE, PlannerOptions, plan_graph

ROOT = Path(__file__).resolve().parents[2]
MESH = sp.Mesh({"dp": 2, "tp": 4}, cluster="h100-sxm")


def _graph() -> sp.Graph:
    spec = importlib.util.spec_from_file_location(
        "mlp_graph_passes", ROOT / "examples/mlp_graph.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make(batch=8192, model=4096, hidden=16384)


def _ran(plan: sp.Plan) -> list[str]:
    return [key.removeprefix("pass:") for key in plan.timings if key.startswith("pass:")]


def _replaced(name: str, research: PlannerPass | str) -> list:
    return [research if n == name else n for n in DEFAULT_PIPELINE]


@dataclass(frozen=True)
class ScaledOptions:
    factor: float = 2.0


@register_planner_pass
class ScaledReshards(PlannerPass):
    """Price as ``price`` does, then scale every reshard price by ``factor``."""

    name = "test-scaled-reshards"
    scope = "space"
    options_class = ScaledOptions

    def apply(self, state) -> None:  # type: ignore[no-untyped-def]
        planner_pass("price").apply(state)
        for edge in state.problem.edges:
            edge.cost = edge.cost * self.options.factor


@dataclass(frozen=True)
class ForbidOptions:
    value: str = "x"


@register_planner_pass
class ForbidSplit(PlannerPass):
    """Forbid every layout that splits the graph input ``value``."""

    name = "test-forbid-split"
    scope = "space"
    options_class = ForbidOptions

    def apply(self, state) -> None:  # type: ignore[no-untyped-def]
        space, problem = state.space, state.problem
        n = next(i for i, v in enumerate(space.graph.inputs) if v.name == self.options.value)
        split = np.array([s.results[0].shard_count(space.mesh) > 1 for s in space.strategies[n]])
        problem.node_costs[n] = np.where(split, np.inf, problem.node_costs[n])


@pytest.fixture(scope="module")
def default_plan() -> sp.Plan:
    return plan_graph(_graph(), MESH)


def test_planner_default_pipeline_printed_is_the_one_that_runs(default_plan, capsys) -> None:
    assert _ran(default_plan) == list(DEFAULT_PIPELINE)
    assert main(["plan", "--print-passes"]) == 0  # no model or mesh needed, as --help
    printed = capsys.readouterr().out.splitlines()[0]
    assert printed.split(",") == _ran(default_plan)
    again = plan_graph(_graph(), MESH, passes=printed)  # the printed text runs as is
    assert again.to_json() == default_plan.to_json()


def test_planner_research_pricing_pass_changes_the_plan(default_plan) -> None:
    research = plan_graph(
        _graph(), MESH, passes=_replaced("price", "test-scaled-reshards{factor=8}")
    )
    assert "test-scaled-reshards" in _ran(research)
    assert "price" not in _ran(research)
    assert research.shardings != default_plan.shardings
    # the pass itself is faithful: at factor 1 it is the default planner, byte for byte
    same = plan_graph(_graph(), MESH, passes=_replaced("price", ScaledReshards(ScaledOptions(1.0))))
    assert same.to_json() == default_plan.to_json()


def test_planner_added_pass_forbids_splitting_a_tensor(default_plan) -> None:
    assert default_plan.shardings["x"].shard_count(MESH) > 1  # the free plan splits the batch
    at = DEFAULT_PIPELINE.index("price") + 1
    pipeline = [*DEFAULT_PIPELINE[:at], "test-forbid-split{value=x}", *DEFAULT_PIPELINE[at:]]
    plan = sp.plan(_graph(), mesh=MESH, passes=pipeline)
    assert plan.shardings["x"].shard_count(MESH) == 1
    assert plan.shardings != default_plan.shardings
    assert _ran(plan) == [p.split("{")[0] for p in pipeline]


def test_planner_unknown_pass_lists_the_known_ones() -> None:
    pattern = r"unknown pass 'prise'; planner passes: .*price.*; graph passes: .*propagate"
    with pytest.raises(ShardplanError, match=pattern):
        sp.plan(_graph(), mesh=MESH, passes="annotate,prise")
    with pytest.raises(
        ShardplanError,
        match=r"'test-scaled-reshards': bad option 'factr=2'; its options are: factor",
    ):
        plan_graph(_graph(), MESH, passes="test-scaled-reshards{factr=2}")


def test_planner_cli_passes_option_runs_and_rejects(capsys) -> None:
    example = str(ROOT / "examples" / "mlp_graph.py")
    assert main(["plan", example, "--mesh", "dp=2", "--passes", "annotate,nope", "-q"]) == 1
    assert "unknown pass 'nope'" in capsys.readouterr().err
    pipeline = ",".join(DEFAULT_PIPELINE)
    assert main(["plan", example, "--mesh", "dp=2,tp=4", "--passes", pipeline, "-q"]) == 0
    assert "Layouts" in capsys.readouterr().out


def test_planner_pipeline_missing_a_prerequisite_names_it() -> None:
    no_price = [n for n in DEFAULT_PIPELINE if n != "price"]
    with pytest.raises(ArgumentError, match="needs the problem that 'price' makes"):
        plan_graph(_graph(), MESH, passes=no_price)
    with pytest.raises(ArgumentError, match="needs the spaces that 'enumerate' makes"):
        plan_graph(_graph(), MESH, passes=[n for n in DEFAULT_PIPELINE if n != "enumerate"])


def test_planner_graph_pass_runs_in_the_pipeline() -> None:
    pins = {"w1": sp.Sharding(((), ("tp",)))}
    pipeline = ["annotate", "propagate", *DEFAULT_PIPELINE[1:]]
    plan = plan_graph(_graph(), MESH, passes=pipeline, pins=pins)
    assert _ran(plan)[:2] == ["annotate", "propagate"]
    assert plan.shardings["w1"] == pins["w1"]


def test_planner_options_object_and_keywords_agree() -> None:
    options = PlannerOptions(time_limit=10.0, overlap=False)
    by_object = plan_graph(_graph(), MESH, options)
    by_keywords = plan_graph(_graph(), MESH, time_limit=10.0, overlap=False)
    assert by_object.to_json() == by_keywords.to_json()
    with pytest.raises(ArgumentError, match=r"unknown option.*time_limt.*PlannerOptions fields"):
        plan_graph(_graph(), MESH, time_limt=1.0)
    with pytest.raises(ArgumentError, match="third argument is a PlannerOptions"):
        plan_graph(_graph(), MESH, {"w1": None})  # type: ignore[arg-type]


@pytest.mark.torch
def test_planner_research_pass_on_a_torch_model() -> None:
    """``sp.plan(model, x, mesh=..., passes=[...])``: a torch MLP (meta device) whose free plan
    splits the first weight; a pass added after ``price`` forbids that, and the plan changes."""
    import torch

    with torch.device("meta"):
        model = torch.nn.Sequential(
            torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)
        )
    x = torch.empty(4096, 1024, device="meta")
    free = sp.plan(model, x, mesh=MESH)
    assert free.shardings["0_weight"].shard_count(MESH) > 1
    at = DEFAULT_PIPELINE.index("price") + 1
    forbid = ForbidSplit(ForbidOptions("0_weight"))
    plan = sp.plan(
        model, x, mesh=MESH, passes=[*DEFAULT_PIPELINE[:at], forbid, *DEFAULT_PIPELINE[at:]]
    )
    assert plan.shardings["0_weight"].shard_count(MESH) == 1
    assert "test-forbid-split" in _ran(plan)
