"""Pass registry and pass manager: named ``Graph -> Graph`` functions run from pipeline strings.

A pipeline is xDSL/MLIR-style text, ``"annotate,propagate{max_iterations=10 direction=forward}"``:
passes separated by commas, options in braces separated by spaces or commas.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TextIO, TypeVar

from shardplan.ir.errors import IRVerifyError, PassError
from shardplan.ir.graph import Graph

PassFn = Callable[[Graph, Any], "Graph | None"]
"""A pass: takes the graph and its options; returns the new graph (or None if edited in place)."""

F = TypeVar("F", bound=Callable[..., Any])

_NAME = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")


@dataclass(frozen=True, slots=True)
class NoOptions:
    """Options of a pass that takes none."""


@dataclass(frozen=True, slots=True)
class PassInfo:
    """A registered pass: kebab-case name, function, options class and one-line summary."""

    name: str
    fn: PassFn
    options: type
    summary: str


@dataclass(frozen=True, slots=True)
class PassSpec:
    """One pipeline entry: a pass name and its (already parsed) options."""

    name: str
    options: Any

    def __str__(self) -> str:
        fields = [
            f"{f.name}={_option_text(getattr(self.options, f.name))}"
            for f in dataclasses.fields(self.options)
            if getattr(self.options, f.name) != _default(f)
        ]
        return self.name + ("{" + " ".join(fields) + "}" if fields else "")


_PASSES: dict[str, PassInfo] = {}


def register_pass(name: str, options: type = NoOptions) -> Callable[[F], F]:
    """Register ``fn(graph, options) -> Graph`` under a kebab-case name.

    Args:
        name: registry and CLI name, e.g. ``"propagate"`` or ``"enumerate-strategies"``.
        options: a frozen dataclass whose fields are the pass options (all with defaults).
    """
    if not _NAME.match(name):
        raise PassError(f"pass name {name!r} must be kebab-case, like 'enumerate-strategies'")
    if not dataclasses.is_dataclass(options):
        raise PassError(f"options of pass {name!r} must be a frozen dataclass, got {options!r}")

    def decorate(fn: F) -> F:
        summary = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        _PASSES[name] = PassInfo(name, fn, options, summary)
        return fn

    return decorate


def list_passes() -> list[str]:
    """Names of all registered passes, sorted."""
    return sorted(_PASSES)


def get_pass(name: str) -> PassInfo:
    """The registered pass ``name`` (snake_case accepted); unknown names list the known ones."""
    info = _PASSES.get(name) or _PASSES.get(name.replace("_", "-"))
    if info is None:
        raise PassError(
            f"unknown pass {name!r}; known passes: {', '.join(list_passes()) or '(none)'}"
        )
    return info


# -- pipeline text --------------------------------------------------------------------------


def pipeline_entries(text: str, error: type[Exception] = PassError) -> list[tuple[str, str | None]]:
    """``"annotate,propagate{max_iterations=10}"`` -> ``[("annotate", None), ("propagate",
    "max_iterations=10")]``: each entry's name and the text inside its braces (None without
    braces); an entry missing its closing brace raises ``error``."""
    entries = []
    for entry in _split_top_level(text, ",", where=text):
        entry = entry.strip()
        if not entry:
            continue
        name, _, rest = entry.partition("{")
        if rest and not rest.rstrip().endswith("}"):
            raise error(f"pipeline entry {entry!r}: missing closing '}}'")
        entries.append((name.strip(), rest.rstrip()[:-1] if rest else None))
    return entries


def parse_pipeline(text: str) -> list[PassSpec]:
    """Parse ``"annotate,propagate{max_iterations=10}"`` into pass specs with typed options."""
    specs = []
    for name, options in pipeline_entries(text):
        info = get_pass(name)
        specs.append(PassSpec(info.name, parse_options(info, options or "")))
    return specs


def parse_options(info: PassInfo, text: str) -> Any:
    """Parse ``"max_iterations=10 direction=forward"`` into the pass's options dataclass."""
    fields = {f.name: f for f in dataclasses.fields(info.options)}
    hints = typing.get_type_hints(info.options)
    values: dict[str, object] = {}
    for item in _split_top_level(text, ", ", where=text):
        if not item:
            continue
        key, eq, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in fields:
            known = ", ".join(fields) or "(none)"
            raise PassError(f"pass {info.name!r}: bad option {item!r}; its options are: {known}")
        values[key] = _convert(info.name, key, raw.strip(), hints[key])
    try:
        return info.options(**values)
    except (TypeError, ValueError) as err:
        raise PassError(f"pass {info.name!r}: invalid options {values}: {err}") from err


