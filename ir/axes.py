"""Mesh-axis references, whole axes or Shardy sub-axes ``"x":(pre)size``.

A sharding names mesh axes by string. A *sub-axis* ``x:(p)s`` is the part of axis ``x`` of
size ``s`` whose pre-size (the product of the parts of ``x`` more major than it) is ``p``;
``p * s`` divides the size of ``x``. Axis ``x`` of size 4 splits into ``x:(1)2`` (major) and
``x:(2)2`` (minor). Sub-axes come out of reshapes that split or merge a dimension inside an
axis (Shardy's rule; users never write them). Strings keep shardings cheap to hash and let
every ``mesh.axis_size`` / ``group_size`` caller work unchanged; the text form is Shardy's
(``"x":(1)2``), the in-memory name is ``x:(1)2`` (mesh axis names are identifiers, so the
colon is unambiguous).

Two references *overlap* when they share devices of one axis: a whole axis overlaps each of
its sub-axes, two sub-axes overlap when their ranges ``[p, p*s)`` of pre-sizes intersect.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence
from functools import lru_cache

from .errors import ShardingError

_SUB_AXIS = re.compile(r"([A-Za-z_][A-Za-z0-9_]*):\((\d+)\)(\d+)\Z")


@lru_cache(maxsize=4096)
def parse_axis(name: str) -> tuple[str, int, int | None]:
    """``"x"`` -> ``("x", 1, None)`` (the whole axis); ``"x:(2)4"`` -> ``("x", 2, 4)``."""
    if ":" not in name:
        return name, 1, None
    match = _SUB_AXIS.match(name)
    if match is None or int(match[2]) < 1 or int(match[3]) < 2:
        raise ShardingError(
            f"bad sub-axis {name!r}: write 'axis:(pre-size)size' with pre-size >= 1 and "
            "size >= 2, like 'x:(1)2'"
        )
    return match[1], int(match[2]), int(match[3])


def is_sub_axis(name: str) -> bool:
    return ":" in name


def base_axis(name: str) -> str:
    """The mesh axis a reference belongs to (the name itself for a whole axis)."""
    return name.split(":", 1)[0] if ":" in name else name


def sub_axis(base: str, pre: int, size: int, axis_size: int) -> str:
    """The reference to the part of ``base`` (of size ``axis_size``) at ``pre`` of ``size``:
    the whole axis when that is all of it."""
    if pre == 1 and size == axis_size:
        return base
    return f"{base}:({pre}){size}"


def span(name: str, axis_size: Callable[[str], int]) -> tuple[str, int, int]:
    """``(base, pre, pre * size)``: the range of pre-sizes the reference covers."""
    base, pre, size = parse_axis(name)
    return base, pre, pre * (size if size is not None else axis_size(base))


def overlaps(a: str, b: str) -> bool:
    """Whether two references share devices of one axis (a whole axis overlaps all of it)."""
    base_a, pre_a, size_a = parse_axis(a)
    base_b, pre_b, size_b = parse_axis(b)
    if base_a != base_b:
        return False
    if size_a is None or size_b is None:
        return True
    return pre_a < pre_b * size_b and pre_b < pre_a * size_a


def first_overlap(names: Sequence[str]) -> tuple[str, str] | None:
    """The first pair of overlapping references (equal names included), or None."""
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if a == b or overlaps(a, b):
                return a, b
    return None


def merge_adjacent(axes: Sequence[str], axis_size: Callable[[str], int]) -> tuple[str, ...]:
    """Shardy's canonical form of one dimension: adjacent sub-axes of one axis that continue
    each other (``x:(1)2, x:(2)2``) merge, and a sub-axis that covers its axis becomes it."""
    out: list[tuple[str, int, int]] = []
    for name in axes:
        base, pre, end = span(name, axis_size)
        if out and out[-1][0] == base and out[-1][2] == pre:
            out[-1] = (base, out[-1][1], end)
        else:
            out.append((base, pre, end))
    return tuple(sub_axis(b, pre, end // pre, axis_size(b)) for b, pre, end in out)


def axis_text(name: str) -> str:
    """Shardy's text: ``"x"`` or ``"x":(1)2``."""
    base, pre, size = parse_axis(name)
    return f'"{base}"' if size is None else f'"{base}":({pre}){size}'


def split_axis(name: str, factor: int, axis_size: Callable[[str], int]) -> tuple[str, str]:
    """Split a reference into its major part of size ``factor`` and the minor rest
    (``x`` of size 4 by 2 -> ``x:(1)2``, ``x:(2)2``); ``factor`` divides its size."""
    base, pre, end = span(name, axis_size)
    full = axis_size(base)
    return sub_axis(base, pre, factor, full), sub_axis(
        base, pre * factor, end // (pre * factor), full
    )


def atomize(
    lists: Sequence[Sequence[str]], axis_size: Callable[[str], int]
) -> list[tuple[str, ...]] | None:
    """The lists with every reference cut at every boundary any of them uses on its axis, so
    that a sub-axis prefix compares by equality: ``[x]`` and ``[x:(1)2]`` become
    ``[x:(1)2, x:(2)2]`` and ``[x:(1)2]``. None when the cuts do not divide one another
    (then the lists are compared as written)."""
    cuts: dict[str, set[int]] = {}
    spans = [[span(name, axis_size) for name in names] for names in lists]
    for entries in spans:
        for base, pre, end in entries:
            cuts.setdefault(base, set()).update((pre, end))
    order = {base: sorted(points) for base, points in cuts.items()}
    for points in order.values():
        if any(b % a for a, b in itertools.pairwise(points)):
            return None
    out = []
    for entries in spans:
        atoms: list[str] = []
        for base, pre, end in entries:
            points = [p for p in order[base] if pre <= p <= end]
            full = axis_size(base)
            atoms += [sub_axis(base, a, b // a, full) for a, b in itertools.pairwise(points)]
        out.append(tuple(atoms))
    return out
