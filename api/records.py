"""Reproducible benchmark records (Collective Mind): what ran, where, on what, and what came out.

Every ``bench/*.py`` takes ``--record out.json`` (``add_record_argument``, ``WallClock``,
``save_record`` below) and writes one record: the schema version, the
command, the git commit, the machine (CPU, cores, memory), Python and package versions, the
inputs (model shapes, mesh, cluster, seeds), the results and the wall times. A record validates
against ``record.schema.json`` (``validate_record``: a small validator for the JSON-schema
subset that file uses, so no dependency is added), and ``compare_records`` (``shardplan bench
compare a.json b.json``) prints what changed between two records side by side, environment and
results. Nothing here imports torch or jax: package versions come from installed metadata.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

from ..ir.errors import RecordError

SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).resolve().parent.parent / "record.schema.json"
PACKAGES = (
    "shardplan", "numpy", "scipy", "networkx", "ortools", "torch", "jax", "jaxlib",
    "transformers",
)  # fmt: skip
"""Packages whose versions a record lists (``None`` when not installed)."""
ENV_SECTIONS = ("command", "git", "machine", "python", "packages")
RESULT_SECTIONS = ("inputs", "results", "wall_times")


# -- capture --------------------------------------------------------------------------------
def environment(root: Path | None = None) -> dict[str, Any]:
    """The record's environment sections: git, machine, Python and package versions."""
    return {
        "git": git_state(root or Path(__file__).resolve().parent.parent),
        "machine": machine(),
        "python": {"version": platform.python_version(), "implementation": sys.implementation.name},
        "packages": {name: _version(name) for name in PACKAGES},
    }


def machine() -> dict[str, Any]:
    """CPU model, logical cores, physical memory in bytes and the OS (``platform.platform``)."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count() or 1,
        "memory_bytes": _memory_bytes(),
        "platform": platform.platform(),
    }


def git_state(root: Path) -> dict[str, Any]:
    """``{"commit": sha, "dirty": bool}``; both ``None`` outside a git checkout."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=30
        )
        if commit.returncode:
            return {"commit": None, "dirty": None}
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


def make_record(
    benchmark: str,
    inputs: Mapping[str, Any],
    results: Any,
    wall_times: Mapping[str, float],
    command: Sequence[str] | None = None,
) -> dict[str, Any]:
    """A record (a plain dict, ready for ``json.dump``) of one benchmark run."""
    return {
        "schema_version": SCHEMA_VERSION,
        "benchmark": benchmark,
        "command": list(sys.argv if command is None else command),
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        **environment(),
        "inputs": _plain(dict(inputs)),
        "results": _plain(results),
        "wall_times": {str(k): float(v) for k, v in wall_times.items()},
    }


def write_record(path: str | Path, record: Mapping[str, Any]) -> Path:
    """Validate ``record`` and write it as JSON (raises ``RecordError`` if it is malformed)."""
    errors = validate_record(record)
    if errors:
        raise RecordError(f"benchmark record does not match the schema: {errors[0]}")
    path = Path(path)
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return path


