"""Plan-file I/O beside the plan's serialisation: read a plan file's text with a one-line reason
when it cannot be, refuse an output path that cannot be written before any work is done, and
write atomically so a failed write never truncates the previous good file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from ..ir.errors import ArgumentError


def read_plan_text(path: Any) -> str:
    """A plan file's text, or one line saying why it cannot be read (missing, binary)."""
    if not isinstance(path, str | os.PathLike):
        raise ArgumentError(f"a plan path must be a str or Path, got {type(path).__name__}")
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ArgumentError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ArgumentError(f"{path} is not a plan file (binary, not JSON text)") from None


def check_output_path(path: Any) -> Path:
    """Refuse an output path that cannot be written, before any work is done."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ArgumentError(f"cannot write {path}: it is a directory; give a file name")
    if not parent.is_dir():
        raise ArgumentError(f"cannot write {path}: no directory {parent}; create it first")
    try:  # a real probe: os.access misses read-only mounts, and root passes every mode check
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        raise ArgumentError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path


def atomic_write_text(path: Any, text: str) -> None:
    """Write through a temporary file in the same directory and rename it over ``path``, so a
    failed write (full disk, interrupt) never truncates the previous good file."""
    path = Path(path)
    handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        if path.exists():
            os.chmod(temp, path.stat().st_mode & 0o777)
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(temp, 0o666 & ~umask)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
