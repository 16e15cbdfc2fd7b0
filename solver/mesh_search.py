"""Mesh-shape search: try every (pp, dp, tp) factorisation of the device count, keep the best.

Tensor parallelism stays inside a node (the innermost axis), data and pipeline parallelism go
across nodes; each candidate is planned in full (intra-op ILP, and stage assignment when pp > 1)
and the table of all candidates, with the reason for each rejection, comes back with the plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..costmodel import get_cluster
from ..ir import Graph, Mesh, ShardplanError
from .plan import Plan


@dataclass(frozen=True, slots=True)
class Candidate:
    mesh: dict[str, int]
    step_time: float | None
    """Modelled seconds; None when rejected."""
    peak_memory_bytes: float | None
    plan_seconds: float
    rejected: str = ""


def mesh_candidates(devices: int, devices_per_node: int) -> list[dict[str, int]]:
    """(pp, dp, tp) with tp dividing a node, in a fixed order (deterministic search)."""
    out = []
    for tp in _divisors(devices):
        if tp > devices_per_node:
            continue
        for pp in _divisors(devices // tp):
            dp = devices // (tp * pp)
            out.append({"pp": pp, "dp": dp, "tp": tp})
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search_mesh(
    graph: Graph,
    devices: int,
    cluster: str,
    memory_limit: float | None = None,
    time_limit: float = 30.0,
    max_stages: int | None = None,
    **planner_options,
) -> Plan:
    """The best plan over all mesh shapes; ``plan.candidates`` lists every one tried."""
    from .pipeline import plan_pipeline

    per_node = get_cluster(cluster).devices_per_node
    table: list[Candidate] = []
    best: Plan | None = None
    for shape in mesh_candidates(devices, per_node):
        if max_stages is not None and shape["pp"] > max_stages:
            continue
        axes = [(name, size) for name, size in shape.items() if size > 1] or [("dp", 1)]
        mesh = Mesh(axes, cluster=cluster)
        start = time.perf_counter()
        try:
            if shape["pp"] > 1:
                plan = plan_pipeline(
                    graph, mesh, memory_limit=memory_limit, time_limit=time_limit, **planner_options
                )
            else:
                from .planner import plan_graph

                plan = plan_graph(
                    graph, mesh, memory_limit=memory_limit, time_limit=time_limit, **planner_options
                )
        except ShardplanError as error:
            table.append(
                Candidate(shape, None, None, time.perf_counter() - start, _first_line(error))
            )
            continue
        elapsed = time.perf_counter() - start
        table.append(Candidate(shape, plan.step_time, plan.peak_memory_bytes, elapsed))
        if best is None or plan.step_time < best.step_time:
            best = plan
    if best is None:
        reasons = "; ".join(f"{c.mesh}: {c.rejected}" for c in table)
        raise ShardplanError(f"no mesh shape of {devices} devices gives a plan: {reasons}")
    best.candidates = table
    return best


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0][:200]


def format_candidates(table: list[Candidate]) -> str:
    """A plain-text table of the candidates, best first, rejected last."""
    rows = sorted(table, key=lambda c: (c.step_time is None, c.step_time or 0.0))
    lines = [
        f"{'pp':>4} {'dp':>4} {'tp':>4} {'step (ms)':>11} {'peak (GiB)':>11} {'plan (s)':>9}  note"
    ]
    for c in rows:
        step = f"{c.step_time * 1e3:11.3f}" if c.step_time is not None else f"{'-':>11}"
        peak = (
            f"{c.peak_memory_bytes / 2**30:11.2f}"
            if c.peak_memory_bytes is not None
            else f"{'-':>11}"
        )
        lines.append(
            f"{c.mesh['pp']:>4} {c.mesh['dp']:>4} {c.mesh['tp']:>4} {step} {peak} "
            f"{c.plan_seconds:9.2f}  {c.rejected}"
        )
    return "\n".join(lines)
