"""Step-time simulation: compute and communication streams, with dependencies.

One device's step as MAD-Max models it (Hsia et al., ISCA'24; re-derived, no code taken): a
compute stream runs the ops in graph order, communication streams run collectives in the
order they become ready, and each task starts at ``max(its stream's clock, its dependencies)``.
There is one communication stream per process group (its NCCL communicator), plus one for the
parameters each group gathers ahead (FSDP's all-gather stream: a prefetch never holds up a
collective needed now), and streams run concurrently on the links under them
(``comm_streams.py``): an FSDP all-gather over the NICs overlaps a tensor-parallel or expert
all-to-all on NVLink, and collectives of two streams on one link share its bandwidth, each
slowed by the time the other is in flight with it (processor sharing;
``SimulationOptions.concurrent_links=False``: one stream for all, as before).

- an op waits for its operands: a produced value, or the collectives resharding it for this op;
- a collective waits for its producer (an op result, or a pinned result's own reshard);
- a collective on a graph input (a parameter all-gather), or on a view of one (a weight's
  ``transpose``), may be issued early, but no more than ``prefetch_window`` layers ahead of its
  consumer (FSDP's one-layer prefetch);
- nothing else orders the comm stream, so gradient reductions run under the rest of backward
  while tensor-parallel collectives, needed at once, stay on the critical path;
- unless tensor-parallel communication overlap is on (``SimulationOptions.tp_overlap_axes``,
  Megatron-Core's ``--tp-comm-overlap``): then an all-gather feeding a GEMM, or a
  reduce-scatter fed by one, is split into chunks pipelined with that GEMM (``Transfer.pipelined``).

Exposed communication is the compute stream's idle time; the rest of the communication is
overlapped. Compute/communication contention for SMs and HBM is not modelled. Each op's
seconds come from ``op_times.py``, its phase from ``phases.py``; the planner's linear stand-in
for this simulation is ``exposure.py``.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from shardplan.ir.errors import ArgumentError
from shardplan.ir.graph import Graph, Op, Value
from shardplan.ir.op_cost import VIEW_KINDS
from shardplan.ir.registry import op_info

from .cluster import cluster_of
from .comm_streams import reshard_link
from .op_times import Plan, plan_op_times  # Plan: the fields read of a solver Plan
from .phases import layer_blocks, op_phases


@dataclass(frozen=True, slots=True)
class SimulationOptions:
    prefetch_window: int | None = 1
    """Layers ahead a graph input's collective may start (``None``: as early as t = 0)."""
    tp_overlap_axes: tuple[str, ...] = ()
    """Mesh axes whose collectives are pipelined with their GEMM (tensor-parallel
    communication overlap, Megatron-Core ``--tp-comm-overlap`` / Transformer Engine
    userbuffers): an all-gather whose consumer is a GEMM, or a reduce-scatter whose producer is
    one, is cut into one chunk per rank of its group and each chunk's GEMM runs while the next
    chunk moves. Two-stage pipeline of ``n`` chunks: the pair takes
    ``max(c, g) + min(c, g) / n`` instead of ``c + g``, i.e. the exposed communication is
    ``max(0, c - g) + min(c, g) / n`` (see ``Transfer.pipelined``). Empty: no such overlap."""
    concurrent_links: bool = True
    """One communication stream per process group (``Transfer.group``) and one for its
    prefetched parameter gathers, sharing the bandwidth of the link under them
    (``Transfer.link``): collectives on NVLink and on the NICs run at the same time, and two
    streams on one link share it while both are in flight. False: every collective queues on
    one stream."""


