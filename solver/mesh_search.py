"""Mesh-shape search: try every (pp, dp, tp) factorisation of the device count, keep the best.

Tensor parallelism stays inside a node (the innermost axis), data and pipeline parallelism go
across nodes; each candidate is planned in full (intra-op ILP, and stage assignment when pp > 1)
and the table of all candidates, with the reason for each rejection, comes back with the plan.

On a cluster with islands (``Cluster.islands``: pods joined by a DCN) the search also tries,
for each shape whose ``dp`` axis spans ``r`` islands, the split ``(pp, dcn=r, dp/r, tp)``: ``dcn``
crosses the islands and ``dp/r x tp`` fills one island, so the planner may shard state inside
an island only (HSDP: ZeRO inside, replicas across) where one flat ``dp`` axis would shard it
over the DCN too. Each candidate lists the axes that cross islands.

With ``top_k`` the learned predictor (``shardplan/solver/predictor.py``) ranks the shapes first and
only the ``top_k`` best are planned (more when some of them are rejected, until ``top_k`` give
plans, and every shape the predictor scores within 1% of the k-th planned one: shapes it
cannot tell apart share the k-th place); the others stay in the table as skipped, with their
predicted step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from ..costmodel import Cluster, axis_links, get_cluster
from ..ir import Graph, Mesh, ShardplanError
from ..ir.errors import ArgumentError, InfeasiblePlanError
from .plan import Plan


@dataclass(frozen=True, slots=True)
class Candidate:
    mesh: dict[str, int]
    step_time: float | None
    """Modelled seconds; None when rejected."""
    peak_memory_bytes: float | None
    plan_seconds: float
    rejected: str = ""
    across_islands: tuple[str, ...] = ()
    """Axes whose groups cross islands (over the DCN)."""


def mesh_candidates(
    devices: int, devices_per_node: int, devices_per_island: int | None = None
) -> list[dict[str, int]]:
    """(pp, dp, tp) with tp dividing a node, in a fixed order (deterministic search); with
    islands, also (pp, dcn, dp, tp) where ``dp x tp`` fills one island (module docstring)."""
    out = []
    for tp in _divisors(devices):
        if tp > devices_per_node:
            continue
        for pp in _divisors(devices // tp):
            dp = devices // (tp * pp)
            out.append({"pp": pp, "dp": dp, "tp": tp})
            split = _island_split(devices, devices_per_island, pp, dp)
            if split:
                out.append({"pp": pp, "dcn": split, "dp": dp // split, "tp": tp})
    return out


def _island_split(devices: int, island: int | None, pp: int, dp: int) -> int:
    """How many islands ``dp`` spans when ``pp`` covers fewer than all of them (0: none)."""
    if not island or devices <= island or devices % island:
        return 0
    islands = devices // island
    if islands % pp or islands == pp:
        return 0
    spans = islands // pp
    return spans if dp % spans == 0 and dp > spans else 0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search_mesh(
    graph: Graph,
    devices: int,
    cluster: str,
    memory_limit: float | None = None,
    time_limit: float = 30.0,
    max_stages: int | None = None,
    top_k: int | None = None,
    schedule: str = "1f1b",
    microbatches: int | None = None,
    **planner_options,
) -> Plan:
    """The best plan over all mesh shapes (or the predictor's ``top_k``); ``plan.candidates``
    lists every one tried. ``schedule`` and ``microbatches`` apply to shapes with ``pp > 1``."""
    spec = get_cluster(cluster)
    island = spec.islands[0].devices if spec.islands else None
    table: list[Candidate] = []
    best: Plan | None = None
    best_key: tuple[float, int] = (0.0, 0)
    shapes = [
        shape
        for shape in mesh_candidates(devices, spec.devices_per_node, island)
        if max_stages is None or shape["pp"] <= max_stages
    ]
    predicted: dict[tuple, float] = {}
    position = {tuple(shape.items()): n for n, shape in enumerate(shapes)}
    if top_k is not None:
        shapes, predicted = _ranked(graph, shapes, spec, memory_limit, top_k)
    planned, kth = 0, 0.0
    for shape in shapes:
        guess = predicted.get(tuple(shape.items()), 0.0)
        if top_k is not None and planned >= top_k and not _tied(guess, kth):
            table.append(_skipped(shape, guess, spec))
            continue
        candidate, plan = _plan_shape(graph, shape, cluster, spec, memory_limit, time_limit,
                                      (schedule, microbatches), planner_options)  # fmt: skip
        table.append(candidate)
        if plan is None:
            continue
        planned += 1
        if planned == top_k:
            kth = guess  # the k-th place: shapes scored alike with it are planned too
        key = (plan.step_time, position[tuple(shape.items())])  # ties: the first shape in the
        if best is None or key < best_key:  # exhaustive order, whatever order they are planned
            best, best_key = plan, key
    if best is None:
        reasons = "; ".join(f"{c.mesh}: {c.rejected}" for c in table)
        raise InfeasiblePlanError(f"no mesh shape of {devices} devices gives a plan: {reasons}")
    return replace(best, candidates=table)


def _plan_shape(graph: Graph, shape: dict[str, int], cluster: str, spec: Cluster,
                memory_limit, time_limit: float, pipelined: tuple, planner_options: dict):  # type: ignore[no-untyped-def]  # fmt: skip
    """(the shape's row of the candidate table, its plan or None when it was rejected);
    ``pipelined``: (schedule, microbatches) for a shape with ``pp > 1``."""
    from .pipeline import plan_pipeline

    axes = [(name, size) for name, size in shape.items() if size > 1] or [("dp", 1)]
    mesh = Mesh(axes, cluster=spec)
    links = axis_links(mesh, spec)
    across = tuple(a for a in mesh.axis_names if links[a].startswith("inter-island"))
    start = time.perf_counter()
    try:
        if shape["pp"] > 1:
            plan = plan_pipeline(
                graph, mesh, memory_limit=memory_limit, time_limit=time_limit,
                schedule=pipelined[0], microbatches=pipelined[1], **planner_options,
            )  # fmt: skip
        else:
            from .planner import plan_graph

            plan = plan_graph(
                graph, mesh, memory_limit=memory_limit, time_limit=time_limit, **planner_options
            )
    except ShardplanError as error:
        elapsed = time.perf_counter() - start
        return Candidate(shape, None, None, elapsed, _first_line(error), across), None
    elapsed = time.perf_counter() - start
    row = Candidate(shape, plan.step_time, plan.peak_memory_bytes, elapsed, "", across)
    return row, plan


def _ranked(
    graph: Graph,
    shapes: list[dict[str, int]],
    spec: Cluster,
    memory_limit: float | None,
    top_k: int,
) -> tuple[list[dict[str, int]], dict[tuple, float]]:
    """``shapes`` best first by the default predictor, and each one's predicted seconds."""
    from .predictor import default_predictor

    if top_k < 1:
        raise ArgumentError(f"mesh_top_k={top_k}: plan at least one shape (or leave it out)")
    ranked = default_predictor().rank(graph, shapes, spec, memory_limit)
    return [s for s, _ in ranked], {tuple(s.items()): t for s, t in ranked}


TIE = 0.01
"""Predicted steps within 1% of each other are alike to the predictor: its held-out error
is larger than that, and the planner's best pp = 1 shapes often differ by less."""


def _tied(guess: float, kth: float) -> bool:
    """The predictor scores ``guess`` alike with the k-th planned shape (it cannot tell them
    apart, so the top k take both: the k-th place is shared)."""
    if not (math.isfinite(guess) and math.isfinite(kth)):  # predicted rejected: never planned
        return False
    return guess <= kth * (1 + TIE)


def _skipped(shape: dict[str, int], seconds: float, spec: Cluster) -> Candidate:
    axes = [(name, size) for name, size in shape.items() if size > 1] or [("dp", 1)]
    links = axis_links(Mesh(axes, cluster=spec.name), spec)
    across = tuple(a for a, level in links.items() if level.startswith("inter-island"))
    note = f"not planned: predicted {seconds * 1e3:.3f} ms, outside the predictor's top-k"
    return Candidate(shape, None, None, 0.0, note, across)


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0][:200]


def format_candidates(table: list[Candidate]) -> str:
    """A plain-text table of the candidates, best first, rejected last."""
    rows = sorted(table, key=lambda c: (c.step_time is None, c.step_time or 0.0))
    lines = [
        f"{'pp':>4} {'dp':>6} {'tp':>4} {'step (ms)':>11} {'peak (GiB)':>11} {'plan (s)':>9}  note"
    ]
    for c in rows:
        step = f"{c.step_time * 1e3:11.3f}" if c.step_time is not None else f"{'-':>11}"
        peak = (
            f"{c.peak_memory_bytes / 2**30:11.2f}"
            if c.peak_memory_bytes is not None
            else f"{'-':>11}"
        )
        dp = f"{c.mesh['dcn']}x{c.mesh['dp']}" if "dcn" in c.mesh else str(c.mesh["dp"])
        note = c.rejected
        if c.across_islands:
            note = f"across islands: {','.join(c.across_islands)}" + (f"; {note}" if note else "")
        lines.append(
            f"{c.mesh['pp']:>4} {dp:>6} {c.mesh['tp']:>4} {step} {peak} "
            f"{c.plan_seconds:9.2f}  {note}"
        )
    return "\n".join(lines)
