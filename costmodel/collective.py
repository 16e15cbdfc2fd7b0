"""A priced collective: the unit the cost model, the plan and the checkers all speak."""

from __future__ import annotations

from dataclasses import dataclass

from ..ir.errors import ArgumentError

COLLECTIVE_KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective over a group of mesh axes.

    ``bytes`` is per device and is the size of the collective's *result* on one device, the
    way compiled HLO shows it: all-gather -> the gathered tensor, reduce-scatter -> the
    scattered shard, all-reduce / all-to-all / collective-permute -> the local tensor.
    """

    kind: str
    axes: tuple[str, ...]
    bytes: int
    time: float = 0.0
    """Modelled seconds on the plan's cluster."""

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVE_KINDS:
            raise ArgumentError(f"unknown collective kind {self.kind!r}; one of {COLLECTIVE_KINDS}")

    def __str__(self) -> str:
        axes = ",".join(self.axes)
        return f"{self.kind}[{axes}] {self.bytes} B ({self.time * 1e6:.1f} us)"