@dataclass(frozen=True, slots=True)
class Transfer:
    """The collectives on one edge, run back to back on the communication stream."""

    value: Value
    consumer: int | None
    """Index of the consuming op; ``None`` for a graph output or alias round trip."""
    time: float
    pin: bool = False
    """A pinned result's reshard: every consumer of ``value`` waits for it."""
    carried: Value | None = None
    """For an updated parameter's way back to its stored layout: the graph input it replaces.
    In steady state that collective overlaps the *next* step's start (Megatron's
    ``overlap_param_gather``), so it is simulated as a prefetch of ``carried`` for
    ``consumer``, its first use."""
    pipelined: str = ""
    """Chunked and pipelined with a GEMM (tensor-parallel communication overlap): ``"consumer"``
    for an all-gather feeding the GEMM ``consumer`` (the GEMM starts once the first chunk has
    arrived and ends no earlier than one GEMM chunk after the last), ``"producer"`` for a
    reduce-scatter of the GEMM that produces ``value`` (it starts once the first GEMM chunk is
    done and ends no earlier than one comm chunk after the GEMM); ``""``: not pipelined."""
    chunks: int = 1
    """Chunks of a pipelined transfer (one per rank of the collective's group)."""
    link: str = ""
    """The link level its collectives ride (``comm_streams.reshard_link``)."""
    group: tuple[str, ...] = ()
    """The mesh axes of its collectives (its process group's communicator): with
    ``SimulationOptions.concurrent_links`` each group has its own stream (and one for its
    prefetched parameter gathers), and a collective that starts while collectives of other
    streams are in flight on its link shares the link with each for as long as both run."""
    also: tuple[int, ...] = ()
    """Later consumers that read the same resharded buffer (the same value, source and target
    layout): a compiler or Megatron gathers once and every reader reuses the result, so they
    wait for this transfer and no collective of their own runs (``shared_reshards``)."""


@dataclass(frozen=True, slots=True)
class SimulationResult:
    """Step time and its parts, seconds on one device.

    Invariants: ``step_time = compute_time + exposed_comm_time``;
    ``comm_time = exposed_comm_time + overlapped_comm_time``.
    """

    step_time: float
    compute_time: float
    comm_time: float
    exposed_comm_time: float
    overlapped_comm_time: float
    exposed_by_phase: dict[str, float] = field(default_factory=dict)
    """Compute-stream idle time, by the phase of the op (or ``"tail"``) that waited."""

    def __str__(self) -> str:
        return (
            f"step {self.step_time * 1e3:.3f} ms = compute {self.compute_time * 1e3:.3f} ms + "
            f"exposed comm {self.exposed_comm_time * 1e3:.3f} ms "
            f"(overlapped {self.overlapped_comm_time * 1e3:.3f} ms)"
        )


# -- the two-stream simulation ------------------------------------------------------------------


