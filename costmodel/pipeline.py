"""Pipeline schedules (GPipe, 1F1B, interleaved 1F1B): step time, bubble and in-flight memory.

Pure functions on numbers. Two levels:

- closed forms for uniform stages (``bubble_fraction``; Narayanan et al., SC'21 §2.2): with ``p``
  stages, ``m`` micro-batches and ``v`` model chunks per device, the idle fraction of the step is
  ``(p-1)/(m+p-1)`` for GPipe and 1F1B and ``(p-1)/(v*m+p-1)`` for interleaved 1F1B;
- ``schedule_pipeline``: an event simulation of each device's ordered task list (forward /
  backward of one micro-batch of one chunk), exact for non-uniform stages and point-to-point
  transfers, which also counts the activations each device holds (1F1B keeps up to ``p - s``
  micro-batches on stage ``s``; GPipe keeps all ``m``).

Stage-to-stage transfers: every hand-off of a micro-batch between devices costs
``p2p_time`` (``activation_bytes / link bandwidth + latency``, see ``p2p_time``) and delays the
dependent task; by default the sending device is not blocked (sends are asynchronous, as
Megatron-Core's ``--overlap-p2p-communication``). ``blocking_p2p=True`` models the 2022
Megatron-LM schedules instead: each hand-off is a batched send/receive that the device waits
for (``req.wait()`` and a ``torch.cuda.synchronize()`` after ``batch_isend_irecv``), so the
transfer also holds the sender for ``p2p`` after every task whose output crosses to another
device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..ir.errors import PipelineError

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True, slots=True)
class PipelineResult:
    """What a schedule costs on one pipeline (all stages run in parallel on their devices).

    Invariants: ``step_time >= max(busy)``; ``bubble_time = step_time - max(busy)`` is the
    bottleneck device's idle time; ``in_flight[s]`` counts micro-batches of stage ``s``'s
    activations alive at its peak, in units of one full stage (a chunk counts ``1/v``).
    """

    schedule: str
    stages: int
    microbatches: int
    chunks: int
    step_time: float
    busy: tuple[float, ...]
    """Per device, seconds of forward + backward work."""
    bubble_time: float
    in_flight: tuple[float, ...]

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_time / self.step_time if self.step_time > 0 else 0.0


@dataclass(frozen=True, slots=True)
class _Task:
    forward: bool
    microbatch: int
    chunk: int


def bubble_fraction(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """Idle fraction of a uniform pipeline step (SC'21 Megatron §2.2 closed forms)."""
    _check(schedule, stages, microbatches, chunks)
    p, m = stages, microbatches
    v = chunks if schedule == "interleaved" else 1
    return (p - 1) / (v * m + p - 1)


def uniform_step_time(
    schedule: str,
    stages: int,
    microbatches: int,
    forward: float,
    backward: float,
    chunks: int = 1,
) -> float:
    """Closed-form step of ``stages`` equal stages (``forward``/``backward`` per micro-batch).

    ``(m + (p-1)/v) * (f + b)``: m micro-batches of work plus the fill-and-drain bubble, which
    interleaving shrinks ``v``-fold (SC'21 §2.2.2). ``v = 1`` except for ``"interleaved"``.
    """
    _check(schedule, stages, microbatches, chunks)
    v = chunks if schedule == "interleaved" else 1
    return (microbatches + (stages - 1) / v) * (forward + backward)


def p2p_time(activation_bytes: float, bandwidth: float, latency: float = 0.0) -> float:
    """Seconds to hand one micro-batch's boundary activation to the next stage."""
    if activation_bytes <= 0:
        return 0.0
    return latency + activation_bytes / bandwidth


def schedule_pipeline(
    forward: Sequence[float],
    backward: Sequence[float],
    microbatches: int,
    schedule: str = "1f1b",
    chunks: int = 1,
    p2p: float = 0.0,
    blocking_p2p: bool = False,
) -> PipelineResult:
    """Simulate one step of a pipeline schedule.

    Args:
      forward: per device, forward seconds of one micro-batch through that device's whole
        share of layers (all its chunks together).
      backward: the same for backward (include recomputation here).
      microbatches: ``m``; interleaved needs ``m`` divisible by the stage count (Megatron).
      schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"``.
      chunks: model chunks per device (``v``), used by ``"interleaved"`` only.
      p2p: seconds per stage-to-stage hand-off (``p2p_time``).
      blocking_p2p: the sender waits for each of its hand-offs (module docstring).
    Returns:
      the step time, per-device busy time, bubble and in-flight micro-batches per stage.
    """
    p = len(forward)
    if len(backward) != p:
        raise PipelineError(f"forward has {p} stages but backward has {len(backward)}")
    _check(schedule, p, microbatches, chunks)
    v = chunks if schedule == "interleaved" else 1
    orders = [_order(schedule, s, p, microbatches, v) for s in range(p)]
    fwd = [f / v for f in forward]
    bwd = [b / v for b in backward]
    done, peaks = _run(orders, fwd, bwd, p, v, p2p, blocking_p2p)
    step = max(done.values()) if done else 0.0
    busy = tuple(microbatches * (f + b) for f, b in zip(forward, backward, strict=True))
    return PipelineResult(
        schedule, p, microbatches, v, step, busy, step - max(busy, default=0.0), tuple(peaks)
    )


def in_flight_closed_form(schedule: str, stages: int, microbatches: int, chunks: int = 1):
    """Micro-batches of activations stage 0 holds at its peak (units of one full stage).

    GPipe: all ``m``. 1F1B: ``min(p, m)`` (PipeDream-Flush). Interleaved: ``p + (p-1)/v``
    chunks-worth as counted by Korthikanti'22 §4.2.3 (the ``1 + (p-1)/(p v)`` factor on ``p``).
    """
    _check(schedule, stages, microbatches, chunks)
    p, m, v = stages, microbatches, chunks
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(p, m))
    return min(float(m), p * (1 + (p - 1) / (p * v)))


