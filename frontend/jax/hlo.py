"""Collective checker: read the collectives XLA inserted from compiled HLO text and compare them
with the ones a plan predicts (kind, count, bytes per device, mesh axes).

Handles the replica-group syntaxes of XLA's HLO printer: explicit ``{{0,1},{2,3}}``, iota
``[2,4]<=[8]`` (optionally transposed), and mesh form ``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}``
(optionally with ``device_ids=([2,4]T(1,0))``). Combined (tuple) all-reduces and all-gathers count
once per element, the way the plan lists them; CPU's tuple all-to-all counts once. CPU lowers a
reduce-scatter to all-reduce + dynamic-slice of its result, so that pattern (every reader takes
the same ``1/group`` slice) counts as one reduce-scatter with the slice's bytes.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ...costmodel.collectives import COLLECTIVE_KINDS
from ...ir import Mesh
from .paths import distinct_collectives

DTYPE_BYTES = {
    "f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s64": 8, "u64": 8, "s32": 4, "u32": 4,
    "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1,
}  # fmt: skip

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\(.*?\)|\S+)\s+([\w\-]+)\((.*)$")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z\d]*)\[([\d,]*)\]")


@dataclass(frozen=True, slots=True)
class HloCollective:
    """One collective in compiled HLO, per device."""

    kind: str
    bytes: int
    group_size: int | None
    axes: tuple[str, ...] | None
    """Mesh axes the replica group spans (sorted by mesh order); None if not a set of axes."""
    name: str = ""

    def key(self) -> tuple[str, int, tuple[str, ...] | None]:
        return (self.kind, self.bytes, self.axes)

    def __str__(self) -> str:
        axes = ",".join(self.axes) if self.axes is not None else f"group={self.group_size}"
        return f"{self.kind}[{axes}] {self.bytes} B ({self.name})"


@dataclass(slots=True)
class _Instruction:
    name: str
    type: str
    opcode: str
    operands: list[str]
    attrs: str
    computation: str
    users: list[tuple[str, int]] = field(default_factory=list)


def type_bytes(type_text: str) -> list[int]:
    """Bytes of each array in an HLO type (one entry per tuple element)."""
    return [
        DTYPE_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
        for dtype, dims in _ARRAY.findall(type_text)
    ]


def _split_call(rest: str) -> tuple[str, str]:
    """``a, b), attrs`` -> operand text and attribute text (matching the call's parenthesis)."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[:i], rest[i + 1 :]
    return rest, ""


def parse_instructions(hlo: str) -> tuple[dict[str, _Instruction], dict[tuple[str, int], str]]:
    """Instructions by name (with users), and (computation, parameter index) -> name."""
    table: dict[str, _Instruction] = {}
    params: dict[tuple[str, int], str] = {}
    computation = ""
    for line in hlo.splitlines():
        if header := _COMPUTATION.match(line):
            computation = header.group(1)
            continue
        if not (m := _INSTRUCTION.match(line)):
            continue
        operand_text, attrs = _split_call(m.group(4))
        operands = re.findall(r"%([\w.\-]+)", operand_text)
        inst = _Instruction(m.group(1), m.group(2), m.group(3), operands, attrs, computation)
        table[inst.name] = inst
        if inst.opcode == "parameter" and operand_text.strip().isdigit():
            params[(computation, int(operand_text))] = inst.name
    for inst in table.values():
        for i, operand in enumerate(inst.operands):
            if operand in table:
                table[operand].users.append((inst.name, i))
    return table, params


def _iota(dims: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def replica_groups(attrs: str, num_devices: int) -> list[list[int]] | None:
    """Device groups of a collective, from any of the printed syntaxes."""
    if m := re.search(r"replica_groups=\{(\{[\d,{}\s]*\})\}", attrs):
        return [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))]
    if re.search(r"replica_groups=\{\}", attrs):
        return [list(range(num_devices))]
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs):
        ids = _iota(_ints(m.group(3)), _ints(m.group(4)) if m.group(4) else None)
        return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\](.*?)\{([^}]*)\}", attrs):
        sizes = [
            (k.strip(" '"), int(v)) for k, v in (kv.split("=") for kv in m.group(1).split(","))
        ]
        names = [n for n, _ in sizes]
        dims = [s for _, s in sizes]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if d := re.search(r"device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)", m.group(2)):
            ids = _iota(_ints(d.group(1)), _ints(d.group(2)) if d.group(2) else None).reshape(dims)
        entries = [_mesh_axis_entry(a, names, dims) for a in m.group(3).split(",") if a.strip()]
        # A sub-axis 'name':(pre)size is the middle factor of that axis split pre x size x rest.
        factors = [[(0, n)] for n in dims]
        for axis, pre, size in entries:
            if size != dims[axis]:
                factors[axis] = [(0, pre), (pre, size), (pre * size, dims[axis] // (pre * size))]
        shape = [n for axis in factors for _, n in axis]
        ids = ids.reshape(shape)
        flat = [(axis, start) for axis, parts in enumerate(factors) for start, _ in parts]
        listed = [
            flat.index((axis, pre if size != dims[axis] else 0)) for axis, pre, size in entries
        ]
        rest = [i for i in range(len(shape)) if i not in listed]
        groups = ids.transpose(rest + listed).reshape(-1, math.prod(shape[i] for i in listed))
        return groups.tolist()
    return None


def _mesh_axis_entry(text: str, names: list[str], dims: list[int]) -> tuple[int, int, int]:
    """``'axis_1'`` -> (1, 1, size of axis 1); a sub-axis ``'axis_0':(2)2`` -> (0, 2, 2)."""
    name, _, sub = text.strip().partition(":")
    axis = names.index(name.strip(" '"))
    if m := re.fullmatch(r"\((\d+)\)(\d+)", sub.strip()):
        return axis, int(m.group(1)), int(m.group(2))
    return axis, 1, dims[axis]


def group_axes(group: Sequence[int], mesh: Mesh) -> tuple[str, ...] | None:
    """Mesh axes a device group spans (devices numbered row-major over the mesh)."""
    shape = [size for _, size in mesh.axes]
    coords = np.array(np.unravel_index(np.asarray(group), shape)).T
    varying = tuple(
        name for i, name in enumerate(mesh.axis_names) if len(set(coords[:, i].tolist())) > 1
    )
    return varying if mesh.group_size(varying) == len(group) else None


def _permute_axes(attrs: str, mesh: Mesh) -> tuple[str, ...] | None:
    pairs = re.findall(r"\{(\d+),(\d+)\}", attrs.split("source_target_pairs=", 1)[-1])
    if not pairs:
        return None
    shape = [size for _, size in mesh.axes]
    axes: set[str] = set()
    for src, dst in pairs:
        a, b = np.unravel_index(int(src), shape), np.unravel_index(int(dst), shape)
        axes |= {mesh.axis_names[i] for i in range(len(shape)) if a[i] != b[i]}
    return tuple(n for n in mesh.axis_names if n in axes)


def _slice_only_shape(table: dict[str, _Instruction], params: dict, name: str) -> str | None:
    """The slice type (``f32[2,8,32]``) when the only users of ``name`` (looking into fusions)
    are dynamic-slices that all take that shape; None otherwise. Readers that slice the same
    number of bytes along different dims (``[8,8,8]`` and ``[2,8,32]`` of ``[8,8,32]``) read
    the whole reduced tensor between them: that stays an all-reduce."""
    shapes = set()
    for user_name, index in table[name].users:
        user = table[user_name]
        if user.opcode == "dynamic-slice" and index == 0:
            shapes.add(user.type.split("{")[0])
        elif user.opcode == "fusion" and (m := re.search(r"calls=%([\w.\-]+)", user.attrs)):
            inner = params.get((m.group(1), index))
            found = _slice_only_shape(table, params, inner) if inner else None
            if found is None:
                return None
            shapes.add(found)
        else:
            return None
    return shapes.pop() if len(shapes) == 1 else None


def _scattered_bytes(
    table: dict[str, _Instruction], params: dict, name: str, nbytes: int, group: int | None
) -> int | None:
    """The shard bytes when an all-reduce's result is only read as its ``1/group`` slice (XLA's
    reduce-scatter pattern); None when any reader keeps more (readers that slice it apart,
    e.g. one by a sub-group of the reduction, or along another dim, read a reduced tensor: it
    stays an all-reduce)."""
    shape = _slice_only_shape(table, params, name) if name in table else None
    scattered = sum(type_bytes(shape)) if shape is not None else None
    if scattered is None or not group or scattered * group != nbytes:
        return None
    return scattered


def _element_names(
    table: dict[str, _Instruction], inst: _Instruction, count: int
) -> list[str | None]:
    """For a tuple-shaped collective, the get-tuple-element instruction of each element."""
    names: list[str | None] = [None] * count
    for user_name, _ in inst.users:
        user = table[user_name]
        if user.opcode == "get-tuple-element" and (m := re.search(r"index=(\d+)", user.attrs)):
            names[int(m.group(1))] = user.name
    return names


def collectives(hlo: str, mesh: Mesh) -> list[HloCollective]:
    """Every collective in compiled HLO text, in program order, one entry per planned collective."""
    table, params = parse_instructions(hlo)
    out: list[HloCollective] = []
    for inst in table.values():
        kind = inst.opcode.removesuffix("-start")
        if kind not in COLLECTIVE_KINDS or inst.opcode.endswith("-done"):
            continue
        groups = replica_groups(inst.attrs, mesh.size)
        size = len(groups[0]) if groups else None
        if kind == "collective-permute":
            axes = _permute_axes(inst.attrs, mesh)
        else:
            axes = group_axes(groups[0], mesh) if groups else None
        element_bytes = type_bytes(inst.type)
        if kind == "all-to-all" or len(element_bytes) == 1:
            entries = [(inst.name, sum(element_bytes))]
        else:
            names = _element_names(table, inst, len(element_bytes))
            entries = [(n or inst.name, b) for n, b in zip(names, element_bytes, strict=True)]
        for name, nbytes in entries:
            scattered = (
                _scattered_bytes(table, params, name, nbytes, size)
                if kind == "all-reduce"
                else None
            )
            if scattered is not None:
                out.append(HloCollective("reduce-scatter", scattered, size, axes, inst.name))
            else:
                out.append(HloCollective(kind, nbytes, size, axes, inst.name))
    return out


class CollectiveMismatch(AssertionError):
    """XLA inserted different collectives from the ones the plan predicted."""


def _ordered_axes(axes: Sequence[str], mesh: Mesh) -> tuple[str, ...]:
    return tuple(a for a in mesh.axis_names if a in axes)


def compare(predicted: Sequence[object], compiled: Sequence[HloCollective], mesh: Mesh) -> None:
    """Raise CollectiveMismatch unless both lists hold the same (kind, bytes, axes) multiset."""
    want = Counter(
        (c.kind, c.bytes, _ordered_axes(c.axes, mesh))  # type: ignore[attr-defined]
        for c in predicted
    )
    got = Counter(c.key() for c in compiled)
    if want == got:
        return
    lines = ["collectives differ from the plan", "  predicted by the plan:"]
    lines += [f"    {k} {b} B over {','.join(a)}" for (k, b, a) in sorted(want.elements())]
    lines += ["  inserted by XLA:"] + [f"    {c}" for c in compiled]
    missing, extra = want - got, got - want
    lines += [f"  missing from HLO: {sorted(missing.elements())}"]
    lines += [f"  not predicted: {sorted(extra.elements(), key=str)}"]
    raise CollectiveMismatch("\n".join(lines))


def check_plan_collectives(plan: object, jitted: object, *args: object) -> list[HloCollective]:
    """Compile ``jitted`` for ``args``, compare its collectives with the plan's.

    The plan's list is ``plan.collectives()`` with the same step on the same value counted
    once (``paths.distinct_collectives``): XLA does a shared reshard once.

    Returns the compiled collectives; raises CollectiveMismatch with both lists on a mismatch.
    """
    hlo = jitted.lower(*args).compile().as_text()  # type: ignore[attr-defined]
    found = collectives(hlo, plan.mesh)  # type: ignore[attr-defined]
    compare(distinct_collectives(plan.reshards), found, plan.mesh)  # type: ignore[attr-defined]
    return found
