"""What a layout solve returns (``Solution``: the choice, its objective, a bound and the CP-SAT
work used) and the unit that work is budgeted in."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Solution:
    choice: list[int]
    """Strategy per node, followers expanded."""
    objective: float
    bound: float
    status: str
    wall_time: float
    num_variables: int
    work: float = 0.0
    """CP-SAT deterministic seconds the search used (0 when the LP or elimination solved it)."""

    @property
    def seconds_of_budget(self) -> float:
        """The ``time_limit`` seconds the search used up (``DETERMINISTIC_PER_SECOND``)."""
        return self.work / DETERMINISTIC_PER_SECOND


DETERMINISTIC_PER_SECOND = 0.25
"""CP-SAT deterministic seconds (``max_deterministic_time``, its own count of work) per second of
the user's ``time_limit``. CP-SAT stops at that budget, so a search cut short returns the same
solution however busy or slow the machine is. Measured on a 2-core box: one deterministic
second of this formulation's search took 15-19 wall seconds with the box loaded about 4.5x
(load 9), i.e. about 4 s of an idle core; so ``time_limit=T`` stops after about ``T`` seconds
of search on an idle core of such a box (longer on a busy one, shorter on a fast one)."""
