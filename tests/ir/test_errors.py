"""The error hierarchy: one module defines every class, no bare error reaches a user, and real
mistakes raise their own class with a message that names the fix."""

from __future__ import annotations

import ast
import functools
import json
from pathlib import Path

import pytest
import shardplan as sp
from shardplan.costmodel.cluster import get_cluster
from shardplan.costmodel.embedding import TableSpec
from shardplan.costmodel.pipeline import bubble_fraction, schedule_pipeline
from shardplan.ir import GraphBuilder, Mesh
from shardplan.ir import errors as E
from shardplan.passes.propagate import PropagateOptions
from shardplan.solver.pipeline import plan_pipeline
from shardplan.solver.serialize import PLAN_FORMAT, PLAN_FORMAT_VERSION

ROOT = Path(sp.__file__).resolve().parent
NOT_PACKAGE = {"tests", "bench", "examples", "scripts", "docs", "data"}
BARE = {"ValueError", "ShardplanError"}
PENDING: set[str] = set()
"""Modules allowed to raise bare errors for now: none."""


def _package_files() -> list[Path]:
    files = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        if parts[0] in NOT_PACKAGE or any(p.startswith(".") for p in parts):
            continue
        files.append(path)
    return files


@functools.cache
def _trees() -> list[tuple[str, ast.Module]]:
    return [(p.relative_to(ROOT).as_posix(), ast.parse(p.read_text())) for p in _package_files()]


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


def _bare_errors(tree: ast.Module) -> list[int]:
    """Lines that build a ValueError or a plain ShardplanError (``raise X`` or ``X(...)``)."""
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _name(n.func) in BARE]
    raises = [n for n in ast.walk(tree) if isinstance(n, ast.Raise) and n.exc is not None]
    return sorted({n.lineno for n in calls} | {n.lineno for n in raises if _name(n.exc) in BARE})


def _error_names() -> set[str]:
    """Names of the ShardplanError classes of ir/errors.py."""
    return {
        name
        for name, obj in vars(E).items()
        if isinstance(obj, type) and issubclass(obj, E.ShardplanError)
    }


def test_errors_no_bare_value_error_or_shardplan_error_in_the_package() -> None:
    trees = _trees()
    assert len(trees) > 100  # the scan sees the package, not an empty folder
    found = [f"{path}:{line}" for path, tree in trees for line in _bare_errors(tree)]
    found = [f for f in found if f.split(":")[0] not in PENDING]
    assert not found, "give these a class of ir/errors.py that says the kind:\n" + "\n".join(found)


def test_errors_scan_sees_a_bare_raise() -> None:
    tree = ast.parse(
        "def f(x):\n    if x:\n        raise ValueError('x')\n    raise ShardplanError\n"
    )
    assert _bare_errors(tree) == [3, 4]


def _foreign_classes(tree: ast.Module, names: set[str]) -> list[str]:
    """Classes of ``tree`` with a ShardplanError class among their bases."""
    return [
        f"{node.lineno} class {node.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and any(_name(b) in names for b in node.bases)
    ]


def test_errors_every_shardplan_error_class_is_defined_in_ir_errors() -> None:
    names = _error_names()
    sample = ast.parse("class BadMesh(errors.ShardingError, ValueError):\n    pass\n")
    assert _foreign_classes(sample, names) == ["1 class BadMesh"]  # the scan would see one
    elsewhere = [
        f"{path}:{found}"
        for path, tree in _trees()
        if path != "ir/errors.py"
        for found in _foreign_classes(tree, names)
    ]
    assert not elsewhere, "define these in ir/errors.py and import them:\n" + "\n".join(elsewhere)


