"""The planner-pass table: names, options in pipeline text, graph passes wrapped, bad input."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from shardplan.ir.errors import ArgumentError, ShardplanError
from shardplan.passes import (
    PassSpec,
    PlannerPass,
    normalize_planner_pipeline,
    parse_planner_pipeline,
    planner_pass,
    register_planner_pass,
)
from shardplan.passes.planner_registry import GraphPassStage, pipeline_text


@dataclass(frozen=True)
class CountOptions:
    times: int = 1
    label: str = "x"


@register_planner_pass
class Count(PlannerPass):
    """Count how often it ran on the state."""

    name = "test-count"
    options_class = CountOptions

    def apply(self, state) -> None:  # type: ignore[no-untyped-def]
        state.append(self.options.times)


def test_planner_registry_parses_options_and_prints_them_back() -> None:
    passes = parse_planner_pipeline("test-count{times=3 label=y},test_count,propagate")
    assert [type(p) for p in passes] == [Count, Count, GraphPassStage]
    assert passes[0].options == CountOptions(3, "y")
    assert passes[1].options == CountOptions()
    assert pipeline_text(passes) == "test-count{times=3 label=y},test-count,propagate"
    assert pipeline_text(parse_planner_pipeline(pipeline_text(passes))) == pipeline_text(passes)
    ran: list[int] = []
    for p in passes[:2]:
        p.apply(ran)
    assert ran == [3, 1]


def test_planner_registry_takes_objects_specs_and_strings() -> None:
    made = normalize_planner_pipeline(
        [Count(CountOptions(2)), PassSpec("test-count", CountOptions(5)), "test-count{times=7}"]
    )
    assert [p.options.times for p in made] == [2, 5, 7]
    assert isinstance(planner_pass("annotate"), PlannerPass)


def test_planner_registry_rejects_bad_input() -> None:
    with pytest.raises(ArgumentError, match=r"unknown pass 'nope'; planner passes: .*test-count"):
        parse_planner_pipeline("test-count,nope")
    with pytest.raises(ShardplanError, match="bad option 'time=2'; its options are: times, label"):
        parse_planner_pipeline("test-count{time=2}")
    with pytest.raises(ArgumentError, match="takes CountOptions options, got int"):
        Count(3)
    with pytest.raises(ArgumentError, match="empty pipeline"):
        normalize_planner_pipeline([])
    with pytest.raises(ArgumentError, match="a pipeline entry must be a pass name"):
        normalize_planner_pipeline([3])  # type: ignore[list-item]

    class Bad(PlannerPass):
        name = "Bad_Name"

        def apply(self, state) -> None:  # type: ignore[no-untyped-def]
            pass

    with pytest.raises(ArgumentError, match="kebab-case"):
        register_planner_pass(Bad)