def load_record(path: str | Path) -> dict[str, Any]:
    """Read and validate one record file."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise RecordError(f"cannot read benchmark record {path}: {exc}") from None
    errors = validate_record(record)
    if errors:
        raise RecordError(
            f"{path} is not a benchmark record (schema v{SCHEMA_VERSION}): {errors[0]}; "
            "hint: write one with a bench script's --record option"
        )
    return record


# -- for the bench scripts: --record, phase clocks, writing ----------------------------------
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


# -- validation -----------------------------------------------------------------------------
def load_schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text())


def validate_record(record: Any, schema: Mapping[str, Any] | None = None) -> list[str]:
    """Schema violations of ``record`` as ``"path: problem"`` lines (empty: valid)."""
    errors: list[str] = []
    _check(record, schema or load_schema(), "$", errors)
    return errors


_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,), "array": (list,), "string": (str,), "integer": (int,),
    "number": (int, float), "boolean": (bool,), "null": (type(None),),
}  # fmt: skip


def _check(value: Any, schema: Mapping[str, Any], path: str, errors: list[str]) -> None:
    """The JSON-schema keywords ``record.schema.json`` uses: type, required, properties,
    additionalProperties, items, const, minimum, pattern."""
    kinds = schema.get("type")
    if kinds is not None and not _has_type(value, [kinds] if isinstance(kinds, str) else kinds):
        errors.append(f"{path}: expected {kinds}, got {type(value).__name__}")
        return
    if "const" in schema and value != schema["const"]:
        errors.append(f"{path}: must be {schema['const']!r}, got {value!r}")
    if "minimum" in schema and isinstance(value, int | float) and value < schema["minimum"]:
        errors.append(f"{path}: {value} is below the minimum {schema['minimum']}")
    if "pattern" in schema and isinstance(value, str) and not re.search(schema["pattern"], value):
        errors.append(f"{path}: {value!r} does not match {schema['pattern']!r}")
    if isinstance(value, dict):
        _check_object(value, schema, path, errors)
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(value):
            _check(item, schema["items"], f"{path}[{i}]", errors)


def _has_type(value: Any, kinds: Sequence[str]) -> bool:
    """JSON types: a bool is no integer or number, as in JSON schema."""
    is_bool = isinstance(value, bool)
    return any(isinstance(value, _TYPES[k]) and (k == "boolean" or not is_bool) for k in kinds)


def _check_object(value: dict, schema: Mapping[str, Any], path: str, errors: list[str]) -> None:
    for key in schema.get("required", ()):
        if key not in value:
            errors.append(f"{path}: missing required field {key!r}")
    props = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        if key in props:
            _check(item, props[key], f"{path}.{key}", errors)
        elif extra is False:
            errors.append(f"{path}: unknown field {key!r}")
        elif isinstance(extra, Mapping):
            _check(item, extra, f"{path}.{key}", errors)


# -- comparison -----------------------------------------------------------------------------
def compare_records(a: Mapping[str, Any], b: Mapping[str, Any], *, all_results: bool = True) -> str:
    """Two records side by side: environment fields that differ, then inputs, results and wall
    times (every leaf with ``all_results``, else only those that differ), numbers with their
    relative change."""
    width = 34
    lines = [f"{'field':<{width}} {'a':>24} {'b':>24}  change"]
    env_changes = 0
    lines.append("== environment (differences only)")
    for section in ("created", *ENV_SECTIONS):
        for key, va, vb in _pairs(a.get(section), b.get(section), section):
            if va != vb:
                env_changes += 1
                lines.append(_row(key, va, vb, width))
    if not env_changes:
        lines.append("   (same)")
    for section in RESULT_SECTIONS:
        lines.append(f"== {section}")
        shown = 0
        for key, va, vb in _pairs(a.get(section), b.get(section), section):
            if all_results or va != vb:
                lines.append(_row(key, va, vb, width))
                shown += 1
        if not shown:
            lines.append("   (same)")
    return "\n".join(lines)


def _pairs(a: Any, b: Any, prefix: str) -> list[tuple[str, Any, Any]]:
    fa, fb = _flatten(a, prefix), _flatten(b, prefix)
    keys = list(dict.fromkeys([*fa, *fb]))
    return [(k, fa.get(k, _MISSING), fb.get(k, _MISSING)) for k in keys]


class _Missing:
    def __repr__(self) -> str:
        return "-"


_MISSING = _Missing()


def _flatten(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}"))
        return out or {prefix: {}}
    if isinstance(value, list) and any(isinstance(v, Mapping | list) for v in value):
        out = {}
        for i, item in enumerate(value):
            out.update(_flatten(item, f"{prefix}[{i}]"))
        return out
    return {prefix: value}


def _row(key: str, va: Any, vb: Any, width: int) -> str:
    change = ""
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (va, vb))
    if numbers and va != vb:
        change = f"{(vb - va) / abs(va) * 100:+.1f}%" if va else f"{vb - va:+g}"
    elif va != vb:
        change = "changed"
    return (
        f"{_cut(key, width):<{width}} {_cut(_text(va), 24):>24} {_cut(_text(vb), 24):>24}  {change}"
    )


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):
        return " ".join(map(str, value))
    return str(value)


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else "..." + text[-(width - 3) :]


# -- helpers --------------------------------------------------------------------------------
def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def _plain(value: Any) -> Any:
    """JSON-ready: tuples to lists, non-JSON leaves to strings (round-trips through json)."""
    return json.loads(json.dumps(value, default=str))


__all__ = [
    "SCHEMA_VERSION",
    "RecordError",
    "WallClock",
    "add_record_argument",
    "compare_records",
    "environment",
    "load_record",
    "make_record",
    "save_record",
    "validate_record",
    "write_record",
]
