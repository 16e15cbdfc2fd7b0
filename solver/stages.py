"""Pipeline stage assignment: contiguous layer ranges per stage and the micro-batch count.

Given per-layer costs of one training step (the intra-op plan on the pipeline's sub-mesh, shared
by every repeated layer), choose stage boundaries and ``m`` to minimise the schedule's step time

    T(m) = (sum_s t_s + (m - 1) * max_s t_s) / m  +  hand-offs  +  once-per-step work

(Alpa's Eq. 2 for synchronous 1F1B / GPipe, with per-micro-batch stage times ``t_s / m``), where
``t_s`` is stage ``s``'s share of the whole batch's forward+backward time, under each stage's
memory: its layers' state plus the activations of the micro-batches it keeps in flight (1F1B:
``min(p - s, m)`` on stage ``s``; GPipe: ``m``). For a fixed ``m`` only ``max_s t_s`` matters,
which CP-SAT minimises over contiguous assignments; an outer loop tries every ``m``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..costmodel.pipeline import schedule_pipeline


@dataclass(frozen=True, slots=True)
class LayerCosts:
    """Per-device costs of the layers (in order) and of what comes before and after them."""

    time: tuple[float, ...]
    """Seconds of forward + backward per layer for the whole batch (on the stage's sub-mesh)."""
    state_bytes: tuple[float, ...]
    """Parameters, gradients and optimizer state per layer."""
    activation_bytes: tuple[float, ...]
    """Activations one layer keeps for backward, for the whole batch (scaled by 1/m)."""
    pre_time: float = 0.0
    """Embedding and the like: runs on the first stage."""
    post_time: float = 0.0
    """Final norm, head, loss: run on the last stage."""
    pre_bytes: float = 0.0
    post_bytes: float = 0.0
    boundary_bytes: float = 0.0
    """Activation bytes handed between stages, for the whole batch (scaled by 1/m)."""
    step_time: float = 0.0
    """Once-per-step work that pipelining does not divide (gradient sync, optimizer)."""
    forward_fraction: float = 1 / 3
    """Share of a layer's time that is forward (backward ~2x forward)."""

    @property
    def num_layers(self) -> int:
        return len(self.time)


@dataclass(frozen=True, slots=True)
class StageAssignment:
    bounds: tuple[int, ...]
    """First layer of each stage (``bounds[0] == 0``)."""
    microbatches: int
    schedule: str
    step_time: float
    """Modelled seconds (objective formula, hand-offs and per-step work included)."""
    stage_times: tuple[float, ...]
    stage_memory: tuple[float, ...]
    chunks: int = 1
    """Model chunks per device (virtual stages) of an interleaved 1F1B schedule."""

    @property
    def stages(self) -> int:
        return len(self.bounds)

    def layer_ranges(self, num_layers: int) -> list[range]:
        ends = [*self.bounds[1:], num_layers]
        return [range(a, b) for a, b in zip(self.bounds, ends, strict=True)]


def in_flight(schedule: str, stage: int, stages: int, microbatches: int, chunks: int = 1) -> float:
    """Micro-batches of activations stage ``stage`` holds at its peak, in units of the whole
    stage. Interleaved 1F1B runs ``2 (p - s - 1) + (v - 1) p`` warm-up forwards of one chunk
    (``1 / v`` of the stage) before its first backward (Megatron-LM's schedule; on stage 0 this
    is Narayanan'21's ``p (1 + (p - 1) / (p v))``); ``costmodel.pipeline``'s event simulation
    counts the same."""
    if schedule == "gpipe":
        return microbatches
    if schedule == "interleaved" and chunks > 1:
        warmup = 2 * (stages - stage - 1) + (chunks - 1) * stages
        return min((warmup + 1) / chunks, microbatches)
    return min(stages - stage, microbatches)


def evaluate_split(
    costs: LayerCosts, bounds: tuple[int, ...], m: int, schedule: str, p2p: float, chunks: int = 1
) -> tuple[float, tuple[float, ...], tuple[float, ...]]:
    """(step time, per-stage times, per-stage memory) of one split; p2p per micro-batch hand-off.

    Interleaved 1F1B with ``v = chunks`` model chunks per device fills and drains through
    chunks ``v`` times shorter: ``(sum_s t_s / v + (m - 1 / v) max_s t_s) / m``, which for equal
    stages is Narayanan'21's bubble ``(p - 1) / v`` micro-batch times; its fill and drain cross
    ``p v - 1`` hand-offs each instead of ``p - 1`` (the price of more chunks; the event
    simulation of ``costmodel.pipeline`` exposes exactly these)."""
    p = len(bounds)
    ends = [*bounds[1:], costs.num_layers]
    times, memory = [], []
    for s, (a, b) in enumerate(zip(bounds, ends, strict=True)):
        t = (
            sum(costs.time[a:b])
            + (costs.pre_time if s == 0 else 0)
            + (costs.post_time if s == p - 1 else 0)
        )
        state = sum(costs.state_bytes[a:b]) + (costs.pre_bytes if s == 0 else 0)
        state += costs.post_bytes if s == p - 1 else 0
        act = sum(costs.activation_bytes[a:b]) / m * in_flight(schedule, s, p, m, chunks)
        times.append(t)
        memory.append(state + act)
    v = chunks if schedule == "interleaved" else 1
    hops = 2 * (p * v - 1) if p > 1 else 0
    step = (sum(times) / v + (m - 1 / v) * max(times)) / m + hops * p2p + costs.step_time
    return step, tuple(times), tuple(memory)


def assign_stages(
    costs: LayerCosts,
    stages: int,
    microbatch_options: list[int],
    memory_limit: float = math.inf,
    schedule: str = "1f1b",
    p2p_bandwidth: float = math.inf,
    p2p_latency: float = 0.0,
    time_limit: float = 10.0,
    chunk_options: Sequence[int] = (1,),
) -> StageAssignment | None:
    """The best contiguous split, micro-batch count and chunk count; None if nothing fits.

    ``chunk_options``: model chunks per device to consider; ``1`` is ``schedule`` itself
    (1F1B or GPipe), ``v > 1`` interleaved 1F1B with ``v`` chunks (needs ``m`` divisible by
    the stage count and ``v`` layers per stage). For a fixed ``m`` the step grows with the
    longest stage only, and interleaving keeps more micro-batches in flight than 1F1B on
    every stage, so the 1F1B optimum is also the interleaved one whenever it fits; CP-SAT
    solves again only when it does not."""
    if stages > costs.num_layers:
        return None
    best: StageAssignment | None = None
    for m in sorted(set(microbatch_options)):
        p2p = _p2p(costs, m, p2p_bandwidth, p2p_latency) if stages > 1 else 0.0
        base = _solve_fixed_m(costs, stages, m, memory_limit, schedule, time_limit)
        if base is None:
            continue  # interleaving needs more memory on every stage: it cannot fit either
        for v in sorted(set(chunk_options)):
            kind = "interleaved" if v > 1 else schedule
            if v > 1 and (m % stages or v * stages > costs.num_layers or schedule == "gpipe"):
                continue
            bounds = base
            if v > 1 and not _fits(costs, base, m, v, memory_limit):
                bounds = _solve_fixed_m(costs, stages, m, memory_limit, kind, time_limit, v)
                if bounds is None:
                    continue
            step, times, memory = evaluate_split(costs, bounds, m, kind, p2p, v)
            if best is None or step < best.step_time - 1e-15:
                best = StageAssignment(bounds, m, kind, step, times, memory, v)
    return best


def _fits(costs: LayerCosts, bounds: tuple[int, ...], m: int, v: int, limit: float) -> bool:
    """Whether ``bounds`` gives every stage ``v`` layers and fits interleaved with ``v`` chunks."""
    ends = [*bounds[1:], costs.num_layers]
    if any(b - a < v for a, b in zip(bounds, ends, strict=True)):
        return False
    _, _, memory = evaluate_split(costs, bounds, m, "interleaved", 0.0, v)
    return max(memory) <= limit


def _p2p(costs: LayerCosts, m: int, bandwidth: float, latency: float) -> float:
    nbytes = costs.boundary_bytes / m
    return latency + (nbytes / bandwidth if math.isfinite(bandwidth) else 0.0)


def _solve_fixed_m(
    costs: LayerCosts, p: int, m: int, limit: float, schedule: str, time_limit: float,
    chunks: int = 1,
) -> tuple[int, ...] | None:  # fmt: skip
    """CP-SAT: y[l][s] one-hot, stage index non-decreasing by at most 1, minimise max stage time
    (with ``chunks`` > 1: at least that many layers per stage)."""
    n = costs.num_layers
    from ortools.sat.python import cp_model  # lazily: it pulls in pandas (solver/ilp.py)

    scale = 1e6 / max(max(costs.time, default=0) + costs.pre_time + costs.post_time, 1e-30)
    model = cp_model.CpModel()
    y = [[model.NewBoolVar(f"y{l}_{s}") for s in range(p)] for l in range(n)]
    stage_of = []
    for l in range(n):
        model.AddExactlyOne(y[l])
        stage_of.append(sum(s * y[l][s] for s in range(p)))
    model.Add(stage_of[0] == 0)
    model.Add(stage_of[-1] == p - 1)
    for l in range(n - 1):
        model.Add(stage_of[l + 1] - stage_of[l] >= 0)
        model.Add(stage_of[l + 1] - stage_of[l] <= 1)
    t_max = model.NewIntVar(0, 2**50, "t_max")
    for s in range(p):
        extra = (costs.pre_time if s == 0 else 0) + (costs.post_time if s == p - 1 else 0)
        model.Add(
            t_max
            >= sum(round(costs.time[l] * scale) * y[l][s] for l in range(n)) + round(extra * scale)
        )
        if chunks > 1:
            model.Add(sum(y[l][s] for l in range(n)) >= chunks)
        if math.isfinite(limit):
            _stage_memory_row(model, costs, y, s, p, m, schedule, limit, chunks)
    model.Minimize(t_max)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.max_time_in_seconds = time_limit
    if solver.Solve(model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    stage = [sum(s * solver.Value(y[l][s]) for s in range(p)) for l in range(n)]
    return tuple(l for l in range(n) if l == 0 or stage[l] != stage[l - 1])


def _stage_memory_row(model, costs, y, s, p, m, schedule, limit, chunks=1) -> None:
    """m * (state + activations * in_flight / m) <= m * (limit - fixed), in whole bytes."""
    keep = in_flight(schedule, s, p, m, chunks)
    fixed = (costs.pre_bytes if s == 0 else 0) + (costs.post_bytes if s == p - 1 else 0)
    terms = [
        round(m * costs.state_bytes[l] + costs.activation_bytes[l] * keep) * y[l][s]
        for l in range(costs.num_layers)
    ]
    model.Add(sum(terms) <= math.floor(m * (limit - fixed)))


def brute_force_stages(
    costs: LayerCosts,
    stages: int,
    microbatch_options: list[int],
    memory_limit: float = math.inf,
    schedule: str = "1f1b",
    p2p_bandwidth: float = math.inf,
    p2p_latency: float = 0.0,
    chunk_options: Sequence[int] = (1,),
) -> StageAssignment | None:
    """Every contiguous split x every m x every chunk count: the ground truth for tests."""
    best: StageAssignment | None = None
    n = costs.num_layers
    for m, v in itertools.product(sorted(set(microbatch_options)), sorted(set(chunk_options))):
        if v > 1 and (m % stages or schedule == "gpipe"):
            continue
        kind = "interleaved" if v > 1 else schedule
        p2p = _p2p(costs, m, p2p_bandwidth, p2p_latency) if stages > 1 else 0.0
        for cuts in itertools.combinations(range(1, n), stages - 1):
            bounds = (0, *cuts)
            if min(b - a for a, b in zip(bounds, (*cuts, n), strict=True)) < v:
                continue
            step, times, memory = evaluate_split(costs, bounds, m, kind, p2p, v)
            if max(memory) > memory_limit:
                continue
            if best is None or step < best.step_time - 1e-15:
                best = StageAssignment(bounds, m, kind, step, times, memory, v)
    return best


def simulate(costs: LayerCosts, assignment: StageAssignment, p2p: float = 0.0) -> float:
    """Event-simulated step time of an assignment (costmodel.pipeline), for reports."""
    f = costs.forward_fraction
    per_mb = [t / assignment.microbatches for t in assignment.stage_times]
    result = schedule_pipeline(
        [t * f for t in per_mb], [t * (1 - f) for t in per_mb], assignment.microbatches,
        schedule=assignment.schedule, p2p=p2p,
    )  # fmt: skip
    return result.step_time + costs.step_time
