"""Deterministic text form of a Graph; ``ir.parser.parse_graph`` reads it back byte for byte.

Grammar (``?`` optional, ``*`` repeated, ``#`` starts a comment)::

    graph   ::= mesh? func
    mesh    ::= 'mesh' '@m' '=' '<[' (STRING '=' INT),* ']>' '{cluster = ' STRING '}'
    func    ::= 'func' '@' NAME '(' (VALUE ':' value),* ')' '{' op* return '}'
    value   ::= TYPE sharding? meta?          # dtype[d0,d1]; meta: role, pinned, priority, origin
    op      ::= results '=' KIND '(' VALUE,* ')' attrs? rule loc? ':' (value,* | '()')
    results ::= VALUE,* | '()'
    rule    ::= 'rule<' STRING (', need_replication={' f,* '}')? (', summed={' f=[INT,*],* '}')?
                (', sizes={' f=INT,* '}')? '>'
    loc     ::= 'loc(' (('path' | 'module' | 'source') '=' STRING),* ')'
    return  ::= 'return' VALUE,* ('{aliases = {' INT '=' INT,* '}}')?

An op's ``{...}`` holds only its attributes (sorted by key), so attribute names never clash
with the rule or the origin. A result prints ``meta`` only where it differs from the op's
defaults (role ``act``, unpinned, the op's origin); graph inputs always print their role.
Rule sizes are printed only for factors seen inside compounds: the rest follow from the types.
"""

from __future__ import annotations

import re

from .graph import AttrValue, Graph, Op, Origin, Role, Value
from .mesh import Mesh
from .rules import ShardingRule, summed_text

_BARE_NAME = re.compile(r"[A-Za-z0-9_]+\Z")
_BARE_KIND = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*\Z")


def print_graph(graph: Graph, origins: bool = False) -> str:
    """The whole graph: optional mesh line, then the function with one op per line.

    ``origins``: say after each sharding where it comes from (``Value.sharding_origin``: a pin,
    a constraint, or the tensor and op it was propagated from) in ``#`` comments, which the
    parser skips: the graph's inputs on lines before ``func``, each op's results at its end.
    """
    lines: list[str] = []
    if graph.mesh is not None:
        lines.append(print_mesh(graph.mesh))
    if origins:
        lines.extend(f"# {why}" for why in _origins(graph.inputs))
    args = ", ".join(_input_text(v) for v in graph.inputs)
    lines.append(f"func @{name_text(graph.name)}({args}) {{")
    for op in graph.ops:
        why = "; ".join(_origins(op.results)) if origins else ""
        lines.append("  " + print_op(op) + (f"  # {why}" if why else ""))
    lines.append("  " + _return_text(graph))
    lines.append("}")
    return "\n".join(lines) + "\n"


def _origins(values: list[Value]) -> list[str]:
    return [
        f"%{v.name}: {(v.sharding_origin or 'given').replace(chr(10), ' ')}"
        for v in values
        if v.sharding is not None
    ]


def print_mesh(mesh: Mesh) -> str:
    return f"mesh @m = {mesh} {{cluster = {quote(mesh.cluster)}}}"


def print_op(op: Op) -> str:
    """One op line (without indentation), e.g. ``%0 = dot(%x, %w) rule<"ik,kj->ij"> : f32[2,3]``."""
    lhs = ", ".join(value_ref(r) for r in op.results) if op.results else "()"
    kind = op.kind if _BARE_KIND.match(op.kind) else quote(op.kind)
    text = f"{lhs} = {kind}(" + ", ".join(value_ref(v) for v in op.operands) + ")"
    if op.attrs:
        text += " " + attrs_text(op.attrs)
    text += " " + rule_text(op.rule)
    if op.origin != Origin():
        text += " loc(" + ", ".join(_origin_items(op.origin)) + ")"
    results = ", ".join(_result_text(r, op) for r in op.results) if op.results else "()"
    return f"{text} : {results}"


def rule_text(rule: ShardingRule) -> str:
    """``rule<"(ij)k->i(jk)", need_replication={j}, sizes={j=4}>``: all from_spec needs."""
    parts = [quote(rule.spec)]
    if rule.need_replication:
        parts.append("need_replication={" + ", ".join(sorted(rule.need_replication)) + "}")
    if rule.summed:
        parts.append("summed={" + summed_text(rule.summed) + "}")
    compound = rule.compound_only_sizes()
    if compound:
        parts.append("sizes={" + ", ".join(f"{f}={n}" for f, n in compound.items()) + "}")
    return "rule<" + ", ".join(parts) + ">"


def attrs_text(attrs: dict[str, AttrValue]) -> str:
    items = [f"{_key_text(k)} = {attr_value_text(attrs[k])}" for k in sorted(attrs)]
    return "{" + ", ".join(items) + "}"


def attr_value_text(value: AttrValue) -> str:
    """bool -> true/false, int, float via repr (exact), str quoted, tuple[int] -> [1, 2],
    tuple[bool] -> [true, false] (a gradient mask), tuple[tuple[int]] -> [[1, 1], [0, 0]]."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return quote(value)
    if isinstance(value, tuple) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if isinstance(value, tuple) and value and all(isinstance(v, bool) for v in value):
        return "[" + ", ".join(attr_value_text(v) for v in value) + "]"  # output_mask
    if isinstance(value, tuple) and value and all(isinstance(v, tuple) for v in value):
        return "[" + ", ".join(attr_value_text(v) for v in value) + "]"  # conv padding pairs
    raise TypeError(
        f"attribute value {value!r} is not an int, float, str, bool, tuple of ints, tuple of "
        "bools or tuple of tuples of ints"
    )


def value_ref(value: Value) -> str:
    return "%" + name_text(value.name)


def name_text(name: str) -> str:
    """Bare when made of letters, digits and ``_``; quoted otherwise."""
    return name if _BARE_NAME.match(name) else quote(name)


def quote(text: str) -> str:
    """A double-quoted string; backslash, quote and control characters are escaped."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _key_text(key: str) -> str:
    return key if key.isidentifier() and key.isascii() else quote(key)


def _origin_items(origin: Origin) -> list[str]:
    fields = (("path", origin.path), ("module", origin.module), ("source", origin.source))
    return [f"{key} = {quote(text)}" for key, text in fields if text]


def _value_text(value: Value, meta: list[str]) -> str:
    text = str(value.type)
    if value.sharding is not None:
        text += " " + str(value.sharding)
    if meta:
        text += " {" + ", ".join(meta) + "}"
    return text


def _input_text(value: Value) -> str:
    meta = [f"role = {quote(value.role.value)}"]
    if value.pinned:
        meta.append("pinned = true")
        if value.priority is not None:
            meta.append(f"priority = {value.priority}")
    meta += _origin_items(value.origin)
    return f"{value_ref(value)}: {_value_text(value, meta)}"


def _result_text(value: Value, op: Op) -> str:
    meta = [] if value.role is Role.ACTIVATION else [f"role = {quote(value.role.value)}"]
    if value.pinned:
        meta.append("pinned = true")
        if value.priority is not None:
            meta.append(f"priority = {value.priority}")
    if value.origin != op.origin:
        meta += _origin_items(value.origin) or ['path = ""']  # an empty origin, said explicitly
    return _value_text(value, meta)


def _return_text(graph: Graph) -> str:
    text = "return"
    if graph.outputs:
        text += " " + ", ".join(value_ref(v) for v in graph.outputs)
    if graph.output_aliases:
        pairs = ", ".join(f"{o} = {i}" for o, i in sorted(graph.output_aliases.items()))
        text += " {aliases = {" + pairs + "}}"
    return text
