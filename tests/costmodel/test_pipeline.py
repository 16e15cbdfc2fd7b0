"""Pipeline schedules: the event simulation against the SC'21 / Korthikanti'22 closed forms."""

from __future__ import annotations

import pytest
from shardplan.costmodel.pipeline import (
    bubble_fraction,
    in_flight_closed_form,
    p2p_time,
    schedule_pipeline,
    uniform_step_time,
)

SHAPES = [(2, 4), (4, 4), (4, 8), (8, 8), (8, 16)]


@pytest.mark.parametrize(("stages", "microbatches"), SHAPES)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_bubble_matches_closed_form(schedule, stages, microbatches):
    """Uniform stages: step = (m+p-1)(f+b), bubble = (p-1)/(m+p-1)."""
    p, m = stages, microbatches
    result = schedule_pipeline([1.0] * p, [2.0] * p, m, schedule)
    assert result.step_time == pytest.approx((m + p - 1) * 3.0)
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert bubble_fraction(schedule, p, m) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize(("stages", "microbatches"), SHAPES)
@pytest.mark.parametrize("chunks", [2, 3])
def test_pipeline_interleaved_bubble_shrinks_by_chunks(stages, microbatches, chunks):
    """Interleaved 1F1B: step = (m + (p-1)/v)(f+b), bubble = (p-1)/(v m + p - 1)."""
    p, m, v = stages, microbatches, chunks
    result = schedule_pipeline([1.0] * p, [2.0] * p, m, "interleaved", chunks=v)
    assert result.step_time == pytest.approx(uniform_step_time("interleaved", p, m, 1.0, 2.0, v))
    assert result.step_time == pytest.approx((m + (p - 1) / v) * 3.0)
    assert result.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize(("stages", "microbatches"), SHAPES)
@pytest.mark.parametrize(("schedule", "chunks"), [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_pipeline_in_flight_first_stage(schedule, chunks, stages, microbatches):
    """Stage 0 holds m (GPipe), min(p, m) (1F1B), p + (p-1)/v (interleaved) micro-batches."""
    result = schedule_pipeline([1.0] * stages, [2.0] * stages, microbatches, schedule, chunks)
    expected = in_flight_closed_form(schedule, stages, microbatches, chunks)
    assert result.in_flight[0] == pytest.approx(expected)


def test_pipeline_1f1b_in_flight_decreases_along_stages():
    """1F1B stage s keeps p - s micro-batches: the last stage only one."""
    result = schedule_pipeline([1.0] * 4, [2.0] * 4, 8, "1f1b")
    assert result.in_flight == pytest.approx((4.0, 3.0, 2.0, 1.0))


def test_pipeline_gpipe_p2p_adds_two_fill_drain_crossings_per_boundary():
    """Each of the p-1 boundaries is crossed once filling and once draining: + 2(p-1) t."""
    p, m, t = 4, 8, 0.25
    result = schedule_pipeline([1.0] * p, [2.0] * p, m, "gpipe", p2p=t)
    assert result.step_time == pytest.approx((m + p - 1) * 3.0 + 2 * (p - 1) * t)


def test_pipeline_slowest_stage_sets_steady_state():
    """Non-uniform stages: (m - 1) bottleneck periods plus one pass through every stage."""
    forward, backward, m = [1.0, 2.0, 1.0], [2.0, 4.0, 2.0], 6
    result = schedule_pipeline(forward, backward, m, "gpipe")
    assert result.step_time == pytest.approx((m - 1) * 6.0 + 3.0 + 6.0 + 3.0)
    assert result.busy == pytest.approx((18.0, 36.0, 18.0))


def test_pipeline_single_stage_has_no_bubble():
    result = schedule_pipeline([1.0], [2.0], 5, "1f1b")
    assert result.step_time == pytest.approx(15.0)
    assert result.bubble_time == pytest.approx(0.0)


def test_pipeline_p2p_time_is_latency_plus_bytes_over_bandwidth():
    assert p2p_time(1e9, 50e9, 10e-6) == pytest.approx(0.02 + 10e-6)
    assert p2p_time(0, 50e9, 10e-6) == 0.0


def test_pipeline_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        schedule_pipeline([1.0], [1.0], 2, "zero-bubble")
    with pytest.raises(ValueError, match="divisible by the stage count"):
        schedule_pipeline([1.0] * 4, [1.0] * 4, 6, "interleaved", chunks=2)
    with pytest.raises(ValueError, match="backward has"):
        schedule_pipeline([1.0] * 2, [1.0], 2)


def test_pipeline_blocking_p2p_holds_the_sender():
    """2022 Megatron-LM waits for each send: two stages of GPipe pay t after every forward of
    stage 0 and every backward of stage 1, (m+1)(f+b) + 2mt, against (m+1)(f+b) + 2t async."""
    m, t = 6, 0.25
    args = ([1.0] * 2, [2.0] * 2, m, "gpipe")
    assert schedule_pipeline(*args, p2p=t, blocking_p2p=True).step_time == pytest.approx(
        (m + 1) * 3.0 + 2 * m * t
    )
    assert schedule_pipeline(*args, p2p=t).step_time == pytest.approx((m + 1) * 3.0 + 2 * t)
    # one stage sends nothing; interleaving sends more often, so blocking costs it more
    assert schedule_pipeline([1.0], [2.0], m, "1f1b", p2p=t, blocking_p2p=True).step_time == 18.0
    plain = schedule_pipeline([1.0] * 4, [2.0] * 4, 8, "interleaved", 2, p2p=0.1)
    held = schedule_pipeline([1.0] * 4, [2.0] * 4, 8, "interleaved", 2, p2p=0.1, blocking_p2p=True)
    assert held.step_time > plain.step_time
