"""A pipeline solves its stage mesh once per batch cap; on a mesh of three axes each cap is an
axis search, and the caps after the first start from the previous cap's best centre
(``axis_search.shared_start``) instead of solving the merged two-axis mesh again."""

from __future__ import annotations

from functools import partial

import shardplan as sp
from shardplan.ir.models import TransformerConfig, training_step
from shardplan.solver import axis_search


def test_later_caps_start_from_the_previous_caps_centre(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    searches, merged = [], []
    search, start = axis_search.axis_search, axis_search._merged_start
    monkeypatch.setattr(
        axis_search, "axis_search", lambda *a, **k: searches.append(1) or search(*a, **k)
    )
    monkeypatch.setattr(
        axis_search, "_merged_start", lambda *a, **k: merged.append(1) or start(*a, **k)
    )
    config = TransformerConfig("tiny", 2, 64, 4, 128, 256, 32)
    mesh = sp.Mesh({"pp": 2, "dp": 2, "fsdp": 2, "tp": 2}, cluster="h100-sxm")
    plan = sp.plan(training_step(config, batch=8), mesh=mesh)
    assert len(searches) >= 2  # more than one cap was solved ...
    assert merged == [1]  # ... and only the first solved the merged mesh
    stages = plan.pipeline.stages
    assert [layer for s in stages for layer in s.layers] == list(range(2))
    assert all(s.memory_bytes <= plan.memory_limit / len(stages) for s in stages)
    assert not axis_search._STARTS  # scoped to the call: a later plan starts afresh


def test_the_bubble_bound_never_exceeds_a_split_it_bounds() -> None:
    # A cap is skipped when this bound reaches the best step so far: it must not exceed the
    # step of any split with at most m micro-batches, interleaved 1F1B (v chunks) included.
    import random

    from shardplan.solver.pipeline import _bubble_bound
    from shardplan.solver.stages import LayerCosts, evaluate_split

    rng = random.Random(0)
    for _ in range(300):
        n, p = rng.randint(2, 12), rng.randint(2, 4)
        p = min(p, n)
        costs = LayerCosts(
            tuple(rng.uniform(0.1, 2.0) for _ in range(n)), (0.0,) * n, (0.0,) * n,
            rng.uniform(0, 1), rng.uniform(0, 1), step_time=rng.uniform(0, 0.5),
        )  # fmt: skip
        floor = sum(costs.time) + costs.pre_time + costs.post_time + costs.step_time
        bounds = (0, *sorted(rng.sample(range(1, n), p - 1)))
        v, m_max = rng.choice([1, 2, 3]), rng.randint(1, 16)
        schedule = "interleaved" if v > 1 else "1f1b"
        for m in range(1, m_max + 1):
            step, _, _ = evaluate_split(costs, bounds, m, schedule, 0.0, v)
            assert _bubble_bound(floor, p, m_max, v) <= step * (1 + 1e-12)


def test_the_cap_bound_lies_between_the_roofline_floor_and_the_plans_stage_times() -> None:
    # A later cap is cut off when this bound, through the bubble bound, reaches the best step
    # so far (``solver/cap_bound.py``): it must not exceed the stage times the plan it bounds
    # is charged, and it is at least the roofline floor the older skip used.
    from shardplan.costmodel import get_cluster
    from shardplan.solver.pipeline import _compute_floor, attribute_layer_costs
    from shardplan.solver.planner import plan_graph

    config = TransformerConfig("tiny", 2, 64, 4, 128, 256, 32)
    graph = training_step(config, batch=8)
    cluster = get_cluster("h100-sxm")
    for axes, cap in (({"dp": 2, "tp": 2}, 1), ({"dp": 2, "fsdp": 2, "tp": 2}, 2)):
        mesh = sp.Mesh(axes, cluster="h100-sxm")
        bounds: list[float] = []
        plan = plan_graph(graph, mesh, batch_split_limit=cap, cutoff=partial(_keep, bounds))
        costs = attribute_layer_costs(plan, cluster).costs
        charged = sum(costs.time) + costs.pre_time + costs.post_time + costs.step_time
        assert len(bounds) == 1  # the finish's space, the one the plan comes from
        assert _compute_floor(graph, mesh, cluster) <= bounds[0] <= charged * (1 + 1e-9)


def _keep(bounds: list[float], bound: float) -> bool:
    bounds.append(bound)
    return False  # never cut: the plan is solved and its stage times compared


def test_a_cap_without_a_micro_batch_sized_plan_in_time_falls_back_to_whole_batch_sizes(
    monkeypatch,
) -> None:  # type: ignore[no-untyped-def]
    # When a micro-batch-sized sub-mesh solve finds no plan in time (the HF 405B-shaped row:
    # its LP seed did not fit), that cap and every later one are solved in the whole-batch
    # cap's space instead, which the pipeline planned before micro-batch sizes.
    from shardplan.solver import planner
    from shardplan.solver.planner import NoPlanInTime

    calls: list[tuple[int, bool]] = []
    real = planner.plan_graph

    def plan_graph(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((kwargs["batch_split_limit"], kwargs["micro_sizes"]))
        if kwargs["micro_sizes"]:
            raise NoPlanInTime("the solver found no plan (UNKNOWN)")
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "plan_graph", plan_graph)
    config = TransformerConfig("tiny", 4, 64, 4, 128, 256, 32)
    mesh = sp.Mesh({"pp": 2, "dp": 2, "tp": 2}, cluster="h100-sxm")
    plan = sp.plan(training_step(config, batch=8), mesh=mesh)
    assert plan.pipeline is not None
    first = calls[0][0]
    assert calls[:2] == [(first, True), (first, False)]  # the first cap, retried
    assert all(not micro for _, micro in calls[1:])  # and no later cap tries again
    assert len({cap for cap, _ in calls}) >= 2