def _check(schedule: str, stages: int, microbatches: int, chunks: int) -> None:
    if schedule not in SCHEDULES:
        raise PipelineError(f"unknown pipeline schedule {schedule!r}; one of {SCHEDULES}")
    if stages < 1 or microbatches < 1 or chunks < 1:
        raise PipelineError(
            f"stages, microbatches and chunks must be >= 1, got {stages}, {microbatches}, {chunks}"
        )
    if schedule == "interleaved" and stages > 1 and microbatches % stages:
        raise PipelineError(
            f"interleaved 1F1B needs microbatches ({microbatches}) divisible by the stage "
            f"count ({stages}) (Megatron's constraint); pick m = k * {stages}"
        )


def _order(schedule: str, stage: int, p: int, m: int, v: int) -> list[_Task]:
    """The task order one device executes (GPipe, PipeDream-Flush 1F1B, Megatron interleaved)."""
    if schedule == "gpipe":
        return [_Task(True, j, 0) for j in range(m)] + [_Task(False, j, 0) for j in range(m)]
    forwards = [_Task(True, *_virtual(k, p, v, m, True)) for k in range(m * v)]
    backwards = [_Task(False, *_virtual(k, p, v, m, False)) for k in range(m * v)]
    if schedule == "1f1b":
        warmup = min(p - stage - 1, m)
    else:  # Megatron interleaved warm-up: 2(p - s - 1) + (v - 1) p forwards
        warmup = min((p - stage - 1) * 2 + (v - 1) * p, m * v)
    order = forwards[:warmup]
    for k in range(m * v - warmup):
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[m * v - warmup :]


def _virtual(k: int, p: int, v: int, m: int, forward: bool) -> tuple[int, int]:
    """The (micro-batch, chunk) of a device's k-th forward or backward (groups of p per chunk)."""
    if v == 1:
        return k, 0
    group, within = divmod(k, p * v)
    chunk = (k // p) % v
    if not forward:
        chunk = v - 1 - chunk
    return group * p + within % p, chunk


def _deps(task: _Task, stage: int, p: int, v: int) -> list[tuple[int, _Task]]:
    """(device, task) pairs that must finish first; virtual stage = chunk * p + stage."""
    j, c = task.microbatch, task.chunk
    if task.forward:
        if stage > 0:
            return [(stage - 1, _Task(True, j, c))]
        return [(p - 1, _Task(True, j, c - 1))] if c > 0 else []
    deps = [(stage, _Task(True, j, c))]
    if stage < p - 1:
        deps.append((stage + 1, _Task(False, j, c)))
    elif c < v - 1:
        deps.append((0, _Task(False, j, c + 1)))
    return deps


def _sends(task: _Task, s: int, p: int, v: int) -> bool:
    """Whether ``task`` on device ``s`` hands its output to another device (the last chunk's
    forward on the last device feeds its own backward; the first chunk's backward on device 0
    ends the micro-batch)."""
    if p == 1:
        return False
    if task.forward:
        return not (s == p - 1 and task.chunk == v - 1)
    return not (s == 0 and task.chunk == 0)


def _run(
    orders, fwd, bwd, p: int, v: int, p2p: float, blocking: bool = False
) -> tuple[dict, list[float]]:
    """Execute each device's order as soon as dependencies allow; return end times and peaks."""
    done: dict[tuple[int, _Task], float] = {}
    clock = [0.0] * p
    nxt = [0] * p
    live = [0.0] * p
    peaks = [0.0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            while nxt[s] < len(orders[s]):
                task = orders[s][nxt[s]]
                deps = _deps(task, s, p, v)
                if any(d not in done for d in deps):
                    break
                ready = max([done[d] + (p2p if d[0] != s else 0.0) for d in deps], default=0.0)
                start = max(clock[s], ready)
                clock[s] = start + (fwd[s] if task.forward else bwd[s])
                done[(s, task)] = clock[s]
                if blocking and _sends(task, s, p, v):
                    clock[s] += p2p  # the device waits for its own send (2022 Megatron-LM)
                live[s] += (1.0 if task.forward else -1.0) / v
                peaks[s] = max(peaks[s], live[s])
                nxt[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # an order that waits on itself: a bug in _order, never user input
            raise RuntimeError("pipeline schedule deadlocked")
    return done, peaks


__all__ = [
    "SCHEDULES",
    "PipelineResult",
    "bubble_fraction",
    "in_flight_closed_form",
    "p2p_time",
    "schedule_pipeline",
    "uniform_step_time",
]
