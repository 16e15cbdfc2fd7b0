"""Devices a plan leaves repeating the same work, and the data-parallel plan beside it.

On a tiny model the free plan often splits nothing: every op is at the kernel floor (a split
kernel is no faster) or the gradient reduction costs more than the compute a split saves, so
the modelled step is fastest with every device doing the whole step. That is the right answer
for step time and the wrong one for throughput; ``IdleDevices`` says so with the numbers
(``print(plan)``, ``IdleDevicesWarning``), and ``sp.plan(..., prefer="throughput")`` returns
the data-parallel plan (``idle_devices.py`` at the top level plans it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

REPEAT_THRESHOLD = 2.0
"""A plan whose mesh does at least this many times the step's work (``work_repeats``) leaves
devices repeating the same work, even where every axis splits something."""

FLOOR_SHARE = 0.1
"""A batch split that saves less than this share of the free plan's compute is "at the kernel
floor": the ops are too small for a split kernel to be faster."""


def work_repeats(plan) -> float:  # type: ignore[no-untyped-def]
    """How many times over the mesh computes the step: ``N * sum(f / d) / sum(f)`` over the
    ops (``f`` an op's global FLOPs, ``d`` the devices its chosen strategy splits it over,
    ``N`` the mesh size). 1 when every op is split over every device, ``N`` when every device
    computes the whole step; 0 for a graph without FLOPs."""
    from shardplan.ir import op_flops

    mesh = plan.stage_mesh
    total = per_device = 0.0
    for i, op in enumerate(plan.graph.ops):
        flops = op_flops(
            op.kind, op.rule, [v.type for v in op.operands], [v.type for v in op.results],
            op.attrs,
        )  # fmt: skip
        axes = {a for _, group in plan.assignments.get(i, ()) for a in group}
        split = math.prod(mesh.axis_size(a) for a in axes if a in mesh.axis_names)
        total += flops
        per_device += flops / split
    return mesh.size * per_device / total if total > 0 else 0.0


@dataclass(frozen=True, slots=True)
class StepTimes:
    """Modelled seconds of one step: total, compute, exposed communication."""

    step: float
    compute: float
    exposed: float


@dataclass(frozen=True, slots=True)
class IdleDevices:
    """What the free plan leaves idle and what splitting the batch would model.

    Invariants: ``repeats >= 2`` (the devices doing one share of the work); ``split_axes`` is
    every mesh axis the batch divides over (mesh order); ``chosen`` is ``"step"`` (the free
    plan was returned) or ``"throughput"`` (the data-parallel plan was)."""

    axes: tuple[str, ...]
    """Mesh axes of size > 1 that split nothing in the free plan (``whole``), or else the axes
    the free plan's batch is not split over."""
    repeats: int
    """How many devices compute the same thing: the idle axes' sizes multiplied (``whole``),
    else ``work`` rounded down."""
    work: float
    """``work_repeats`` of the free plan: the mesh computes the step this many times over."""
    whole: bool
    """Whether the ``axes`` split nothing at all (else they split some parameters only)."""
    split_axes: tuple[str, ...]
    """Axes the data-parallel plan splits the batch over."""
    strategy: str
    """The data-parallel plan's strategy: ``dp`` (parameters replicated) or ``fsdp`` (sharded,
    when replicated parameters do not fit)."""
    free: StepTimes
    split: StepTimes
    kernel_floor: float
    """The cluster's smallest kernel time (seconds)."""
    chosen: str = "step"

    def reason(self) -> str:
        """The modelled reason the free plan does not split the batch, with its numbers."""
        from .report import format_seconds as fmt

        ways = f"over {'×'.join(self.split_axes)}"
        saved = self.free.compute - self.split.compute
        added = self.split.exposed - self.free.exposed
        if self.split.step <= self.free.step:
            return (
                f"the solver found no faster step than splitting the batch {ways} "
                f"(compute {fmt(self.free.compute)} -> {fmt(self.split.compute)})"
            )
        if saved < FLOOR_SHARE * self.free.compute:
            why = (
                f"every op is at the kernel floor ({fmt(self.kernel_floor)} per kernel): "
                f"splitting the batch {ways} cuts compute only from {fmt(self.free.compute)} "
                f"to {fmt(self.split.compute)}"
            )
            if added > 0:
                why += f", while its gradient reduction adds {fmt(added)} of communication"
        else:
            why = (
                f"communication is dearer than compute: splitting the batch {ways} saves "
                f"{fmt(saved)} of compute but adds {fmt(added)} of exposed communication"
            )
        return why

    def steps(self) -> str:
        from .report import format_seconds as fmt

        return (
            f"modelled step {fmt(self.free.step)} as planned vs {fmt(self.split.step)} "
            f"data-parallel ({self.strategy}, batch over {'×'.join(self.split_axes)})"
        )

    def summary(self) -> str:
        """The ``idle devices`` line of ``print(plan)``."""
        if self.chosen == "throughput":
            return (
                f"prefer='throughput': the batch is split over {'×'.join(self.split_axes)}; "
                f"the free plan: {self.what()} ({self.reason()}); {self.steps()}"
            )
        return (
            f"{self.what()}: {self.reason()}; {self.steps()}; "
            "sp.plan(..., prefer='throughput') returns the data-parallel plan"
        )

    def what(self) -> str:
        axes = "×".join(self.axes)
        if self.whole:
            return f"{self.repeats} devices repeat the same work ({axes} split nothing)"
        return (
            f"devices repeat the same work: the mesh computes the step {self.work:.1f} times "
            f"over (1 when split evenly; the batch is not split over {axes})"
        )
