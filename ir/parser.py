"""Parser for the text form written by ``ir.printer`` (grammar in that module's docstring).

Calls come in xDSL-style pairs: ``parse_optional_x()`` returns None when ``x`` is not next and
``parse_x(context)`` raises an IRParseError with line:column, the source line and a caret.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from .errors import IRParseError, ShardplanError
from .graph import AttrValue, Graph, Origin, Role, Value
from .mesh import Mesh
from .rules import ShardingRule
from .sharding import Sharding
from .types import TensorType

_TOKEN = re.compile(
    r"""(?P<ws>(?:\s|\#[^\n]*)+)
    |(?P<float>-?(?:\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+)|-inf\b)
    |(?P<int>-?\d+)
    |(?P<str>"(?:[^"\\\n]|\\.)*")
    |(?P<ident>[A-Za-z_][A-Za-z0-9_.]*)
    |(?P<sigil>[%@](?:[A-Za-z0-9_]+|"(?:[^"\\\n]|\\.)*"))
    |(?P<punct>[()\[\]{}<>,=:])""",
    re.VERBOSE,
)
_ESCAPES = {'"': '"', "\\": "\\", "n": "\n", "t": "\t"}
_ORIGIN_KEYS = ("path", "module", "source")
_INF, _NAN = float("inf"), float("nan")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Token:
    kind: str
    """ws-free kinds: float, int, str, ident, sigil, punct, eof."""
    text: str
    offset: int


def parse_graph(text: str) -> Graph:
    """Parse the text form into a Graph whose values keep their printed names."""
    return Parser(text).parse_module()


class Parser:
    """Recursive-descent parser over a token list; one instance parses one text."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = self._lex(text)
        self.pos = 0
        self.graph = Graph()
        self.scope: dict[str, Value] = {}

    # -- tokens and errors -----------------------------------------------------------------
    def _lex(self, text: str) -> list[Token]:
        tokens, offset = [], 0
        while offset < len(text):
            match = _TOKEN.match(text, offset)
            if match is None:
                raise self.error_at(offset, f"unexpected character {text[offset]!r}")
            if match.lastgroup != "ws":
                tokens.append(Token(str(match.lastgroup), match.group(), offset))
            offset = match.end()
        tokens.append(Token("eof", "", len(text)))
        return tokens

    def error_at(self, offset: int, message: str) -> IRParseError:
        line_start = self.text.rfind("\n", 0, offset) + 1
        line_end = self.text.find("\n", offset)
        source = self.text[line_start : line_end if line_end >= 0 else len(self.text)]
        line = self.text.count("\n", 0, offset) + 1
        column = offset - line_start + 1
        caret = " " * (column - 1) + "^"
        return IRParseError(f"{line}:{column}: {message}\n  {source}\n  {caret}")

    def error(self, message: str, token: Token | None = None) -> IRParseError:
        token = token or self.peek()
        found = "end of input" if token.kind == "eof" else repr(token.text)
        return self.error_at(token.offset, f"{message}, found {found}")

    def peek(self) -> Token:
        return self.tokens[self.pos]

    def advance(self) -> Token:
        token = self.tokens[self.pos]
        self.pos += 1
        return token

    # -- terminals ---------------------------------------------------------------------------
    def parse_optional_punct(self, char: str) -> Token | None:
        token = self.peek()
        return self.advance() if token.kind == "punct" and token.text == char else None

    def parse_punct(self, char: str, context: str) -> Token:
        token = self.parse_optional_punct(char)
        if token is None:
            raise self.error(f"expected '{char}' {context}")
        return token

    def parse_optional_keyword(self, word: str) -> Token | None:
        token = self.peek()
        return self.advance() if token.kind == "ident" and token.text == word else None

    def parse_keyword(self, word: str, context: str) -> Token:
        token = self.parse_optional_keyword(word)
        if token is None:
            raise self.error(f"expected '{word}' {context}")
        return token

    def parse_ident(self, context: str) -> Token:
        if self.peek().kind != "ident":
            raise self.error(f"expected an identifier {context}")
        return self.advance()

    def parse_optional_string(self) -> str | None:
        token = self.peek()
        return self.unquote(self.advance()) if token.kind == "str" else None

    def parse_string(self, context: str) -> str:
        text = self.parse_optional_string()
        if text is None:
            raise self.error(f"expected a string {context}")
        return text

    def parse_int(self, context: str) -> int:
        if self.peek().kind != "int":
            raise self.error(f"expected an integer {context}")
        return int(self.advance().text)

    def unquote(self, token: Token) -> str:
        body, out, i = token.text[1:-1], [], 0
        while i < len(body):
            ch = body[i]
            if ch != "\\":
                out.append(ch)
                i += 1
            elif body[i + 1] == "u" and re.fullmatch(r"[0-9a-fA-F]{4}", body[i + 2 : i + 6]):
                out.append(chr(int(body[i + 2 : i + 6], 16)))
                i += 6
            elif body[i + 1] in _ESCAPES:
                out.append(_ESCAPES[body[i + 1]])
                i += 2
            else:
                raise self.error_at(token.offset + 1 + i, f"unknown escape '\\{body[i + 1]}'")
        return "".join(out)

    def parse_list(self, close: str, item: Callable[[], T], context: str) -> list[T]:
        """Comma-separated ``item()`` results up to the ``close`` punctuation (consumed)."""
        items: list[T] = []
        if self.parse_optional_punct(close):
            return items
        while True:
            items.append(item())
            if self.parse_optional_punct(close):
                return items
            self.parse_punct(",", f"or '{close}' {context}")

    def sigil_name(self, token: Token) -> str:
        rest = token.text[1:]
        return self.unquote(Token("str", rest, token.offset + 1)) if rest[0] == '"' else rest

    def parse_optional_sigil(self, sigil: str) -> tuple[str, Token] | None:
        token = self.peek()
        if token.kind == "sigil" and token.text[0] == sigil:
            return self.sigil_name(self.advance()), token
        return None

    def parse_sigil(self, sigil: str, context: str) -> tuple[str, Token]:
        found = self.parse_optional_sigil(sigil)
        if found is None:
            raise self.error(f"expected a '{sigil}' name {context}")
        return found

    # -- module, mesh, function ------------------------------------------------------------
    def parse_module(self) -> Graph:
        self.graph.mesh = self.parse_optional_mesh()
        self.parse_func()
        if self.peek().kind != "eof":
            raise self.error("expected end of input after the function")
        return self.graph

    def parse_optional_mesh(self) -> Mesh | None:
        start = self.parse_optional_keyword("mesh")
        if start is None:
            return None
        self.parse_sigil("@", "naming the mesh")
        self.parse_punct("=", "after the mesh name")
        self.parse_punct("<", "to open the mesh axes")
        self.parse_punct("[", "to open the mesh axes")
        axes = self.parse_list("]", self.parse_mesh_axis, "in the mesh axes")
        self.parse_punct(">", "to close the mesh axes")
        cluster = None  # the one default (validate.DEFAULT_CLUSTER), as ``Mesh({...})``
        if self.parse_optional_punct("{"):
            self.parse_keyword("cluster", "in the mesh attributes")
            self.parse_punct("=", "after 'cluster'")
            cluster = self.parse_string("naming the cluster")
            self.parse_punct("}", "to close the mesh attributes")
        return self.build(start, lambda: Mesh(axes, cluster=cluster))

    def parse_mesh_axis(self) -> tuple[str, int]:
        name = self.parse_string("naming a mesh axis")
        self.parse_punct("=", "after the mesh axis name")
        return name, self.parse_int("for the mesh axis size")

    def build(self, token: Token, make: Callable[[], T]) -> T:
        """Run a constructor, turning its validation error into a parse error at ``token``."""
        try:
            return make()
        except ShardplanError as exc:
            raise self.error_at(token.offset, str(exc).splitlines()[0]) from None

    def parse_func(self) -> None:
        self.parse_keyword("func", "to start the function")
        self.graph.name = self.parse_sigil("@", "naming the function")[0]
        self.parse_punct("(", "to open the function arguments")
        self.parse_list(")", self.parse_input, "in the function arguments")
        self.parse_punct("{", "to open the function body")
        while self.peek().kind == "sigil" or self.peek().text == "(":
            self.parse_op()
        self.parse_return()
        self.parse_punct("}", "to close the function body")

    def define(self, name: str, token: Token) -> None:
        if name in self.scope or name in self.graph._used:
            raise self.error_at(token.offset, f"redefinition of value %{name}")

    def lookup(self) -> Value:
        name, token = self.parse_sigil("%", "naming a value")
        if name not in self.scope:
            raise self.error_at(token.offset, f"use of undefined value %{name}")
        return self.scope[name]

    def parse_input(self) -> None:
        name, token = self.parse_sigil("%", "naming a function argument")
        self.define(name, token)
        self.parse_punct(":", "after the argument name")
        type_, sharding, meta = self.parse_value_annotation()
        role, pinned, origin = self.meta_fields(meta, Origin())
        value = self.graph.add_input(name, type_, role, origin, sharding, pinned)
        value.priority = self.priority(meta)
        self.rename(value, name)

    def rename(self, value: Value, name: str) -> None:
        """Keep the printed name even where ``Graph.fresh_name`` would have changed it."""
        if value.name != name:
            self.graph._used.discard(value.name)
            value.name = name
            self.graph._used.add(name)
        self.scope[name] = value

    # -- values: type, sharding, meta ------------------------------------------------------
    def parse_value_annotation(self) -> tuple[TensorType, Sharding | None, dict]:
        type_ = self.parse_type("for the value type")
        sharding = self.parse_optional_sharding()
        meta = self.parse_optional_meta() or {}
        return type_, sharding, meta

    def parse_type(self, context: str) -> TensorType:
        token = self.parse_ident(context)
        self.parse_punct("[", "to open the shape")
        shape = self.parse_list("]", lambda: self.parse_int("in the shape"), "in the shape")
        return self.build(token, lambda: TensorType(tuple(shape), token.text))

    def parse_optional_sharding(self) -> Sharding | None:
        start = self.parse_optional_punct("[")
        if start is None:
            return None
        dims = self.parse_list("]", self.parse_axis_set, "in the sharding")
        partial: list[str] = []
        if self.parse_optional_keyword("partial"):
            self.parse_punct("=", "after 'partial'")
            partial = self.parse_axis_set()
        return self.build(start, lambda: Sharding(tuple(dims), frozenset(partial)))

    def parse_axis_set(self) -> list[str]:
        self.parse_punct("{", "to open a set of mesh axes")
        return self.parse_list("}", self.parse_axis, "in the axes")

    def parse_axis(self) -> str:
        """``"x"`` or a sub-axis ``"x":(pre)size`` (kept as ``x:(pre)size``, ``ir/axes.py``)."""
        name = self.parse_string("naming a mesh axis")
        if self.parse_optional_punct(":") is None:
            return name
        self.parse_punct("(", "to open the sub-axis pre-size")
        pre = self.parse_int("as the sub-axis pre-size")
        self.parse_punct(")", "to close the sub-axis pre-size")
        return f"{name}:({pre}){self.parse_int('as the sub-axis size')}"

    def parse_optional_meta(self) -> dict[str, tuple[Token, str]] | None:
        if self.parse_optional_punct("{") is None:
            return None
        items = self.parse_list("}", self.parse_meta_item, "in the value attributes")
        return dict(items)

    def parse_meta_item(self) -> tuple[str, tuple[Token, str]]:
        key = self.parse_ident("in the value attributes")
        if key.text not in ("role", "pinned", "priority", *_ORIGIN_KEYS):
            raise self.error("expected role, pinned, priority, path, module or source", key)
        self.parse_punct("=", f"after '{key.text}'")
        if key.text == "priority":
            return key.text, (key, str(self.parse_int("after 'priority ='")))
        if key.text == "pinned":
            self.parse_keyword("true", "after 'pinned ='")
            return key.text, (key, "true")
        return key.text, (key, self.parse_string(f"for '{key.text}'"))

    def priority(self, meta: dict) -> int | None:
        """A pin's user priority (``priority = 1``, Shardy's ``p1``); only on a pinned value."""
        if "priority" not in meta:
            return None
        token, text = meta["priority"]
        if "pinned" not in meta:
            raise self.error("'priority' is a pin's priority: give 'pinned = true' too", token)
        return int(text)

    def meta_fields(self, meta: dict, default: Origin) -> tuple[Role, bool, Origin]:
        role = Role.ACTIVATION
        if "role" in meta:
            token, text = meta["role"]
            roles = ", ".join(r.value for r in Role)
            role = self.build(token, lambda: _role(text, roles))
        origin = default
        if any(key in meta for key in _ORIGIN_KEYS):
            origin = Origin(*(meta[key][1] if key in meta else "" for key in _ORIGIN_KEYS))
        return role, "pinned" in meta, origin

    # -- ops -------------------------------------------------------------------------------
    def parse_op(self) -> None:
        names = self.parse_result_names()
        self.parse_punct("=", "after the result names")
        kind_token = self.peek()
        kind = self.parse_optional_string() or self.parse_ident("naming the op kind").text
        self.parse_punct("(", "to open the operands")
        operands = self.parse_list(")", self.lookup, "in the operands")
        attrs = self.parse_optional_attrs() or {}
        rule_token = self.parse_keyword("rule", "after the operands and attributes")
        spec, need, summed, sizes = self.parse_rule_body()
        origin = self.parse_optional_loc() or Origin()
        self.parse_punct(":", "before the result types")
        results = self.parse_result_annotations(len(names), kind_token)
        types = [t for t, _, _ in results]
        rule = self.build(rule_token, lambda: _rule(spec, operands, types, need, sizes, summed))
        op = self.graph.add_op(kind, operands, types, rule, attrs, origin, [n for n, _ in names])
        for value, (name, _), (_, sharding, meta) in zip(op.results, names, results, strict=True):
            self.rename(value, name)
            value.role, value.pinned, value.origin = self.meta_fields(meta, origin)
            value.sharding, value.priority = sharding, self.priority(meta)

    def parse_result_names(self) -> list[tuple[str, Token]]:
        if self.parse_optional_punct("("):
            self.parse_punct(")", "for an op without results")
            return []
        names = [self.parse_sigil("%", "naming a result")]
        while self.parse_optional_punct(","):
            names.append(self.parse_sigil("%", "naming a result"))
        for i, (name, token) in enumerate(names):
            self.define(name, token)
            if any(name == other for other, _ in names[:i]):
                raise self.error_at(token.offset, f"redefinition of value %{name}")
        return names

    def parse_result_annotations(self, count: int, kind_token: Token) -> list:
        if count == 0:
            self.parse_punct("(", "for an op without results")
            self.parse_punct(")", "for an op without results")
            return []
        results = [self.parse_value_annotation()]
        while self.parse_optional_punct(","):
            results.append(self.parse_value_annotation())
        if len(results) != count:
            message = f"the op names {count} results but gives {len(results)} result types"
            raise self.error_at(kind_token.offset, message)
        return results

    def parse_optional_attrs(self) -> dict[str, AttrValue] | None:
        if self.parse_optional_punct("{") is None:
            return None
        return dict(self.parse_list("}", self.parse_attr, "in the op attributes"))

    def parse_attr(self) -> tuple[str, AttrValue]:
        key = self.parse_optional_string()
        if key is None:
            key = self.parse_ident("naming an attribute").text
        self.parse_punct("=", f"after attribute '{key}'")
        return key, self.parse_attr_value()

    def parse_attr_value(self) -> AttrValue:
        token = self.peek()
        words: dict[str, AttrValue] = {"true": True, "false": False, "inf": _INF, "nan": _NAN}
        if token.kind == "ident" and token.text in words:
            self.advance()
            return words[token.text]
        if token.kind in ("int", "float"):
            self.advance()
            return int(token.text) if token.kind == "int" else float(token.text)
        if token.kind == "str":
            return self.parse_string("")
        if self.parse_optional_punct("["):
            if self.parse_optional_punct("[") is not None:  # [[1, 1], [0, 0]]: conv padding
                rows = [self.parse_int_list()]
                while self.parse_optional_punct(",") is not None:
                    rows.append(self.parse_nested_int_list())
                self.parse_punct("]", "closing the list of lists")
                return tuple(rows)
            if self.peek().kind == "ident" and self.peek().text in ("true", "false"):
                return self.parse_bool_list()  # [true, false]: a gradient mask
            return self.parse_int_list()
        raise self.error("expected an attribute value (int, float, string, bool or [ints])")

    def parse_bool_list(self) -> tuple[bool, ...]:
        """The rest of ``[true, false]`` after its ``[``."""

        def one() -> bool:
            token = self.parse_ident("in the list of bools")
            if token.text not in ("true", "false"):
                raise self.error(f"expected true or false in the list, got '{token.text}'", token)
            return token.text == "true"

        return tuple(self.parse_list("]", one, "in the list"))

    def parse_int_list(self) -> tuple[int, ...]:
        """The rest of ``[1, 2]`` after its ``[``."""
        return tuple(self.parse_list("]", lambda: self.parse_int("in the list"), "in the list"))

    def parse_nested_int_list(self) -> tuple[int, ...]:
        self.parse_punct("[", "opening an inner list")
        return self.parse_int_list()

    def parse_rule_body(self) -> tuple[str, list[str], list[tuple[str, tuple[int, ...]]], dict]:
        self.parse_punct("<", "after 'rule'")
        spec = self.parse_string("with the rule spec")
        need: list[str] = []
        summed: list[tuple[str, tuple[int, ...]]] = []
        sizes: dict[str, int] = {}
        if self.parse_optional_punct(",") and self.parse_optional_keyword("need_replication"):
            self.parse_punct("=", "after 'need_replication'")
            self.parse_punct("{", "to open the need_replication factors")
            need = self.parse_list("}", self.parse_factor, "in need_replication")
            self.parse_optional_punct(",")
        if self.parse_optional_keyword("summed"):
            self.parse_punct("=", "after 'summed'")
            self.parse_punct("{", "to open the summed factors")
            summed = self.parse_list("}", self.parse_summed_factor, "in summed")
            self.parse_optional_punct(",")
        if self.parse_optional_keyword("sizes"):
            self.parse_punct("=", "after 'sizes'")
            self.parse_punct("{", "to open the factor sizes")
            sizes = dict(self.parse_list("}", self.parse_factor_size, "in the factor sizes"))
        self.parse_punct(">", "to close the rule")
        return spec, need, summed, sizes

    def parse_factor(self) -> str:
        return self.parse_ident("naming a factor").text

    def parse_summed_factor(self) -> tuple[str, tuple[int, ...]]:
        name = self.parse_factor()
        self.parse_punct("=", "after the summed factor")
        self.parse_punct("[", "to open the results it is summed into")
        return name, tuple(
            self.parse_list("]", lambda: self.parse_int("a result index"), "in the list")
        )

    def parse_factor_size(self) -> tuple[str, int]:
        name = self.parse_factor()
        self.parse_punct("=", "after the factor name")
        return name, self.parse_int("for the factor size")

    def parse_optional_loc(self) -> Origin | None:
        if self.parse_optional_keyword("loc") is None:
            return None
        self.parse_punct("(", "after 'loc'")
        items = dict(self.parse_list(")", self.parse_loc_item, "in the location"))
        return Origin(*(items.get(key, "") for key in _ORIGIN_KEYS))

    def parse_loc_item(self) -> tuple[str, str]:
        key = self.parse_ident("in the location")
        if key.text not in _ORIGIN_KEYS:
            raise self.error("expected path, module or source", key)
        self.parse_punct("=", f"after '{key.text}'")
        return key.text, self.parse_string(f"for '{key.text}'")

    # -- return ----------------------------------------------------------------------------
    def parse_return(self) -> None:
        self.parse_keyword("return", "to end the function body (or an op starting with '%')")
        outputs = []
        if self.peek().kind == "sigil":
            outputs.append(self.lookup())
            while self.parse_optional_punct(","):
                outputs.append(self.lookup())
        aliases: dict[int, int] = {}
        if self.parse_optional_punct("{"):
            self.parse_keyword("aliases", "in the return attributes")
            self.parse_punct("=", "after 'aliases'")
            self.parse_punct("{", "to open the aliases")
            aliases = dict(self.parse_list("}", self.parse_alias, "in the aliases"))
            self.parse_punct("}", "to close the return attributes")
        self.graph.set_outputs(outputs, aliases)

    def parse_alias(self) -> tuple[int, int]:
        output = self.parse_int("for the output index")
        self.parse_punct("=", "between output and input index")
        return output, self.parse_int("for the aliased input index")


def _role(text: str, roles: str) -> Role:
    try:
        return Role(text)
    except ValueError:
        raise IRParseError(f"unknown role {text!r}; roles are {roles}") from None


def _rule(
    spec: str,
    operands: list[Value],
    types: list[TensorType],
    need: list[str],
    sizes: dict,
    summed: list[tuple[str, tuple[int, ...]]] = (),  # type: ignore[assignment]
) -> ShardingRule:
    shapes = [v.type.shape for v in operands]
    result_shapes = [t.shape for t in types]
    return ShardingRule.from_spec(spec, shapes, result_shapes, need, sizes, tuple(summed))
