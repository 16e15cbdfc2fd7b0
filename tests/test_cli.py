"""The ``shardplan`` command: plan, show, passes; exit codes and messages a shell user expects."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from shardplan.cli import main, parse_mesh, parse_size

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "mlp_graph.py")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("40GB", 40 * 10**9),
        ("24e9", 24 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5TB", 15 * 10**11),
        ("80 GiB", 80 * 2**30),
        ("1024", 1024),
    ],
)
def test_parse_size_reads_units(text, expected):
    assert parse_size(text) == expected


def test_parse_mesh_keeps_axis_order():
    assert list(parse_mesh("tp=4,dp=2").items()) == [("tp", 4), ("dp", 2)]


def test_plan_prints_and_saves(tmp_path, capsys):
    """The README's main job: plan the example, print the tables, save a loadable JSON."""
    out = tmp_path / "plan.json"
    code = main(
        [
            "plan",
            f"{EXAMPLE}:make",
            "--mesh",
            "dp=2,tp=4",
            "--cluster",
            "h100-sxm",
            "--out",
            str(out),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert '<["dp"=2, "tp"=4]> = 8 devices, cluster h100-sxm' in captured.out
    assert "mlp.fc1.weight" in captured.out
    assert json.loads(out.read_text())["format"] == "shardplan-plan"

    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "mlp.fc1.weight" in shown
    assert "solve time not saved" in shown


def test_plan_with_print_ir_shows_the_graph(capsys):
    code = main(["plan", EXAMPLE, "--mesh", "dp=2,tp=4", "--cluster", "h100-sxm", "--print-ir"])
    assert code == 0
    assert "func @mlp_train_step(" in capsys.readouterr().out


def test_bad_mesh_is_a_usage_error(capsys):
    code = main(["plan", EXAMPLE, "--mesh", "dp:2"])
    assert code == 2
    assert "bad mesh 'dp:2'" in capsys.readouterr().err


def test_unknown_cluster_is_a_usage_error(capsys):
    code = main(["plan", EXAMPLE, "--mesh", "dp=2", "--cluster", "no-such-gpu"])
    err = capsys.readouterr().err
    assert code == 2
    assert "unknown cluster 'no-such-gpu'" in err
    assert "h100-sxm" in err


def test_bad_memory_limit_is_a_usage_error(capsys):
    assert main(["plan", EXAMPLE, "--mesh", "dp=2", "--memory-limit", "lots"]) == 2
    assert "bad size 'lots'" in capsys.readouterr().err


def test_missing_file_is_a_clean_error(capsys):
    code = main(["plan", "no/such/model.py", "--mesh", "dp=2"])
    err = capsys.readouterr().err
    assert code == 1
    assert "no such file: no/such/model.py" in err
    assert "Traceback" not in err


def test_missing_factory_names_the_function(capsys):
    assert main(["plan", f"{EXAMPLE}:build", "--mesh", "dp=2"]) == 1
    assert "has no function 'build'" in capsys.readouterr().err


def test_factory_returning_junk_is_a_clean_error(tmp_path, capsys):
    model = tmp_path / "junk.py"
    model.write_text("def make():\n    return 42\n")
    assert main(["plan", str(model), "--mesh", "dp=2"]) == 1
    assert "returned a int" in capsys.readouterr().err


def test_show_rejects_a_file_that_is_not_a_plan(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "other"}')
    assert main(["show", str(bad)]) == 1
    assert "not a shardplan plan" in capsys.readouterr().err
    assert main(["show", str(tmp_path / "missing.json")]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_debug_shows_the_traceback(capsys):
    assert main(["--debug", "plan", "no/such/model.py", "--mesh", "dp=2"]) == 1
    assert "Traceback" in capsys.readouterr().err


def test_passes_lists_registered_passes(capsys):
    assert main(["passes"]) == 0
    assert "propagate" in capsys.readouterr().out


def test_console_script_runs_as_a_process():
    """The installed entry point: usage errors exit 2 with argparse's message."""
    script = Path(sys.executable).parent / "shardplan"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "shardplan.cli"]
    result = subprocess.run(
        [*command, "plan", EXAMPLE, "--mesh", "dp=two"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert "usage: shardplan plan" in result.stderr


def test_plan_prints_the_summary_and_full_every_table(capsys):
    """The default is one screen; --full adds the inputs, ops, reshards and layout pictures."""
    args = ["plan", EXAMPLE, "--mesh", "dp=2,tp=4", "--cluster", "h100-sxm"]
    assert main(args) == 0
    summary = capsys.readouterr().out
    assert len(summary.splitlines()) <= 40
    assert "strategy" in summary
    assert "Parameter layouts" not in summary
    assert main([*args, "--full"]) == 0
    full = capsys.readouterr().out
    assert "Parameter layouts" in full
    assert "Inputs" in full
