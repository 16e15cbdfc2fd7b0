"""The package's layering contract, checked on its source (``tests/test_layers.py``).

Units are the package's top-level subpackages (``ir``, ``solver``, ...) and root modules
(``cli``); the root ``__init__.py`` is the public facade (``import shardplan as sp``), which sits
above every layer. Every import of the package's own modules counts: top level, inside
functions and under ``TYPE_CHECKING``, relative and absolute. The contract holds when

(a) every unit has a tier in ``LAYERS``;
(b) a unit imports only units of lower tiers (units of one tier do not import each other);
(c) no chain of imports between units comes back to where it started (no circle).

Pure ``ast``: the package is read, never imported.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

LAYERS = ["ir", "passes|costmodel", "solver", "frontend", "api", "cli_inputs", "cli", "__init__"]
"""Tiers from the bottom up; ``|`` joins the units of one tier. ``passes`` (graph analyses and
rewrites) and ``costmodel`` (pricing) are peers on the IR: today neither imports the other."""

PENDING: dict[tuple[str, str], str] = {}
"""Known upward imports, by (file, unit imported), each with the change that removes it."""

OUTSIDE = {"tests", "bench", "examples", "scripts", "docs", "data", "build", "venv", "__pycache__"}
"""Folders of the repository that are not part of the package."""


@dataclass(frozen=True)
class Import:
    """One import of a unit by another: where it is written and what it reaches."""

    path: str
    """The importing file, relative to the package root (``ir/mesh.py``)."""
    line: int
    source: str
    """The importing unit."""
    target: str
    """The imported unit."""
    text: str
    """The import statement as written (``from ..api import plan``)."""

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.source} -> {self.target} ({self.text})"


@dataclass(frozen=True)
class Report:
    """What breaks the contract; empty lists when it holds."""

    unplaced: list[str]
    """Units with no tier in ``LAYERS``."""
    upward: list[Import]
    """Imports of a unit on the same tier or above (``PENDING`` ones left out)."""
    circles: list[list[str]]
    """Sets of units that reach each other through imports, each sorted."""


def tier_of() -> dict[str, int]:
    """Unit name -> its tier's index in ``LAYERS``."""
    return {unit: index for index, tier in enumerate(LAYERS) for unit in tier.split("|")}


def package_files(root: Path) -> list[Path]:
    """The package's Python files (the repository root is the package, ``shardplan``)."""
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if not any(part in OUTSIDE or part.startswith(".") for part in parts[:-1]):
            files.append(path)
    return files


def unit_of(rel: tuple[str, ...]) -> str:
    """``("solver", "ilp.py")`` -> ``solver``; ``("cli.py",)`` -> ``cli``."""
    return rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")


def _targets(node: ast.Import | ast.ImportFrom, rel: tuple[str, ...]) -> list[list[str]]:
    """Dotted module paths under the package (``[]`` for the root) that ``node`` imports."""
    if isinstance(node, ast.Import):
        return [a.name.split(".")[1:] for a in node.names if a.name.split(".")[0] == "shardplan"]
    if node.level:
        package = list(rel[:-1])  # a module's package; an __init__.py's is its own folder
        base = package[: len(package) - (node.level - 1)]
    elif node.module and node.module.split(".")[0] == "shardplan":
        base = []
    else:
        return []
    module = node.module.split(".") if node.module else []
    if node.level == 0:
        module = module[1:]
    if module:
        return [base + module]
    return [[*base, alias.name] for alias in node.names]  # from . import x: x may be a module


def _unit(target: list[str], units: set[str]) -> str:
    """The unit a dotted path reaches: names imported from the root come from the facade."""
    return target[0] if target and target[0] in units else "__init__"


def imports(root: Path) -> tuple[set[str], list[Import]]:
    """The package's units and every import of one unit by another."""
    files = package_files(root)
    rels = [path.relative_to(root).parts for path in files]
    units = {unit_of(rel) for rel in rels}
    found = []
    for path, rel in zip(files, rels, strict=True):
        source = unit_of(rel)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in _targets(node, rel):
                unit = _unit(target, units)
                if unit != source:
                    text = ast.unparse(node)
                    found.append(Import("/".join(rel), node.lineno, source, unit, text))
    return units, found


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one unit (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(unit: str) -> None:
        index[unit] = low[unit] = len(index)
        stack.append(unit)
        for other in sorted(edges.get(unit, ())):
            if other not in index:
                visit(other)
                low[unit] = min(low[unit], low[other])
            elif other in stack:
                low[unit] = min(low[unit], index[other])
        if low[unit] == index[unit]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == unit:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for unit in sorted(edges):
        if unit not in index:
            visit(unit)
    return out


def check(root: Path) -> Report:
    """The contract checked on the package at ``root``."""
    tiers = tier_of()
    units, found = imports(root)
    unplaced = sorted(units - tiers.keys())
    upward = [
        imp
        for imp in found
        if imp.source in tiers
        and imp.target in tiers
        and tiers[imp.target] >= tiers[imp.source]
        and (imp.path, imp.target) not in PENDING
    ]
    edges: dict[str, set[str]] = defaultdict(set)
    for imp in found:
        if (imp.path, imp.target) not in PENDING:
            edges[imp.source].add(imp.target)
    return Report(unplaced, upward, circles(edges))
