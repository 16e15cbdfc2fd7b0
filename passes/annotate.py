"""User pins (GSPMD-style sharding constraints) applied to values by name or origin path (§4.1)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase

from shardplan.ir.errors import ShardingError
from shardplan.ir.graph import Graph, Value
from shardplan.ir.sharding import Pin, Sharding

from .manager import register_pass

_GLOB_CHARS = frozenset("*?")


@dataclass(frozen=True, slots=True)
class AnnotateOptions:
    """Pins as ``(key, sharding)`` pairs.

    A key is a value name (``x`` or ``%x``), an origin path (a parameter FQN such as
    ``layers.0.wq.weight`` or a pytree path), or a glob over either with ``*`` and ``?``
    (``layers.*.wq.weight``); brackets are literal, as in pytree paths ``params['w1']``.
    Exact keys win over globs; among equals the later pin wins.
    """

    pins: tuple[tuple[str, Sharding | Pin], ...] = ()
    """A ``Pin`` adds Shardy's user priority and where the pin comes from."""


@register_pass("annotate", options=AnnotateOptions)
def annotate_pass(graph: Graph, options: AnnotateOptions) -> Graph:
    """Pin user shardings on values: sets ``value.sharding`` and ``value.pinned``."""
    if options.pins and graph.mesh is None:
        raise ShardingError(f"graph @{graph.name} has no mesh; set graph.mesh before pinning")
    values = list(graph.values())
    exact = _exact_index(values)  # a strategy pins every input: no scan of the graph per pin
    ordered = sorted(enumerate(options.pins), key=lambda item: (not _is_glob(item[1][0]), item[0]))
    for _, (key, sharding) in ordered:
        plain = key.removeprefix("%")
        matched = exact.get(plain, []) if not _is_glob(plain) else match_values(values, key)
        if not matched:
            raise ShardingError(_no_match_message(key, values))
        for value in matched:
            _pin(graph, value, key, sharding)
    return graph


def annotate(graph: Graph, pins: Mapping[str, Sharding | Pin]) -> Graph:
    """Python shorthand: ``annotate(g, {"layers.*.wq.weight": Sharding.of(None, "tp")})``."""
    return annotate_pass(graph, AnnotateOptions(tuple(pins.items())))


def match_values(values: list[Value], key: str) -> list[Value]:
    """Values whose name or origin path equals ``key`` (or matches it as an fnmatch glob)."""
    key = key.removeprefix("%")
    if _is_glob(key):
        pattern = key.replace("[", "[[]")  # brackets are pytree subscripts, not char classes
        return [v for v in values if fnmatchcase(v.name, pattern) or _path_matches(v, pattern)]
    return [v for v in values if v.name == key or v.origin.path == key]


def _exact_index(values: list[Value]) -> dict[str, list[Value]]:
    """Name or origin path -> the values it names exactly, in graph order (``match_values``
    for a key without glob characters)."""
    index: dict[str, list[Value]] = {}
    for v in values:
        for key in dict.fromkeys((v.name, v.origin.path)):
            index.setdefault(key, []).append(v)
    return index


def _path_matches(value: Value, pattern: str) -> bool:
    return bool(value.origin.path) and fnmatchcase(value.origin.path, pattern)


def _is_glob(key: str) -> bool:
    return any(ch in _GLOB_CHARS for ch in key)


def _pin(graph: Graph, value: Value, key: str, pin: Sharding | Pin) -> None:
    assert graph.mesh is not None
    if not isinstance(pin, Sharding | Pin):
        raise ShardingError(
            f"pin {key!r} is a {type(pin).__name__}; give a Sharding or a Pin "
            '(Sharding.of("dp", None), Pin(sharding, priority=0))'
        )
    sharding = pin.sharding if isinstance(pin, Pin) else pin
    try:
        sharding.check(value.type, graph.mesh)
    except ShardingError as err:
        where = f" ({value.origin})" if str(value.origin) else ""
        raise ShardingError(
            f"pin {key!r} on %{value.name}{where}: {sharding} does not fit {value.type} "
            f"on mesh {graph.mesh}: {err}\n  hint: give one axis set per dimension "
            f"({value.type.rank} here) using axes {list(graph.mesh.axis_names)}, each dimension "
            "divisible by the product of its axes"
        ) from err
    value.sharding = sharding
    value.pinned = True
    value.priority = pin.priority if isinstance(pin, Pin) else None
    value.sharding_origin = (pin.source if isinstance(pin, Pin) else "") or f"pin {key!r}"


def _no_match_message(key: str, values: list[Value]) -> str:
    names = sorted({v.name for v in values} | {v.origin.path for v in values if v.origin.path})
    close = difflib.get_close_matches(key.removeprefix("%"), names, n=5, cutoff=0.5)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return (
        f"pin {key!r} matches no value name or origin path{hint}\n"
        "  hint: keys are value names, parameter paths like 'layers.0.wq.weight', or globs like "
        "'layers.*.wq.weight'"
    )
