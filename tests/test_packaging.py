"""The package builds quietly and ships its data (issue 37): ``./scripts/setup.sh`` printed a
40-line setuptools warning because ``shardplan.data.predictor`` held package data but was not a
listed package."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _copy_sources(dest: Path) -> None:
    """What a build reads (pyproject, README, the listed packages' files), so the build's
    ``build/`` and ``*.egg-info`` land in ``dest``, not in the checkout."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    for package in config["packages"]:
        rel = Path(*package.split(".")[1:])
        (dest / rel).mkdir(parents=True, exist_ok=True)
        for path in (ROOT / rel).iterdir():
            if path.is_file() and path.suffix in (".py", ".json"):
                shutil.copy(path, dest / rel / path.name)


@pytest.mark.slow
def test_wheel_builds_without_warnings_and_ships_the_predictor_model(tmp_path: Path) -> None:
    source, dist = tmp_path / "src", tmp_path / "dist"
    source.mkdir()
    _copy_sources(source)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
         "--no-index", "-w", str(dist), "-v"],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "absent from the `packages` configuration" not in output, output[-3000:]
    assert "BuildBackendWarning" not in output, output[-3000:]
    (wheel,) = dist.glob("shardplan-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"shardplan/data/predictor/model.json", "shardplan/record.schema.json"} <= names
    assert "shardplan/solver/predictor.py" in names
    assert not any(n.startswith(("shardplan/tests/", "shardplan/examples/")) for n in names)
