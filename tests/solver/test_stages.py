"""The stage-assignment ILP equals brute force over every contiguous split and micro-batch count."""

from __future__ import annotations

import math
import random

import pytest
from shardplan.solver.stages import LayerCosts, assign_stages, brute_force_stages


def random_costs(seed: int, layers: int) -> LayerCosts:
    rng = random.Random(seed)
    return LayerCosts(
        time=tuple(rng.uniform(0.5, 2.0) for _ in range(layers)),
        state_bytes=tuple(rng.choice([1e9, 2e9, 3e9]) for _ in range(layers)),
        activation_bytes=tuple(rng.choice([2e9, 4e9]) for _ in range(layers)),
        pre_time=rng.uniform(0, 1.5),
        post_time=rng.uniform(0, 2.5),
        pre_bytes=rng.choice([0, 2e9]),
        post_bytes=rng.choice([0, 3e9]),
        boundary_bytes=rng.choice([1e8, 1e9]),
        step_time=rng.uniform(0, 0.2),
    )


CASES = [(seed, layers, p) for seed in range(6) for layers, p in ((6, 2), (8, 3), (9, 4))]


@pytest.mark.parametrize(("seed", "layers", "stages"), CASES)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_stage_ilp_equals_brute_force(seed: int, layers: int, stages: int, schedule: str) -> None:
    costs = random_costs(seed, layers)
    limit = random.Random(seed).choice([math.inf, 9e9, 14e9])
    args = dict(memory_limit=limit, schedule=schedule, p2p_bandwidth=50e9, p2p_latency=1e-5)
    ilp = assign_stages(costs, stages, [1, 2, 4, 8], **args)
    brute = brute_force_stages(costs, stages, [1, 2, 4, 8], **args)
    assert (ilp is None) == (brute is None)
    if ilp is not None:
        assert ilp.step_time == pytest.approx(brute.step_time, rel=1e-5)
        assert max(ilp.stage_memory) <= limit


def test_uniform_layers_split_evenly_and_more_microbatches_shrink_the_bubble() -> None:
    costs = LayerCosts(time=(1.0,) * 8, state_bytes=(0.0,) * 8, activation_bytes=(0.0,) * 8)
    best = assign_stages(costs, 4, [1, 2, 4, 8, 16])
    assert best.bounds == (0, 2, 4, 6)
    assert best.microbatches == 16
    # (sum + (m-1) max)/m with stage time 2: (8 + 15*2)/16
    assert best.step_time == pytest.approx((8 + 15 * 2) / 16)


def test_memory_limit_moves_layers_off_the_first_stage() -> None:
    # 1F1B keeps p micro-batches in flight on stage 0 and 1 on the last: stage 0 gets fewer layers.
    costs = LayerCosts(time=(1.0,) * 8, state_bytes=(1e9,) * 8, activation_bytes=(8e9,) * 8)
    free = assign_stages(costs, 2, [2])
    tight = assign_stages(costs, 2, [2], memory_limit=3.1e10)
    assert free.bounds == (0, 4)
    assert tight.bounds[1] < 4
    assert max(tight.stage_memory) <= 3.1e10


INTERLEAVED_CASES = [(seed, layers, p) for seed in range(6) for layers, p in ((8, 2), (9, 3))]


@pytest.mark.parametrize(("seed", "layers", "stages"), INTERLEAVED_CASES)
def test_choosing_the_chunk_count_equals_brute_force(seed: int, layers: int, stages: int) -> None:
    # 1F1B and interleaved with every chunk count, alike and unlike layers, tight memory
    costs = random_costs(seed, layers)
    limit = random.Random(seed).choice([math.inf, 12e9, 16e9])
    args = dict(memory_limit=limit, p2p_bandwidth=5e9, p2p_latency=1e-4, chunk_options=(1, 2, 3))
    ilp = assign_stages(costs, stages, [1, 2, 3, 4, 6, 8], **args)
    brute = brute_force_stages(costs, stages, [1, 2, 3, 4, 6, 8], **args)
    assert (ilp is None) == (brute is None)
    if ilp is not None:
        assert ilp.step_time == pytest.approx(brute.step_time, rel=1e-5)
        assert max(ilp.stage_memory) <= limit
        assert ilp.chunks == 1 or (ilp.microbatches % stages == 0 and ilp.schedule == "interleaved")


def test_interleaving_trades_bubble_for_hand_offs() -> None:
    # alike layers: free hand-offs make the most chunks best; slow ones make 1F1B best
    alike = LayerCosts((1.0,) * 12, (0.0,) * 12, (0.0,) * 12, boundary_bytes=1e9)
    fast = assign_stages(alike, 2, [2, 4], p2p_bandwidth=math.inf, chunk_options=(1, 2, 3, 6))
    slow = assign_stages(alike, 2, [2, 4], p2p_bandwidth=1e9, chunk_options=(1, 2, 3, 6))
    assert (fast.schedule, fast.chunks) == ("interleaved", 6)
    assert (slow.schedule, slow.chunks) == ("1f1b", 1)


@pytest.mark.parametrize(("stages", "microbatches", "chunks"), [(4, 8, 2), (4, 8, 3), (3, 6, 4)])
def test_step_and_memory_match_the_event_simulation(stages: int, microbatches: int, chunks: int):
    # the closed forms the stage ILP optimises equal costmodel.pipeline's simulated schedule
    from shardplan.costmodel.pipeline import schedule_pipeline
    from shardplan.solver.stages import evaluate_split, in_flight

    n = stages * chunks
    costs = LayerCosts((3.0,) * n, (0.0,) * n, (1.0,) * n, forward_fraction=1 / 3)
    bounds = tuple(range(0, n, chunks))
    p2p = 0.05
    step, times, _ = evaluate_split(costs, bounds, microbatches, "interleaved", p2p, chunks)
    per_mb = [t / microbatches for t in times]
    sim = schedule_pipeline([t / 3 for t in per_mb], [2 * t / 3 for t in per_mb], microbatches,
                            "interleaved", chunks, p2p)  # fmt: skip
    assert step == pytest.approx(sim.step_time)
    closed = [in_flight("interleaved", s, stages, microbatches, chunks) for s in range(stages)]
    assert closed == pytest.approx(list(sim.in_flight))
