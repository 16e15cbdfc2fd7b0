"""The layering contract (``layer_contract.py``): imports only point down, counting those inside
functions, and the check catches an upward import added where nothing else would."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from layer_contract import LAYERS, PENDING, Import, Report, check, imports, tier_of

ROOT = Path(__file__).resolve().parent.parent
"""The repository root, which is the ``shardplan`` package."""


def _copy_package(tmp_path: Path) -> Path:
    """The package's Python files copied to ``tmp_path/shardplan`` (tests, bench... left out)."""
    copy = tmp_path / "shardplan"
    for source in ROOT.rglob("*.py"):
        rel = source.relative_to(ROOT)
        if rel.parts[0] in {"tests", "bench", "examples", "scripts", "docs", ".venv", "build"}:
            continue
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, copy / rel)
    return copy


@pytest.fixture(scope="module")
def report() -> Report:
    return check(ROOT)


@pytest.fixture(scope="module")
def found() -> list[Import]:
    return imports(ROOT)[1]


def test_layers_every_unit_has_a_tier(report: Report) -> None:
    assert not report.unplaced, f"units with no tier in LAYERS: {report.unplaced} ({LAYERS})"


def test_layers_imports_only_point_down(report: Report) -> None:
    assert not report.upward, "imports of a unit on the same tier or above:\n" + "\n".join(
        map(str, report.upward)
    )


def test_layers_no_circle_between_units(report: Report) -> None:
    assert not report.circles


def test_layers_pending_exceptions_are_still_upward_imports(found: list[Import]) -> None:
    """Each known exception names an upward import that is still there: once its change lands,
    the entry must go (else PENDING would hide the next such import in that file)."""
    tiers = tier_of()
    present = {(imp.path, imp.target) for imp in found}
    for (path, target), change in PENDING.items():
        assert (path, target) in present, (
            f"{path} no longer imports {target}: delete it from PENDING"
        )
        assert tiers[target] >= tiers[path.split("/")[0]], f"{path} -> {target} is not upward"
        assert change


def test_layers_check_reports_an_added_upward_import(tmp_path: Path) -> None:
    copy = _copy_package(tmp_path)
    assert not check(copy).upward  # the copy is the package
    graph = copy / "ir" / "graph.py"
    lines = graph.read_text(encoding="utf-8").splitlines()
    probe = ["", "", "def _probe():", "    from ..api import plan", "", "    return plan", ""]
    graph.write_text("\n".join(lines + probe), encoding="utf-8")
    report = check(copy)
    line = len(lines) + probe.index("    from ..api import plan") + 1
    assert [str(imp) for imp in report.upward] == [
        f"ir/graph.py:{line}: ir -> api (from ..api import plan)"
    ]
    assert any({"ir", "api"} <= set(circle) for circle in report.circles)


def test_layers_check_reports_an_absolute_import_and_a_new_unit(tmp_path: Path) -> None:
    copy = _copy_package(tmp_path)
    (copy / "helpers.py").write_text('"""A new root module."""\n', encoding="utf-8")
    mesh = copy / "costmodel" / "cluster.py"
    text = mesh.read_text(encoding="utf-8")
    mesh.write_text(text + "\nimport shardplan.solver.plan  # noqa\n", encoding="utf-8")
    report = check(copy)
    assert report.unplaced == ["helpers"]
    assert [(imp.path, imp.source, imp.target) for imp in report.upward] == [
        ("costmodel/cluster.py", "costmodel", "solver")
    ]