def _split_top_level(text: str, separators: str, where: str) -> list[str]:
    """Split at any of ``separators`` outside braces and double quotes."""
    parts, depth, quoted, start = [], 0, False, 0
    for i, ch in enumerate(text):
        if ch == '"':
            quoted = not quoted
        elif not quoted and ch in "{}":
            depth += 1 if ch == "{" else -1
            if depth < 0:
                raise PassError(f"pipeline {where!r}: unbalanced '}}'")
        elif not quoted and depth == 0 and ch in separators:
            parts.append(text[start:i])
            start = i + 1
    if depth or quoted:
        raise PassError(f"pipeline {where!r}: unbalanced braces or quotes")
    parts.append(text[start:])
    return parts


def _convert(pass_name: str, key: str, raw: str, hint: object) -> object:
    """Convert an option's text to the field's type (bool, int, float, str, Literal, Optional)."""
    text = raw[1:-1] if len(raw) >= 2 and raw[0] == raw[-1] == '"' else raw
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        if text in ("none", "None"):
            return None
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    bad = PassError(f"pass {pass_name!r}: option {key}={raw!r} is not a valid {hint}")
    if origin is Literal:
        if text not in args:
            raise PassError(f"pass {pass_name!r}: option {key}={raw!r}; choose one of {args}")
        return text
    if hint is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise bad
        return text.lower() in ("true", "1")
    if hint in (int, float, str):
        try:
            return hint(text)  # type: ignore[operator]
        except ValueError:
            raise bad from None
    raise PassError(
        f"pass {pass_name!r}: option {key!r} of type {hint} cannot be written in a pipeline "
        "string; build the options in Python and pass PassSpec(name, options)"
    )


def _default(field: dataclasses.Field) -> object:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _option_text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


# -- running ----------------------------------------------------------------------------------

PipelineEntry = str | PassSpec | tuple[str, Any]


class PassManager:
    """Runs a pipeline of registered passes, optionally verifying and printing between them.

    Example::

        pm = PassManager("annotate,propagate{max_iterations=10}", verify_each=True,
                         print_after={"propagate"}, dump=sys.stdout)
        graph = pm.run(graph)
    """

    def __init__(
        self,
        pipeline: str | Sequence[PipelineEntry],
        verify_each: bool = False,
        print_after: Iterable[str] | Literal["all"] = (),
        dump: TextIO | Callable[[str], object] | None = None,
    ) -> None:
        self.passes: list[PassSpec] = _normalize(pipeline)
        self.verify_each = verify_each
        if print_after == "all":
            self.print_after: frozenset[str] | Literal["all"] = "all"
        else:
            self.print_after = frozenset(get_pass(n).name for n in print_after)
        self._dump = dump

    @property
    def pipeline(self) -> str:
        """The pipeline as text (options that differ from their defaults only)."""
        return ",".join(str(spec) for spec in self.passes)

    def run(self, graph: Graph) -> Graph:
        """Run every pass in order; with ``verify_each`` the graph is verified before and after."""
        if self.verify_each:
            _verify(graph, "before the pipeline")
        for spec in self.passes:
            result = get_pass(spec.name).fn(graph, spec.options)
            graph = graph if result is None else result
            if self.verify_each:
                _verify(graph, f"after pass {spec.name!r}")
            if self.print_after == "all" or spec.name in self.print_after:
                self._emit(f"// -----// IR after {spec} //----- //\n{_print(graph)}\n")
        return graph

    def _emit(self, text: str) -> None:
        dump = self._dump if self._dump is not None else sys.stderr
        if callable(dump):
            dump(text)
        else:
            dump.write(text)


def run_pipeline(graph: Graph, pipeline: str | Sequence[PipelineEntry], **kwargs: Any) -> Graph:
    """Shorthand for ``PassManager(pipeline, **kwargs).run(graph)``."""
    return PassManager(pipeline, **kwargs).run(graph)


def _normalize(pipeline: str | Sequence[PipelineEntry]) -> list[PassSpec]:
    if isinstance(pipeline, str):
        return parse_pipeline(pipeline)
    specs: list[PassSpec] = []
    for entry in pipeline:
        if isinstance(entry, PassSpec):
            specs.append(PassSpec(get_pass(entry.name).name, entry.options))
        elif isinstance(entry, tuple):
            info = get_pass(entry[0])
            if not isinstance(entry[1], info.options):
                got = type(entry[1]).__name__
                raise PassError(f"pass {info.name!r} takes {info.options.__name__}, got {got}")
            specs.append(PassSpec(info.name, entry[1]))
        else:
            specs.extend(parse_pipeline(entry))
    return specs


def _verify(graph: Graph, when: str) -> None:
    from shardplan.ir.verify import verify  # the verifier is optional at import time of the manager

    try:
        verify(graph)
    except IRVerifyError as err:
        raise IRVerifyError(f"{when}: {err}") from err


def _print(graph: Graph) -> str:
    from shardplan.ir.printer import print_graph

    return print_graph(graph)