def test_errors_classes_live_in_one_module_and_keep_their_builtin_bases() -> None:
    import shardplan.api.records
    import shardplan.cli
    import shardplan.solver.explain
    import shardplan.solver.predictor
    import shardplan.solver.titan_config

    def walk(cls: type) -> list[type]:
        return [cls, *(c for sub in cls.__subclasses__() for c in walk(sub))]

    classes = set(walk(E.ShardplanError))  # a set: UnknownClusterError has two error bases
    assert {c.__module__ for c in classes} == {"shardplan.ir.errors"}
    assert {c.__name__ for c in classes} == _error_names()
    assert len(classes) >= 25
    assert all(c.__doc__ for c in classes), "each class has a one-line docstring"
    # callers catch these as builtins (``except ValueError``, ``except KeyError``)
    value_errors = (E.ArgumentError, E.StrategyError, E.PipelineError, E.TitanConfigError,
                    E.ContextParallelError)  # fmt: skip
    assert all(issubclass(c, ValueError) for c in value_errors)
    assert all(issubclass(c, KeyError) for c in (E.UnknownClusterError, E.UnknownTensorError))
    assert shardplan.cli.CliError is E.CliError
    assert shardplan.solver.explain.UnknownTensorError is E.UnknownTensorError


def test_errors_unknown_cluster_names_the_known_ones() -> None:
    with pytest.raises(
        E.UnknownClusterError, match=r"known clusters: .*h100-sxm.*register_cluster"
    ):
        get_cluster("h100-sxn")
    with pytest.raises(E.ConfigError):
        get_cluster("h100-sxn")
    with pytest.raises(KeyError) as caught:  # a KeyError that does not repr() its message
        get_cluster("h100-sxn")
    assert str(caught.value).startswith("unknown cluster 'h100-sxn'")


def test_errors_bad_table_spec() -> None:
    with pytest.raises(E.TableSpecError, match=r"table 'users': rows=0 dim=16; both must be >= 1"):
        TableSpec("users", rows=0, dim=16)
    with pytest.raises(E.TableSpecError, match=r"dtype 'f12' unknown; one of \["):
        TableSpec("users", rows=10, dim=16, dtype="f12")


def test_errors_bad_pipeline_schedule() -> None:
    with pytest.raises(E.PipelineError, match=r"unknown pipeline schedule 'zigzag'; one of"):
        schedule_pipeline([1.0, 1.0], [2.0, 2.0], microbatches=4, schedule="zigzag")
    with pytest.raises(E.PipelineError, match=r"pick m = k \* 2"):
        bubble_fraction("interleaved", stages=2, microbatches=3, chunks=2)
    graph = _tiny_graph()
    mesh = Mesh({"pp": 2, "dp": 2}, cluster="cpu-test")
    with pytest.raises(E.PipelineError, match=r"unknown pipeline schedule 'zigzag': one of .*1f1b"):
        plan_pipeline(graph, mesh, schedule="zigzag")
    with pytest.raises(E.PipelineError, match=r"chunks=3 needs schedule='interleaved'"):
        plan_pipeline(graph, mesh, schedule="1f1b", chunks=3)


def test_errors_bad_plan_file(tmp_path: Path) -> None:
    cases = {
        "other.json": ({"format": "x"}, r"not a shardplan plan.*written by Plan.save"),
        "newer.json": (
            {"format": PLAN_FORMAT, "version": PLAN_FORMAT_VERSION + 1},
            r"newer than this shardplan reads.*upgrade shardplan",
        ),
        "damaged.json": (
            {"format": PLAN_FORMAT, "version": PLAN_FORMAT_VERSION, "mesh": 3},
            r"invalid plan file: <plan>.mesh: expected an object.*re-create it",
        ),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_text(json.dumps(data))
        with pytest.raises(E.PlanFileError, match=message):
            sp.load_plan(tmp_path / name)


def test_errors_bad_pass_option() -> None:
    with pytest.raises(E.PassError, match="max_iterations must be >= 1, got 0"):
        PropagateOptions(max_iterations=0)


def _tiny_graph():  # type: ignore[no-untyped-def]
    b = GraphBuilder("tiny")
    b.output(b.dot(b.input("x", (8, 16)), b.param("w", (16, 16))))
    return b.build()
