"""The error hierarchy: every failure a user can see is a ShardplanError with a hint."""

from __future__ import annotations


class ShardplanError(Exception):
    """Base of every error shardplan raises on purpose (never a stack trace from deep inside)."""


class IRVerifyError(ShardplanError):
    """The graph breaks an IR invariant (types, shardings, use lists, rule arity)."""


class IRParseError(ShardplanError):
    """The text form could not be parsed; the message shows line:column and a caret."""


class ShardingError(ShardplanError):
    """A sharding is malformed or does not fit a shape (indivisible, axis twice, unknown axis)."""


class InfeasiblePlanError(ShardplanError):
    """No plan satisfies the constraints (memory budget, pins); says the minimum needed."""


class FrontendError(ShardplanError):
    """The model or function could not be captured or emitted by a framework binding."""


class ArgumentError(ShardplanError, ValueError):
    """A public function got a bad argument: wrong type, out of range, an unknown name or
    keyword; the one-line message names the argument, the value and the fix."""


class UnsupportedOpWarning(UserWarning):
    """An op has no sharding rule; it was given the safe all-need-replication rule."""


class IdleAxisWarning(UserWarning):
    """A mesh axis splits nothing in the plan (e.g. ``dp=3`` with a batch of 8): its devices
    repeat the others' work. The message names the axis and a batch size that would use it."""


class IdleDevicesWarning(IdleAxisWarning):
    """The plan leaves devices repeating the same work although the batch could be split
    (a tiny model: every op at the kernel floor, or communication dearer than the compute a
    split saves). The message gives the modelled reason with its numbers and both step times;
    ``sp.plan(..., prefer="throughput")`` returns the data-parallel plan instead."""
