"""Benchmark records: bench/scale.py --record writes records that validate, and
``shardplan bench compare`` shows their result and environment differences."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from shardplan.api.records import SCHEMA_VERSION, load_record, load_schema, validate_record
from shardplan.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def two_records(tmp_path_factory) -> tuple[Path, Path]:
    """Two runs of ``bench/scale.py --quick --record``, cut to one IR row to stay fast."""
    out = tmp_path_factory.mktemp("records")
    paths = []
    for name in ("a.json", "b.json"):
        command = [
            sys.executable, "bench/scale.py", "--quick", "--sources", "ir", "--layers", "1",
            "--meshes", "dp=2", "--out", str(out), "--record", str(out / name),
        ]  # fmt: skip
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        paths.append(out / name)
    return paths[0], paths[1]


def test_scale_records_validate_against_the_schema(two_records):
    schema = load_schema()
    for path in two_records:
        record = json.loads(path.read_text())
        assert validate_record(record, schema) == []
        assert record["schema_version"] == SCHEMA_VERSION
        assert record["benchmark"] == "scale"
        assert record["command"][1:3] == ["bench/scale.py", "--quick"]
        assert record["machine"]["cores"] >= 1
        assert record["machine"]["memory_bytes"] > 0
        assert record["packages"]["shardplan"]
        assert record["packages"]["ortools"]
        assert record["inputs"]["layers"] == [1]
        assert record["inputs"]["meshes"] == ["dp=2"]
        assert record["inputs"]["model"]["dim"] == 4096
        (row,) = record["results"]
        assert row["source"] == "ir"
        assert row["layers"] == 1
        assert row["step_ms"] > 0
        assert record["wall_times"]["total"] >= record["wall_times"]["ir L=1 dp=2"] > 0


def test_validator_rejects_what_the_schema_forbids(two_records):
    record = json.loads(two_records[0].read_text())
    for change, message in (
        (lambda r: r.pop("machine"), "missing required field 'machine'"),
        (lambda r: r.update(schema_version=2), "must be 1"),
        (lambda r: r["machine"].update(cores=0), "below the minimum"),
        (lambda r: r["git"].update(commit="abc"), "does not match"),
        (lambda r: r.update(extra=1), "unknown field 'extra'"),
        (lambda r: r["wall_times"].update(total="slow"), "expected"),
        (lambda r: r["machine"].update(cores=True), "expected"),
    ):
        broken = json.loads(json.dumps(record))
        change(broken)
        errors = validate_record(broken)
        assert errors, message
        assert message in errors[0], errors


def test_bench_compare_shows_results_and_env_differences(two_records, tmp_path, capsys):
    a, b = two_records
    # the second run as if on another machine with another ortools
    record = load_record(b)
    record["machine"]["cpu"] = "Other CPU 9000"
    record["packages"]["ortools"] = "0.0.1"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(record))
    assert main(["bench", "compare", str(a), str(other)]) == 0
    text = capsys.readouterr().out
    env, results = text.split("== inputs")
    assert "machine.cpu" in env
    assert "Other CPU 9000" in env
    assert "packages.ortools" in env
    assert "0.0.1" in env
    assert "command" in env  # the two runs wrote different record paths
    assert "packages.shardplan" not in env  # unchanged fields stay out of the env section
    # results side by side: the row's step (same plan) and its wall times (which differ)
    step = next(line for line in results.splitlines() if line.startswith("results[0].step_ms"))
    assert step.split()[1] == step.split()[2]
    assert "results[0].total" in results
    assert "wall_times.total" in results
    totals = (json.loads(a.read_text())["results"][0]["total"], record["results"][0]["total"])
    line = next(x for x in results.splitlines() if x.startswith("results[0].total "))
    assert line.split()[1:3] == [f"{t:.6g}" for t in totals]
    if totals[0] != totals[1]:
        assert line.split()[3].endswith("%")


def test_bench_compare_refuses_a_non_record(tmp_path, capsys):
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps({"schema_version": 1}))
    assert main(["bench", "compare", str(bad), str(bad)]) == 1
    assert "is not a benchmark record" in capsys.readouterr().err
