"""Serving plans: a prefill or decode step with a KV cache, for latency or throughput.

``sp.plan(model, ids, mesh=..., mode="decode", context_len=4096, objective="throughput",
max_batch=256)`` plans one step per candidate batch (the frontend captures each) and keeps the
batch the objective prefers:

- ``"latency"``: the fastest step (a decode step is the per-token latency; a prefill, the
  time to the first token). Without ``max_batch`` the example's batch is planned as given.
- ``"throughput"``: the most tokens per second per device, the batch free in powers of two up
  to ``max_batch`` (default: the example's batch). A decode step streams every weight once
  whatever the batch, so larger batches share that read; the search stops at the first batch
  whose KV cache or activations do not fit.
- ``latency_bound=`` (seconds per step: per output token for decode; implies
  ``"throughput"``): continuous batching's regime, where an engine keeps as many sequences in
  flight as its KV cache and the latency target allow. The batch is the *largest* whole
  number whose step meets the bound and whose cache fits (``max_batch`` caps it when given),
  found by doubling to the first batch that misses and bisecting below it: it assumes the
  step time does not fall as the batch grows (a decode step reads the same weights and more
  cache). Its tokens/s are ``batch / step``. Even batch 1 missing the bound is an
  ``InfeasiblePlanError`` naming the least latency the plan reaches.

Before any planning, a cache that cannot fit even split over every device is refused with the
bytes it is over by. Each plan carries a ``ServingReport`` (``plan.serving``): both metrics, the
roofline of the step (bytes of weights and cache streamed against FLOPs: decode is bound by
memory bandwidth) and the table of batches tried with the reason for the choice.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..costmodel.cluster import Cluster, cluster_of
from ..costmodel.memory import gib
from ..ir import Graph, InfeasiblePlanError, Mesh, Role
from ..ir.errors import ArgumentError
from ..ir.op_cost import op_bytes, op_flops
from .plan import Plan

OBJECTIVES = ("latency", "throughput")


@dataclass(frozen=True, slots=True)
class Roofline:
    """One step on one device as the roofline sees it (sums over ops of the plan's layouts)."""

    flops: float
    """FLOPs per device (an op's work divided by its largest tensor's shard count)."""
    bytes: float
    """HBM bytes per device (every op's local operands and results, unfused)."""
    weight_bytes: int
    """Weight bytes held per device (a replicated weight may be read only in part: an op
    that consumes it split reads its slice)."""
    cache_bytes: int
    math_seconds: float
    memory_seconds: float

    @property
    def bound(self) -> str:
        return "memory" if self.memory_seconds >= self.math_seconds else "compute"

    @property
    def intensity(self) -> float:
        """FLOPs per HBM byte (an H100 needs ~300 in bf16 to be compute-bound)."""
        return self.flops / self.bytes if self.bytes else 0.0


@dataclass(frozen=True, slots=True)
class Candidate:
    batch: int
    step_time: float | None
    """Seconds of one step; None: the batch did not fit."""
    tokens_per_second_per_device: float | None
    peak_bytes: int | None
    note: str = ""


@dataclass
class ServingReport:
    """Both serving metrics of the chosen plan, its roofline and the batches tried."""

    mode: str
    objective: str
    batch: int
    context_len: int
    tokens_per_step: int
    """New tokens a step produces per replica: ``batch`` (decode) or ``batch * seq``
    (prefill: the prompt tokens it processes)."""
    step_time: float
    """Seconds of one step: the per-token latency (decode) or the prefill time."""
    devices: int
    roofline: Roofline
    candidates: list[Candidate] = field(default_factory=list)
    reason: str = ""
    latency_bound: float | None = None
    """Seconds a step may take (``sp.plan(latency_bound=...)``), or None."""

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_time if self.step_time else 0.0

    @property
    def tokens_per_second_per_device(self) -> float:
        return self.tokens_per_second / self.devices

    def __str__(self) -> str:
        what = "per-token latency" if self.mode == "decode" else "prefill time"
        r = self.roofline
        lines = [
            f"serving        {self.mode}, objective {self.objective}: batch {self.batch}, "
            f"context {self.context_len}",
            f"               {what} {self.step_time * 1e3:.3f} ms, "
            f"{self.tokens_per_second_per_device:,.0f} tokens/s per device "
            f"({self.tokens_per_second:,.0f} on {self.devices} devices)",
            f"roofline       {r.bound}-bound: {r.bytes / 1e9:.2f} GB per device per step "
            f"(holding weights {r.weight_bytes / 1e9:.2f} GB, KV cache {r.cache_bytes / 1e9:.2f} "
            "GB) "
            f"-> {r.memory_seconds * 1e3:.3f} ms at HBM bandwidth; {r.flops / 1e9:.1f} GFLOP "
            f"-> {r.math_seconds * 1e3:.3f} ms at peak ({r.intensity:.1f} FLOP/byte)",
        ]
        if self.reason:
            lines.append(f"batch choice   {self.reason}")
        return "\n".join(lines)


def roofline(plan: Plan, cluster: Cluster) -> Roofline:
    """FLOPs and HBM bytes of one step per device under the plan's layouts."""
    graph, mesh = plan.graph, plan.mesh
    flops = moved = 0.0
    math_s = memory_s = 0.0
    for i, op in enumerate(graph.ops):
        ins = [v.type for v in op.operands]
        outs = [r.type for r in op.results]
        in_shards = [
            plan.operand_shardings.get((i, j), plan.shardings[v.name]).shard_count(mesh)
            for j, v in enumerate(op.operands)
        ]
        out_shards = [plan.shardings[r.name].shard_count(mesh) for r in op.results]
        split = max(in_shards + out_shards + [1])
        f = op_flops(op.kind, op.rule, ins, outs, op.attrs) / split * op.repeat
        b = op_bytes(op.kind, ins, outs, in_shards, out_shards, attrs=op.attrs, split=split)
        b *= op.repeat
        dtype = (outs or ins)[0].dtype
        flops += f
        moved += b
        math_s += f / (cluster.peak(dtype) * cluster.compute_efficiency)
        memory_s += b / (cluster.hbm_bandwidth * cluster.memory_efficiency)
    weights = cache = 0
    for v in graph.inputs:
        local = v.type.nbytes // plan.shardings[v.name].shard_count(mesh)
        if v.role is Role.PARAMETER:
            weights += local
        elif v.role is Role.KV_CACHE:
            cache += local
    return Roofline(flops, moved, weights, cache, math_s, memory_s)


def check_cache_fits(graph: Graph, mesh: Mesh, memory_limit: float | None) -> None:
    """Refuse a step whose KV cache plus weights exceed the limit even split over every
    device (no layout can fit it), saying by how much and what to change."""
    cluster = cluster_of(mesh)
    limit = memory_limit if memory_limit is not None else cluster.hbm_capacity
    devices = mesh.size
    cache = sum(v.type.nbytes for v in graph.inputs if v.role is Role.KV_CACHE)
    weights = sum(v.type.nbytes for v in graph.inputs if v.role is Role.PARAMETER)
    if not cache:
        return
    least = math.ceil(cache / devices) + math.ceil(weights / devices)
    if least > limit:
        raise InfeasiblePlanError(
            f"the KV cache does not fit: {gib(cache)} of cache and {gib(weights)} of weights "
            f"need at least {gib(least)} per device even split over all {devices} devices, "
            f"{gib(least - limit)} over the {gib(limit)} limit; lower the batch or "
            "context_len, or plan on more devices"
        )


def batch_candidates(batch: int, max_batch: int | None) -> list[int]:
    """Batches to plan: the example's alone, or powers of two up to ``max_batch`` (and it)."""
    if max_batch is None:
        return [batch]
    out = [b for b in (2**k for k in range(max_batch.bit_length())) if b <= max_batch]
    if max_batch not in out:
        out.append(max_batch)
    return out


def check_serving_args(
    objective: str | None, max_batch: object, mode: str | None, latency_bound: object = None
) -> None:
    if latency_bound is not None:
        _check_latency_bound(latency_bound, objective, mode)
    if objective is not None and objective not in OBJECTIVES:
        raise ArgumentError(
            f"sp.plan(objective={objective!r}): objective is 'latency' or 'throughput'"
        )
    if max_batch is not None and (
        isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1
    ):
        raise ArgumentError(f"sp.plan(max_batch={max_batch!r}): max_batch is a whole number >= 1")
    if (objective is not None or max_batch is not None) and mode not in ("prefill", "decode"):
        raise ArgumentError(
            "objective= and max_batch= plan a serving step: pass mode='decode' (with "
            "context_len=) or mode='prefill'"
        )


def _check_latency_bound(latency_bound: object, objective: str | None, mode: str | None) -> None:
    if (
        isinstance(latency_bound, bool)
        or not isinstance(latency_bound, int | float)
        or not math.isfinite(latency_bound)
        or latency_bound <= 0
    ):
        raise ArgumentError(
            f"sp.plan(latency_bound={latency_bound!r}): latency_bound is seconds per step "
            "(per output token for mode='decode'), a number > 0, e.g. 0.05"
        )
    if objective == "latency":
        raise ArgumentError(
            "sp.plan(latency_bound=..., objective='latency'): a latency bound asks for the most "
            "tokens/s under it; pass objective='throughput' or leave objective out"
        )
    if mode not in ("prefill", "decode"):
        raise ArgumentError(
            "latency_bound= plans a serving step: pass mode='decode' (with context_len=) or "
            "mode='prefill'"
        )


def plan_serving(
    plan_at: Callable[[int], Plan],
    batch: int,
    mode: str,
    context_len: int,
    seq: int,
    objective: str | None,
    max_batch: int | None,
    latency_bound: float | None = None,
) -> Plan:
    """Plan each candidate batch with ``plan_at(batch)`` and keep the objective's best.

    ``plan_at`` raises ``InfeasiblePlanError`` for a batch that does not fit; the search over
    increasing batches stops there (a larger batch only holds more). With ``latency_bound``
    the batch is the largest that meets it (``largest_within``)."""
    if latency_bound is not None:
        found, plan, table = largest_within(plan_at, latency_bound, max_batch, mode, seq)
        return _bounded_plan(found, plan, table, mode, context_len, seq, latency_bound)
    objective = objective or "latency"
    if max_batch is None and objective == "throughput":
        max_batch = batch
    batches = batch_candidates(batch, max_batch)
    plans: dict[int, Plan] = {}
    table: list[Candidate] = []
    refusal: InfeasiblePlanError | None = None
    for b in batches:
        try:
            plan = plan_at(b)
        except InfeasiblePlanError as exc:
            refusal = exc
            table.append(Candidate(b, None, None, None, f"does not fit: {exc}"))
            break
        plans[b] = plan
        devices = plan.mesh.size
        tokens = b * (seq if mode == "prefill" else 1)
        table.append(
            Candidate(b, plan.step_time, tokens / plan.step_time / devices, plan.peak_memory_bytes)
        )
    if not plans:
        assert refusal is not None
        raise refusal
    fits = [c for c in table if c.step_time is not None]
    if objective == "latency":
        best = min(fits, key=lambda c: (c.step_time, c.batch))
    else:
        best = max(fits, key=lambda c: (c.tokens_per_second_per_device, -c.batch))
    plan = plans[best.batch]
    cluster = cluster_of(plan.mesh)
    tokens = best.batch * (seq if mode == "prefill" else 1)
    report = ServingReport(
        mode, objective, best.batch, context_len, tokens, plan.step_time, plan.mesh.size,
        roofline(plan, cluster), table, _reason(objective, best, table),
    )  # fmt: skip
    return replace(plan, serving=report)


def _reason(objective: str, best: Candidate, table: list[Candidate]) -> str:
    if len(table) == 1:
        return f"batch {best.batch} as given (pass max_batch= to let the batch vary)"
    first = next(c for c in table if c.step_time is not None)
    over = next((c for c in table if c.step_time is None), None)
    stop = f"; batch {over.batch} does not fit" if over else ""
    if objective == "latency":
        return (
            f"batch {best.batch}: the fastest step ({best.step_time * 1e3:.3f} ms) of the "
            f"batches tried{stop}"
        )
    assert best.step_time is not None
    assert first.step_time is not None
    assert best.tokens_per_second_per_device
    assert first.tokens_per_second_per_device
    gain = best.tokens_per_second_per_device / first.tokens_per_second_per_device
    return (
        f"batch {best.batch}: the step streams the same weights whatever the batch, so "
        f"{best.batch // first.batch}x the sequences of batch {first.batch} cost "
        f"{best.step_time / first.step_time:.2f}x the time: {gain:.1f}x the tokens/s per "
        f"device{stop}"
    )


def _candidate(plan: Plan, batch: int, mode: str, seq: int, bound: float) -> Candidate:
    tokens = batch * (seq if mode == "prefill" else 1)
    note = "" if plan.step_time <= bound else f"misses the {bound * 1e3:.3f} ms bound"
    rate = tokens / plan.step_time / plan.mesh.size
    return Candidate(batch, plan.step_time, rate, plan.peak_memory_bytes, note)


def largest_within(
    plan_at: Callable[[int], Plan], bound: float, max_batch: int | None, mode: str, seq: int
) -> tuple[int, Plan, list[Candidate]]:
    """The largest batch whose step takes at most ``bound`` seconds and fits
    (at most ``max_batch``), its plan, and the table of batches tried in the order tried.

    Doubles the batch from 1 to the first that misses the bound or does not fit, then bisects
    between the last that met it and that one (``1 + log2`` plans each way)."""
    plans: dict[int, Plan] = {}
    table: list[Candidate] = []

    def meets(b: int) -> bool:
        try:
            plan = plan_at(b)
        except InfeasiblePlanError as exc:
            if b == 1:
                raise
            table.append(Candidate(b, None, None, None, f"does not fit: {exc}"))
            return False
        table.append(_candidate(plan, b, mode, seq, bound))
        if plan.step_time > bound:
            return False
        plans[b] = plan
        return True

    if not meets(1):
        least = table[0].step_time
        assert least is not None
        raise InfeasiblePlanError(
            f"latency_bound={bound * 1e3:.3f} ms: even batch 1 takes {least * 1e3:.3f} ms per "
            "step, the least this mesh reaches; raise the bound to at least that, or plan on "
            "more devices (a larger tensor-parallel axis) or a faster engine"
        )
    low, high = 1, None  # low meets the bound; high (when known) does not
    while high is None and (max_batch is None or low < max_batch):
        probe = 2 * low if max_batch is None else min(2 * low, max_batch)
        if meets(probe):
            low = probe
        else:
            high = probe
    while high is not None and high - low > 1:
        middle = (low + high) // 2
        if meets(middle):
            low = middle
        else:
            high = middle
    return low, plans[low], table


def _bounded_plan(
    batch: int, plan: Plan, table: list[Candidate], mode: str, context_len: int, seq: int,
    bound: float,
) -> Plan:  # fmt: skip
    """The chosen plan with its ``ServingReport`` (objective ``throughput`` under a bound)."""
    tokens = batch * (seq if mode == "prefill" else 1)
    above = [c for c in table if c.batch > batch]
    first_over = min(above, key=lambda c: c.batch) if above else None
    if first_over is None:
        why = "the max_batch cap"
    elif first_over.step_time is None:
        why = f"batch {first_over.batch} does not fit"
    else:
        why = f"batch {first_over.batch} takes {first_over.step_time * 1e3:.3f} ms"
    reason = (
        f"batch {batch}: the largest whose step ({plan.step_time * 1e3:.3f} ms) meets the "
        f"{bound * 1e3:.3f} ms bound; {why}"
    )
    report = ServingReport(
        mode, "throughput", batch, context_len, tokens, plan.step_time, plan.mesh.size,
        roofline(plan, cluster_of(plan.mesh)), table, reason, bound,
    )  # fmt: skip
    return replace(plan, serving=report)
