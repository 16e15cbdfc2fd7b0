"""Progress of a planning call: one log record per phase, with the seconds since the call began.

Planning a large model takes seconds to minutes (capture, enumerate, price, solve, simulate); a
user watching a silent terminal cannot tell a slow solve from a hang. Every phase logs through
the standard ``logging`` module on the ``shardplan`` logger, so an application routes it like
any other log. ``sp.plan(..., verbose=True)`` and the CLI (on by default, ``--quiet`` to stop it)
attach a stderr handler for the duration of the call: plain lines such as

    [   3.1 s] capture: LlamaForCausalLM -> 5614 ops, 474 inputs
    [   4.0 s] solve: FEASIBLE, objective 377.2 ms, bound 371.0 ms, gap 1.64%

Each record carries ``phase`` and ``elapsed`` attributes for handlers that want structure.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

logger = logging.getLogger("shardplan")
"""The planner's logger; ``logging.getLogger("shardplan").setLevel(logging.INFO)`` plus a
handler shows progress without ``verbose=``."""

_started: list[float] = []
"""Start times of the planning calls in progress (nested calls report from the outermost)."""


_muted: list[bool] = []
"""Non-empty inside ``muted()``: the phases of a sub-computation that reports as one line."""


def enabled() -> bool:
    """Whether progress records would be shown (callers skip costly detail otherwise)."""
    return not _muted and logger.isEnabledFor(logging.INFO)


@contextmanager
def muted() -> Iterator[None]:
    """No phase lines inside (pricing a dozen hand-written strategies reports one line each)."""
    _muted.append(True)
    try:
        yield
    finally:
        _muted.pop()


def elapsed() -> float:
    """Seconds since the outermost planning call in progress began (0 outside one)."""
    return time.perf_counter() - _started[0] if _started else 0.0


def report(phase: str, message: str, *args: object) -> None:
    """Log one progress line: ``phase: message`` (``%``-style ``args``, formatted lazily)."""
    if enabled():
        logger.info("%s: " + message, phase, *args, extra={"phase": phase, "elapsed": elapsed()})


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        seconds = getattr(record, "elapsed", None)
        seconds = elapsed() if seconds is None else seconds
        return f"[{seconds:7.1f} s] {record.getMessage()}"


@contextmanager
def planning(verbose: bool = False, stream: TextIO | None = None) -> Iterator[None]:
    """Time one planning call; with ``verbose`` print its progress on ``stream`` (stderr).

    Nested calls (``sp.plan`` inside ``sp.whatif``, the CLI around ``sp.plan``) keep the
    outermost clock and add no second handler."""
    outermost = not _started
    if outermost:
        _started.append(time.perf_counter())
    handler: logging.Handler | None = None
    level, propagate = logger.level, logger.propagate
    if verbose and not any(getattr(h, "_shardplan_progress", False) for h in logger.handlers):
        handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
        handler.setFormatter(_Formatter())
        handler._shardplan_progress = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False  # printed once, not again by a root handler the app set up
        if not logger.isEnabledFor(logging.INFO):
            logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        if handler is not None:
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate
        if outermost:
            _started.clear()


def seconds_text(seconds: float) -> str:
    """``377.2 ms`` / ``12.26 s``: a modelled time as progress lines print it."""
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


__all__ = ["elapsed", "enabled", "logger", "muted", "planning", "report", "seconds_text"]
