"""Devices a plan leaves repeating the same work are said out loud (issue 37, point 6).

A tiny training step on 4 H100s plans best with nothing split (every op at the kernel floor);
``print(plan)`` and an ``IdleDevicesWarning`` say so with the modelled numbers, and
``prefer="throughput"`` returns the data-parallel plan with both step times.
"""

from __future__ import annotations

import warnings

import pytest
import shardplan as sp
from shardplan.ir import Role
from shardplan.ir.models import TransformerConfig, training_step
from shardplan.solver.idle import work_repeats
from shardplan.solver.summary import batch_axes, idle_axes

TINY = TransformerConfig("tiny", layers=1, hidden=32, heads=2, ffn=64, vocab=128, seq=16)
MESH = sp.Mesh({"dp": 2, "tp": 2}, cluster="h100-sxm")


def _plan(**kw):  # type: ignore[no-untyped-def]
    return sp.plan(training_step(TINY, batch=8), mesh=MESH, time_limit=10, **kw)


def test_tiny_model_plan_warns_that_devices_repeat_work() -> None:
    with pytest.warns(sp.IdleDevicesWarning, match="kernel floor") as caught:
        plan = _plan()
    assert issubclass(sp.IdleDevicesWarning, sp.IdleAxisWarning)
    assert caught[0].filename == __file__  # points at the caller's line
    message = str(caught[0].message)
    assert "4 devices repeat the same work" in message
    assert "prefer='throughput'" in message
    assert idle_axes(plan) == ["dp", "tp"]
    assert not batch_axes(plan)
    idle = plan.idle
    assert idle.repeats == 4
    assert idle.chosen == "step"
    assert idle.split_axes == ("dp", "tp")
    assert idle.whole
    assert idle.work == pytest.approx(4.0)
    assert idle.free.step == plan.step_time
    assert idle.free.step <= idle.split.step  # why the free plan left them idle
    assert idle.kernel_floor == pytest.approx(7e-6)
    text = str(plan)
    assert "idle devices   4 devices repeat the same work" in text


def test_prefer_throughput_splits_the_batch_over_every_axis() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", sp.IdleAxisWarning)  # the plan it returns splits
        plan = _plan(prefer="throughput")
    assert batch_axes(plan) == ["dp", "tp"]
    assert not idle_axes(plan)
    idle = plan.idle
    assert idle.chosen == "throughput"
    assert idle.strategy == "dp"
    assert idle.split.step == plan.step_time > idle.free.step  # both modelled steps kept
    params = [v for v in plan.graph.inputs if v.role is Role.PARAMETER]
    assert all(not plan.shardings[v.name].used_axes for v in params)  # replicated: they fit
    kinds = {c.kind for r in plan.reshards for c in r.collectives}
    assert "all-reduce" in kinds  # the gradients are reduced: real data parallelism
    # the activations follow the batch: a quarter of the replicated plan's per device
    assert plan.memory["activations"] < _plan_quiet().memory["activations"] / 3
    text = str(plan)
    assert "prefer='throughput': the batch is split over dp×tp" in text
    assert "as planned vs" in text
    again = _plan(prefer="throughput")  # deterministic (but for the solver's wall time)
    assert again.shardings == plan.shardings
    assert _without_solver_line(str(again)) == _without_solver_line(text)


def _without_solver_line(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("solver")]


def _plan_quiet():  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sp.IdleDevicesWarning)
        return _plan()


def test_no_idle_warning_when_the_plan_shards() -> None:
    """On the slow synthetic cluster, at batch 64, the same step's compute pays for a split:
    the free plan is data parallel and the mesh computes the step once."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", sp.IdleAxisWarning)
        plan = sp.plan(
            training_step(TINY, batch=64), mesh=sp.Mesh({"dp": 4}, cluster="cpu-test"),
            time_limit=10,
        )  # fmt: skip
    assert batch_axes(plan) == ["dp"]
    assert plan.idle is None
    assert work_repeats(plan) == pytest.approx(1.0, abs=0.01)
    assert "idle devices" not in str(plan)


def test_partly_split_plan_that_repeats_most_work_says_so() -> None:
    """At batch 8 on the synthetic cluster the free plan shards some parameters over dp but
    not the batch: no axis is wholly idle, yet the mesh computes the step 2.5 times over."""
    with pytest.warns(sp.IdleDevicesWarning, match=r"computes the step 2\.\d times over"):
        plan = sp.plan(
            training_step(TINY, batch=8), mesh=sp.Mesh({"dp": 4}, cluster="cpu-test"),
            time_limit=10,
        )  # fmt: skip
    assert not idle_axes(plan)
    assert not batch_axes(plan)
    assert plan.idle.axes == ("dp",)
    assert not plan.idle.whole
    assert plan.idle.work == pytest.approx(work_repeats(plan))
    assert plan.idle.work >= 2
    assert "the batch is not split over dp" in str(plan)


def test_bad_prefer_is_one_line() -> None:
    with pytest.raises(sp.ArgumentError, match=r"prefer='fast'.*'throughput'"):
        _plan(prefer="fast")


def test_idle_check_propagates_on_the_users_mesh_after_an_axis_search() -> None:
    """On a 3-axis mesh the axis search's last solve may leave its merged mesh (``dp_fsdp``)
    on the graph; the data-parallel alternative is propagated and solved on the user's mesh
    (HF RoBERTa on (2, 2, 2) raised "unknown mesh axis 'fsdp'" from propagation)."""
    from shardplan.api.idle_devices import check_idle_devices

    mesh = sp.Mesh({"dp": 2, "fsdp": 2, "tp": 2}, cluster="h100-sxm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sp.IdleAxisWarning)
        free = sp.plan(training_step(TINY, batch=8), mesh=mesh, time_limit=10)
    free.graph.mesh = sp.Mesh({"dp_fsdp": 4, "tp": 2}, cluster="h100-sxm")  # as it may be left
    plan = check_idle_devices(free, None, None, "throughput")
    assert plan.mesh == mesh
    assert batch_axes(plan) == ["dp", "fsdp", "tp"]
