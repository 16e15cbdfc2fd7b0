"""``sp.plan`` keeps the objects alive before it out of the cycle collector's passes while it
plans (``api._old_objects_frozen``), and leaves the collector as it found it."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import shardplan as sp
import shardplan.solver.planner as planner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from mlp_graph import make


@pytest.fixture
def frozen_while_planning(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The freeze count ``plan_graph`` sees (recorded per call)."""
    seen: list[int] = []
    plan_graph = planner.plan_graph

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(gc.get_freeze_count())
        return plan_graph(*args, **kwargs)

    monkeypatch.setattr(planner, "plan_graph", spy)
    return seen


def test_plan_freezes_older_objects_and_restores(frozen_while_planning: list[int]) -> None:
    assert gc.get_freeze_count() == 0
    graph = make(batch=64, model=32, hidden=64)
    plan = sp.plan(graph, mesh=sp.Mesh({"dp": 2, "tp": 2}, cluster="cpu-test"))
    assert plan.solver.status == "OPTIMAL"
    assert frozen_while_planning
    assert frozen_while_planning[0] > 0
    assert gc.get_freeze_count() == 0  # handed back to the oldest generation


def test_plan_leaves_a_callers_freeze_alone(frozen_while_planning: list[int]) -> None:
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        sp.plan(
            make(batch=64, model=32, hidden=64),
            mesh=sp.Mesh({"dp": 2, "tp": 2}, cluster="cpu-test"),
        )
        # Frozen objects can still die by reference counting, so counts only shrink: the plan
        # neither unfroze the caller's objects nor froze the graph or its own on top.
        assert 0.9 * before < gc.get_freeze_count() <= before
        # one solve, and one more for the data-parallel plan beside a plan with idle devices
        assert 1 <= len(frozen_while_planning) <= 2
        assert all(count <= before for count in frozen_while_planning)
    finally:
        gc.unfreeze()


def test_plan_with_the_collector_disabled_leaves_it_disabled() -> None:
    gc.disable()
    try:
        sp.plan(
            make(batch=64, model=32, hidden=64),
            mesh=sp.Mesh({"dp": 2, "tp": 2}, cluster="cpu-test"),
        )
        assert not gc.isenabled()
        assert gc.get_freeze_count() == 0
    finally:
        gc.enable()