class _Streams:
    """Clocks of both streams, the queue of ready collectives and what each op waits for."""

    def __init__(self, graph: Graph, transfers: Sequence[Transfer], options: SimulationOptions):
        self.transfers = list(transfers)
        self.end: dict[int, float] = {}  # job id -> end time, once scheduled
        self.start: dict[int, float] = {}  # job id -> start time, once scheduled
        self.floor: dict[int, float] = {}  # producer-pipelined job -> earliest end
        self.ready: dict[Value, float] = dict.fromkeys(graph.inputs, 0.0)
        # (ready time, first consumer, job id): by readiness, then the one needed soonest
        self.queue: list[tuple[float, int, int]] = []
        self.compute_clock = 0.0
        self.comm_clocks: dict[tuple, float] = {}  # (link, group, prefetch?) -> when free
        self.prefetched: set[int] = set()  # jobs on a group's prefetch stream
        self.flight: dict[str, list[tuple[float, tuple]]] = {}  # link -> (end, stream)
        self.concurrent = options.concurrent_links
        self.pin_job: dict[Value, int] = {}
        self.waiting: dict[Value, list[int]] = {}  # value -> edge jobs released when it is ready
        self.needs: dict[int, dict[Value, list[int]]] = {}  # op -> operand -> its edge jobs
        self.gated: dict[int, list[int]] = {}  # op index -> input jobs released on reaching it
        gates = _gates(graph, options.prefetch_window)
        for job, t in enumerate(self.transfers):
            read = t.carried if t.carried is not None else t.value
            for consumer in (t.consumer, *t.also) if t.consumer is not None else t.also:
                self.needs.setdefault(consumer, {}).setdefault(read, []).append(job)
            if t.pin:
                if t.value.producer is None:
                    raise ArgumentError(f"a pin reshard needs an op result, got %{t.value.name}")
                self.pin_job[t.value] = job
                self.waiting.setdefault(t.value, [])
            elif t.consumer is not None and (stored_view(t.value) or t.carried is not None):
                self.gated.setdefault(gates[t.consumer], []).append(job)
                self.prefetched.add(job)
            else:
                self.waiting.setdefault(t.value, []).append(job)
        for v in graph.inputs:
            self.release(v, 0.0)

    def release(self, value: Value, time: float, began: float | None = None) -> None:
        """``value`` is readable at ``time``: queue the collectives that were waiting for it.

        ``began``: when its producer op started. A reduce-scatter pipelined with that op may
        start after its first chunk and ends no earlier than one comm chunk after the op."""
        self.ready[value] = time
        for job in self.waiting.pop(value, []):
            t = self.transfers[job]
            if t.pipelined == "producer" and began is not None and t.chunks > 1:
                self.floor[job] = time + t.time / t.chunks
                self.push(began + (time - began) / t.chunks, job)
            else:
                self.push(time, job)

    def push(self, ready: float, job: int) -> None:
        """Queue ``job`` from ``ready`` on: collectives released together (a layer's prefetched
        gathers) run in the order their consumers need them."""
        t = self.transfers[job]
        need = min((t.consumer, *t.also)) if t.consumer is not None else len(self.needs) + job
        heapq.heappush(self.queue, (ready, need, job))

    def produced(self, value: Value, time: float, began: float | None = None) -> None:
        if value in self.pin_job:
            self.push(time, self.pin_job[value])
        else:
            self.release(value, time, began)

    def shared_time(self, t: Transfer, stream: tuple, start: float) -> float:
        """``t``'s seconds on a link it shares with the collectives of other streams still in
        flight there (processor sharing: while ``k`` run, each gets ``1 / k`` of the link).
        One in flight for ``r`` more seconds slows ``t`` by ``min(t.time, r)``, the time both
        run at half speed; the delay is counted on the newcomer (ends already scheduled stay),
        so the link still moves every byte at its full bandwidth."""
        if not self.concurrent or not t.link:
            return t.time
        flight = [(end, s) for end, s in self.flight.get(t.link, []) if end > start]
        self.flight[t.link] = flight
        return t.time + sum(min(t.time, end - start) for end, s in flight if s != stream)

    def stream(self, job: int) -> tuple:
        """The stream ``job`` queues on: its group's prefetch stream for a parameter gathered
        ahead (FSDP's all-gather stream), else its group's stream; one for all when links are
        not concurrent."""
        if not self.concurrent:
            return ("", (), False)
        t = self.transfers[job]
        return (t.link, t.group, job in self.prefetched)

    def drain_until(self, job: int | None) -> None:
        """Run queued collectives in readiness order until ``job`` has run (``None``: all)."""
        while self.queue and (job is None or job not in self.end):
            ready, _, popped = heapq.heappop(self.queue)
            t = self.transfers[popped]
            stream = self.stream(popped)
            start = max(self.comm_clocks.get(stream, 0.0), ready)
            end = max(start + self.shared_time(t, stream, start), self.floor.get(popped, 0.0))
            self.start[popped] = start
            self.comm_clocks[stream] = self.end[popped] = end
            if self.concurrent:
                self.flight.setdefault(t.link, []).append((end, stream))
            if self.transfers[popped].pin:
                self.release(self.transfers[popped].value, end)
        if job is not None and job not in self.end:
            raise RuntimeError(f"collective {job} can never run: its producer never finished")

    def operand_ready(self, index: int, value: Value, duration: float) -> tuple[float, float]:
        """(when op ``index`` may start on ``value``, the earliest it may end).

        A consumer-pipelined all-gather lets its GEMM start once the first chunk has arrived;
        the GEMM's last chunk then runs after the last comm chunk."""
        jobs = self.needs.get(index, {}).get(value)
        if jobs:
            ready, floor = 0.0, 0.0
            for job in jobs:
                self.drain_until(job)
                t = self.transfers[job]
                if t.pipelined == "consumer" and t.chunks > 1 and t.consumer == index:
                    ready = max(ready, self.start[job] + t.time / t.chunks)
                    floor = max(floor, self.end[job] + duration / t.chunks)
                else:
                    ready = max(ready, self.end[job])
            return ready, floor
        if value not in self.ready and value in self.pin_job:
            self.drain_until(self.pin_job[value])
        return self.ready[value], 0.0


