"""Planning progress: one line per phase with the seconds since the call began (``progress.py``),
on stderr with ``verbose=True`` and in the CLI (also when stderr is not a terminal), and always
through the ``logging`` logger ``"shardplan"``."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import shardplan as sp
from shardplan.costmodel import get_cluster
from shardplan.solver.costs import build_problem, build_space
from shardplan.solver.ilp import solve

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "mlp_graph.py")
LINE = re.compile(r"^\[ *(\d+\.\d) s\] ([a-z]+): (.*)$")


def _graph():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from mlp_graph import make
    finally:
        sys.path.remove(str(ROOT / "examples"))
    return make()


def _phases(text: str) -> list[tuple[float, str, str]]:
    rows = [LINE.match(line) for line in text.strip().splitlines()]
    assert all(rows), text
    return [(float(m[1]), m[2], m[3]) for m in rows if m]


def test_plan_verbose_prints_each_phase_with_elapsed_time(capsys):
    mesh = sp.Mesh({"dp": 2, "tp": 4}, cluster="h100-sxm")
    plan = sp.plan(_graph(), mesh=mesh, verbose=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    rows = _phases(captured.err)
    names = [name for _, name, _ in rows]
    for phase in ("capture", "enumerate", "price", "solve", "simulate", "done"):
        assert phase in names, names
    assert names[-1] == "done"
    times = [t for t, _, _ in rows]
    assert times == sorted(times)  # seconds since the call began
    capture = next(text for _, name, text in rows if name == "capture")
    assert f"-> {len(plan.graph.ops)} ops, {len(plan.graph.inputs)} inputs" in capture
    solves = [text for _, name, text in rows if name == "solve"]
    assert all(re.search(r"(OPTIMAL|FEASIBLE), objective .* bound .* gap", s) for s in solves)
    done = next(text for _, name, text in rows if name == "done")
    assert f"{plan.step_time * 1e3:.1f} ms" in done


def test_plan_is_silent_by_default_but_logs(capsys, caplog):
    mesh = sp.Mesh({"dp": 2}, cluster="h100-sxm")
    with caplog.at_level(logging.INFO, logger="shardplan"):
        sp.plan(_graph(), mesh=mesh)
    assert capsys.readouterr().err == ""
    phases = {getattr(r, "phase", None) for r in caplog.records}
    assert {"capture", "enumerate", "solve", "done"} <= phases
    assert all(r.name == "shardplan" for r in caplog.records)


def test_verbose_must_be_a_bool():
    with pytest.raises(sp.ArgumentError, match="verbose='yes' must be True or False"):
        sp.plan(_graph(), mesh=sp.Mesh({"dp": 2}, cluster="h100-sxm"), verbose="yes")


def test_cpsat_reports_incumbents_with_bound_and_gap(caplog):
    graph = _graph()
    mesh = sp.Mesh({"dp": 2, "tp": 4}, cluster="h100-sxm")
    graph.mesh = mesh
    cluster = get_cluster("h100-sxm")
    problem = build_problem(build_space(graph, mesh), cluster, cluster.hbm_capacity)
    with caplog.at_level(logging.INFO, logger="shardplan"):
        solution = solve(problem, time_limit=10, use_lp=False)
    lines = [r.getMessage() for r in caplog.records if getattr(r, "phase", "") == "solve"]
    assert lines, "CP-SAT found a solution but reported none"
    match = re.search(r"incumbent ([\d.]+) ms, bound ([\d.]+) ms, gap ([\d.]+)%", lines[-1])
    assert match, lines
    assert float(match[2]) <= float(match[1]) + 1e-9
    assert float(match[1]) >= solution.objective * 1e3 - 0.05  # improves towards the optimum


def test_cli_prints_progress_when_stderr_is_not_a_terminal(tmp_path):
    shardplan = ROOT / ".venv" / "bin" / "shardplan"
    command = [str(shardplan)] if shardplan.exists() else [sys.executable, "-m", "shardplan.cli"]
    args = ["plan", f"{EXAMPLE}:make", "--mesh", "dp=2,tp=4"]
    run = subprocess.run(command + args, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    names = [name for _, name, _ in _phases(run.stderr)]
    assert names[0] == "load"
    assert names[-1] == "done"
    assert {"capture", "enumerate", "price", "solve", "simulate"} <= set(names)
    quiet = subprocess.run(
        [*command, *args, "--quiet"], capture_output=True, text=True, timeout=300
    )
    assert quiet.returncode == 0
    assert quiet.stderr == ""
    assert quiet.stdout.splitlines()[:3] == run.stdout.splitlines()[:3]  # the same plan
