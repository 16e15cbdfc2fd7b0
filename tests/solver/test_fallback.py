"""Never "no plan" when a plan fits (issue 15 point 1): when the solver finds no plan in time,
``sp.plan`` returns the best fitting hand-written strategy, flagged and with a warning."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import shardplan as sp
import shardplan.solver.solve_pass as solve_pass
from shardplan.ir.models import TransformerConfig, training_step
from shardplan.solver.ilp import Solution
from shardplan.solver.planner import FallbackWarning
from shardplan.solver.serialize import plan_from_json, plan_to_json
from shardplan.solver.summary import memory_trade

evaluate = importlib.import_module("shardplan.api.evaluate")  # sp.evaluate is the function
TINY = TransformerConfig("tiny", 2, 256, 4, 1024, 512, 64)
MESH = sp.Mesh({"dp": 2, "tp": 4}, cluster="h100-sxm")
LIMIT = 12 * 2**20  # replicated weights (dp, zero1, megatron without recompute) do not fit


def _times_out_once(monkeypatch) -> list[str]:  # type: ignore[no-untyped-def]
    """The free plan's CP-SAT calls end without a solution, as at a too-short time limit (the LP
    path cannot be cut short deterministically); the baselines' pinned solves (priced first, to
    warm-start the solver when the memory limit binds) solve."""
    real, calls = solve_pass.solve, []
    real_baseline, inside = evaluate.best_baseline, []

    def best_baseline(*args, **kwargs):  # type: ignore[no-untyped-def]
        inside.append(True)
        try:
            return real_baseline(*args, **kwargs)
        finally:
            inside.pop()

    def solve(problem, time_limit, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append("solve")
        if not inside:
            return Solution([], float("inf"), float("inf"), "UNKNOWN", time_limit, 0)
        return real(problem, time_limit, *args, **kwargs)

    monkeypatch.setattr(solve_pass, "solve", solve)
    monkeypatch.setattr(evaluate, "best_baseline", best_baseline)
    return calls


def test_no_solution_in_time_returns_the_best_fitting_baseline(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    graph = training_step(TINY, batch=8)
    fitting = []
    for strategy in sp.strategies.baselines(MESH):
        ev = sp.evaluate(graph, mesh=MESH, strategy=strategy, memory_limit=LIMIT)
        if ev.fits:
            fitting.append((ev.step_time, strategy.name))
    best_time, best_name = min(fitting)
    assert best_name == "fsdp"  # dp and megatron are faster but do not fit 12 MiB

    _times_out_once(monkeypatch)
    with pytest.warns(FallbackWarning, match="best fitting hand-written strategy 'fsdp'"):
        plan = sp.plan(graph, mesh=MESH, memory_limit=LIMIT, time_limit=5)
    assert plan.solver.status == "FALLBACK"
    assert plan.solver.fallback == "fsdp"
    assert plan.solver.bound == 0.0  # nothing proven: the gap says so
    assert plan.solver.gap == 1.0
    assert plan.step_time == best_time
    assert plan.peak_memory_bytes <= LIMIT
    loaded = plan_from_json(plan_to_json(plan))  # the flag survives a save
    assert (loaded.solver.status, loaded.solver.fallback) == ("FALLBACK", "fsdp")

    # issue 15 point 5: the summary of a memory-bound plan says what was traded for memory
    plan = dataclasses.replace(plan, recompute={"layers.0": "selective", "layers.1": "selective"})
    trade = memory_trade(plan)
    assert trade is not None
    assert trade.startswith("selective recomputation of layers.0-1 (2 layers)")
    assert "parameters sharded over dp×tp (100% of bytes)" in trade  # fsdp: every axis is data
    headroom = LIMIT - plan.peak_memory_bytes
    assert f"({headroom / LIMIT:.1%})" in trade
    assert "memory trade" in str(plan)


def test_without_a_fitting_baseline_the_error_stands(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    graph = training_step(TINY, batch=8)
    _times_out_once(monkeypatch)
    with pytest.raises(sp.InfeasiblePlanError, match="no plan \\(UNKNOWN\\)"):
        sp.plan(graph, mesh=MESH, memory_limit=5 * 2**20, time_limit=5)