def stored_view(value: Value) -> bool:
    """``value`` is a graph input, or a view of one (``transpose`` of a weight, a ``reshape``):
    its bytes exist from the step's start, so a collective on it may be prefetched (FSDP
    gathers the stored parameter; the view is taken of the gathered buffer)."""
    op = value.producer
    while op is not None:
        if op.kind not in VIEW_KINDS or len(op.operands) != 1:
            return False
        op = op.operands[0].producer
    return True


def _gates(graph: Graph, window: int | None) -> list[int]:
    """Per op, the op whose turn releases collectives on graph inputs it consumes."""
    if window is None:
        return [0] * len(graph.ops)
    blocks = layer_blocks(graph)
    first: dict[int, int] = {}
    for i, b in enumerate(blocks):
        first.setdefault(b, i)
    return [first.get(b - window, 0) if b - window >= 0 else 0 for b in blocks]


def simulate_graph(
    graph: Graph,
    op_times: Sequence[float],
    transfers: Sequence[Transfer],
    options: SimulationOptions | None = None,
    timeline: list[tuple[str, int, float, float]] | None = None,
) -> SimulationResult:
    """Schedule ``graph``'s ops (``op_times[i]`` seconds each) and ``transfers`` on two streams.

    Args:
      graph: the step; ops run on the compute stream in graph order.
      op_times: seconds of each op on one device.
      transfers: collectives per edge (see ``Transfer``).
      options: prefetch window for collectives on graph inputs.
      timeline: if given, receives ``("compute", op index, start, end)`` per op and
        ``("comm", transfer index, start, end)`` per transfer (the HTML report draws them).
    Returns:
      compute, exposed and overlapped communication (``SimulationResult``).
    """
    if len(op_times) != len(graph.ops):
        raise ArgumentError(f"{len(op_times)} op times for {len(graph.ops)} ops")
    streams = _Streams(graph, transfers, options or SimulationOptions())
    phases = op_phases(graph)
    exposed: dict[str, float] = {}
    for i, op in enumerate(graph.ops):
        for job in streams.gated.pop(i, []):
            streams.push(streams.compute_clock, job)
        waits = [streams.operand_ready(i, v, op_times[i]) for v in op.operands]
        start = max([streams.compute_clock] + [w[0] for w in waits])
        end = max([start + op_times[i]] + [w[1] for w in waits])
        idle = end - op_times[i] - streams.compute_clock  # before the op, or stalled inside it
        if idle > 0:
            key = phases[op].value
            exposed[key] = exposed.get(key, 0.0) + idle
        streams.compute_clock = end
        if timeline is not None:
            timeline.append(("compute", i, end - op_times[i], end))
        for r in op.results:
            streams.produced(r, end, began=end - op_times[i])
    streams.drain_until(None)
    if timeline is not None:
        timeline += [("comm", j, streams.start[j], streams.end[j]) for j in sorted(streams.end)]
    step = max([streams.compute_clock, *streams.comm_clocks.values()])
    if step > streams.compute_clock:
        exposed["tail"] = step - streams.compute_clock
    compute = float(sum(op_times))
    comm = float(sum(t.time for t in transfers))
    exposed_total = step - compute
    return SimulationResult(
        step, compute, comm, exposed_total, max(comm - exposed_total, 0.0), exposed
    )


def serial_result(op_times: Sequence[float], transfers: Sequence[Transfer]) -> SimulationResult:
    """No overlap at all (the planner's v1 objective): every collective is exposed."""
    compute, comm = float(sum(op_times)), float(sum(t.time for t in transfers))
    return SimulationResult(compute + comm, compute, comm, comm, 0.0)


# -- plans --------------------------------------------------------------------------------------


