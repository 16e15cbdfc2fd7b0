"""Generic argument checks: names (a did-you-mean), sizes, counts, seconds, mesh axes and a class
passed for an instance, so a bad argument fails at the door with one line naming the argument,
what was given and the fix. Every check raises ``ArgumentError`` (or ``ShardingError`` for mesh
axes); names are matched case-sensitively. Pure Python, below every other layer.
"""

from __future__ import annotations

import difflib
import math
import operator
import re
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from .errors import ArgumentError, ShardingError

DEFAULT_CLUSTER = "h100-sxm"
"""The one default cluster: of ``sp.Mesh({...})`` without ``cluster=``, of a dict ``mesh=``, of
``sp.plan(devices=...)`` and of the CLI. A user who names no cluster most likely plans for real
GPUs; the synthetic ``cpu-test`` cluster is opt-in (``cluster="cpu-test"``)."""

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


# -- names ------------------------------------------------------------------------------------
def did_you_mean(name: str, known: Iterable[str]) -> str:
    """`` did you mean 'x'?`` for a near miss (case differences included), else ``""``."""
    known = list(known)
    folded = [k for k in known if k.lower() == name.lower()]
    close = folded or difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" did you mean {close[0]!r}?" if close else ""


def check_choice(value: Any, name: str, choices: Collection[Any]) -> Any:
    """``value`` must be one of ``choices`` exactly (case-sensitive)."""
    if value in choices and (value is None or isinstance(value, str)):
        return value
    shown = ", ".join(repr(c) for c in choices)
    hint = (
        did_you_mean(value, [c for c in choices if c is not None]) if isinstance(value, str) else ""
    )
    raise ArgumentError(f"{name}={value!r} is not one of {shown};{hint or ' pick one of those'}")


# -- numbers ----------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """Bytes from ``40GB`` (10^9), ``512MiB`` (2^20), ``24e9`` or ``1.5TB``."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ArgumentError(
            f"bad size {text!r}: use a number with an optional unit, like 40GB, 512MiB or 24e9"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def check_size(value: Any, name: str, unbounded: bool = False) -> float | None:
    """Bytes > 0 from a number or a string like ``"40GB"``; ``None`` stays ``None``.
    ``unbounded``: ``math.inf`` is accepted too (no limit)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = parse_size(value)
        except ArgumentError:
            raise ArgumentError(
                f"{name}={value!r} is not a size: use bytes or a unit, like 40e9, '40GB', '512MiB'"
            ) from None
    number = _number(value, name, "bytes, like 40e9 or '40GB'")
    if not number > 0 or (math.isinf(number) and not unbounded):
        raise ArgumentError(f"{name}={value!r} must be a finite size > 0, like 40e9 or '40GB'")
    return number


def check_seconds(value: Any, name: str) -> float:
    """A finite time limit > 0 (``None`` is refused: the solver always needs a limit)."""
    number = _number(value, name, "seconds > 0, like 30")
    if not number > 0 or math.isinf(number):
        raise ArgumentError(f"{name}={value!r} must be a finite number of seconds > 0, like 30")
    return number


def check_count(value: Any, name: str, *, allow_none: bool = False) -> int | None:
    """A whole number >= 1 (``2.5`` is refused, never rounded)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool):
        raise ArgumentError(f"{name}={value!r} must be a whole number >= 1, not a bool")
    try:
        count = operator.index(value)
    except TypeError:
        raise ArgumentError(
            f"{name}={value!r} ({type(value).__name__}) must be a whole number >= 1"
        ) from None
    if count < 1:
        auto = "; leave it out (None) to choose automatically" if allow_none else ""
        raise ArgumentError(f"{name}={count} must be >= 1{auto}")
    return count


def _number(value: Any, name: str, want: str) -> float:
    if isinstance(value, bool) or (not isinstance(value, int | float) and not _is_real(value)):
        raise ArgumentError(f"{name}={value!r} ({type(value).__name__}) must be {want}")
    number = float(value)
    if math.isnan(number):
        raise ArgumentError(f"{name} is NaN; give {want}")
    return number


def _is_real(value: Any) -> bool:
    """numpy scalars and similar: anything ``float()`` accepts that is not text."""
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, str | bytes)


# -- meshes, models ---------------------------------------------------------------------------
def mesh_axes(axes: Any) -> tuple[tuple[str, int], ...]:
    """``Mesh``'s axes as checked ``(name, size)`` pairs: identifiers, whole sizes >= 1."""
    if isinstance(axes, Mapping):
        pairs = list(axes.items())
    elif isinstance(axes, Iterable) and not isinstance(axes, str | bytes):
        pairs = list(axes)
    else:
        raise ShardingError(
            f"mesh axes must be a dict of name -> size like {{'dp': 2, 'tp': 4}}, "
            f"got {type(axes).__name__}"
        )
    out = []
    for pair in pairs:
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            raise ShardingError(f"mesh axes must be (name, size) pairs, got {pair!r:.60}")
        name, size = pair
        if not isinstance(name, str) or not name.isidentifier():
            raise ShardingError(f"mesh axis name {name!r} must be an identifier like 'dp'")
        if isinstance(size, bool) or not hasattr(size, "__index__"):
            raise ShardingError(
                f"mesh axis {name!r} has size {size!r} ({type(size).__name__}); "
                f"sizes are whole numbers >= 1, like {{{name!r}: 2}}"
            )
        size = operator.index(size)
        if size < 1:
            raise ShardingError(f"mesh axis {name!r} has size {size}; sizes must be >= 1")
        out.append((name, size))
    names = [name for name, _ in out]
    if len(set(names)) != len(names):
        raise ShardingError(f"mesh axis names must be unique, got {names}")
    return tuple(out)


def check_model(model: Any, where: str) -> None:
    """Catch a class passed where an instance (or a function) belongs."""
    if isinstance(model, type):
        raise ArgumentError(
            f"{where} got the class {model.__name__}, not a model; pass an instance, "
            f"like {model.__name__}(...)"
        )
