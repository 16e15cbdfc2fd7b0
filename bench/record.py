"""``--record out.json`` for the bench scripts: one call to add the option, one to write.

    parser = argparse.ArgumentParser(...)
    add_record_argument(parser)
    args = parser.parse_args()
    clock = WallClock()
    with clock("plan"):
        ...
    save_record(args, "scale", results=rows, wall_times=clock.total(), inputs={"seed": 0})

The record's format, validation and comparison live in ``shardplan.records`` (schema in
``record.schema.json``; ``shardplan bench compare a.json b.json``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shardplan.records import make_record, write_record


def add_record_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--record", type=Path, metavar="OUT.json",
        help="also write a reproducible benchmark record (env, inputs, results, wall times)",
    )  # fmt: skip


class WallClock:
    """Named wall-clock phases: ``with clock("solve"): ...``; ``clock.times`` in seconds."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - began

    def total(self) -> dict[str, float]:
        """The phases plus ``total``: seconds since the clock was made."""
        return {**self.times, "total": time.perf_counter() - self.start}


def save_record(
    args: argparse.Namespace,
    benchmark: str,
    *,
    results: Any,
    wall_times: Mapping[str, float],
    inputs: Mapping[str, Any] | None = None,
) -> Path | None:
    """Write the record to ``args.record`` when it was given; print where it went.

    The record's inputs are the script's arguments (all but ``--record``) plus ``inputs``
    (model shapes, meshes, clusters, seeds the script fixes itself).
    """
    path = getattr(args, "record", None)
    if path is None:
        return None
    inputs = {**{k: v for k, v in vars(args).items() if k != "record"}, **(inputs or {})}
    record = make_record(
        benchmark, inputs, results, wall_times, command=[Path(sys.executable).name, *sys.argv]
    )
    out = write_record(path, record)
    print(f"record: {out}", file=sys.stderr)
    return out