def simulate(
    plan: Plan,
    options: SimulationOptions | None = None,
    timeline: list[tuple[str, int, float, float]] | None = None,
) -> SimulationResult:
    """Simulate one step of a ``Plan`` on its mesh's cluster (op roofline + planned reshards).

    Reshards of one value to one layout for several readers run once (``shared_reshards``):
    the first reader's transfer carries the later readers in ``Transfer.also``. ``timeline``:
    as for ``simulate_graph``, with a ``"comm"`` entry's index that of ``plan.reshards``."""
    graph = plan.graph
    times = plan_op_times(plan)
    cluster = cluster_of(plan.mesh)
    by_name = {v.name: v for v in graph.values()}
    position = {op: i for i, op in enumerate(graph.ops)}
    axes = options.tp_overlap_axes if options is not None else ()
    shared = shared_reshards(plan.reshards)
    transfers: dict[int, Transfer] = {}
    for n, r in enumerate(plan.reshards):
        leader = shared[n]
        if leader is not None:  # reuses an earlier reader's buffer: that transfer waits for it
            earlier = transfers[leader]
            if r.consumer.startswith("op:"):
                transfers[leader] = replace(
                    earlier, also=(*earlier.also, int(r.consumer[3:].split(":")[0]))
                )
            continue
        t = _transfer(r.consumer, by_name[r.value], r.time, graph, position)
        group = tuple(sorted({a for c in r.collectives for a in c.axes}))
        t = replace(t, link=reshard_link(r.collectives, plan.mesh, cluster), group=group)
        transfers[n] = _pipelined(t, r, graph, plan.mesh, axes) if axes else t
    if timeline is None:
        return simulate_graph(graph, times, list(transfers.values()), options)
    jobs: list[tuple[str, int, float, float]] = []
    result = simulate_graph(graph, times, list(transfers.values()), options, jobs)
    index = list(transfers)  # transfer j runs reshard index[j]
    timeline += [(k, i if k == "compute" else index[i], a, b) for k, i, a, b in jobs]
    return result


def shared_reshards(reshards: Sequence) -> list[int | None]:  # type: ignore[type-arg]
    """Per reshard, the index of an earlier one whose result it reuses, or None.

    Two reshards share when they move the same value from the same layout to the same layout
    into an op or a graph output: the gathered (or reduced) buffer is made once and every reader
    reads it, as XLA's CSE merges identical resharding chains and Megatron all-gathers the norm
    output once for its q, k and v (fused QKV) GEMM. Producer-side reshards (``pin:``,
    ``reduce:``) are already once per value; ``alias:`` round trips are carried into the next
    step and stay apart. The plan keeps one ``Reshard`` per edge (emitters place each at its
    reader); the cost is counted once."""
    first: dict[tuple, int] = {}
    out: list[int | None] = []
    for n, r in enumerate(reshards):
        if not r.consumer.startswith(("op:", "output:")):
            out.append(None)
            continue
        key = (r.value, r.src, r.dst)
        out.append(first.get(key))
        first.setdefault(key, n)
    return out


def _is_gemm(op: Op | None) -> bool:
    info = op_info(op.kind) if op is not None else None
    return info is not None and info.flops == "dot"


def _pipelined(t: Transfer, reshard, graph: Graph, mesh, axes: tuple[str, ...]) -> Transfer:  # type: ignore[no-untyped-def]
    """``t`` marked as pipelined with its GEMM when tensor-parallel overlap covers it: one
    all-gather into a GEMM operand, or one reduce-scatter of a GEMM result, on ``axes``."""
    if len(reshard.collectives) != 1 or t.carried is not None or t.pin:
        return t
    (c,) = reshard.collectives
    if not c.axes or not set(c.axes) <= set(axes):
        return t
    chunks = mesh.group_size(c.axes)
    if c.kind == "all-gather" and t.consumer is not None and _is_gemm(graph.ops[t.consumer]):
        return replace(t, pipelined="consumer", chunks=chunks)
    if c.kind == "reduce-scatter" and _is_gemm(t.value.producer):
        return replace(t, pipelined="producer", chunks=chunks)
    return t


def _transfer(
    consumer: str, value: Value, time: float, graph: Graph, position: dict[Op, int]
) -> Transfer:
    kind, _, rest = consumer.partition(":")
    match kind:
        case "op":
            return Transfer(value, int(rest.split(":")[0]), time)
        case "pin":
            return Transfer(value, None, time, pin=True)
        case "alias":  # carried into the next step, needed by the stored input's first use
            carried = graph.inputs[graph.output_aliases[int(rest)]]
            first = min((position[u.op] for u in carried.uses), default=None)
            if first is not None:
                return Transfer(value, first, time, carried=carried)
            return Transfer(value, None, time)
        case _:  # output:<j>: must finish before the step ends
            return Transfer(value, None, time)


__all__ = [
    "SimulationOptions",
    "SimulationResult",
    "Transfer",
    "serial_result",
    "shared_reshards",
    "simulate",
    "simulate_graph",
]
