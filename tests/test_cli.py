"""The ``shardplan`` command: plan, show, passes; exit codes and messages a shell user expects."""

from __future__ import annotations

import json
import re
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


def test_plan_with_print_ir_shows_each_shardings_origin(capsys):
    """--pin pins the plan; --print-ir prints the pins propagated, each with its origin."""
    argv = ["plan", EXAMPLE, "--mesh", "dp=2,tp=4", "--cluster", "h100-sxm", "--print-ir"]
    code = main([*argv, "--pin", "w1=_,tp:p0", "--time-limit", "10"])
    assert code == 0
    out = capsys.readouterr().out
    assert "func @mlp_train_step(" in out
    assert "# %w1: --pin w1=_,tp:p0" in out
    assert '%w1: bf16[4096,16384] [{}, {"tp"}] {role = "param", pinned = true, priority = 0' in out
    assert '%h = dot(%x, %w1) rule<"ik,kj->ij"> ' in out
    assert "# %h: propagated from %w1 through dot (%h)" in out
    assert "# %w2: propagated from %a through dot (%out)" in out  # backward, before `func`
    assert "mlp.fc1.weight  bf16[4096,16384]  [{}, {tp}]" in out  # the plan keeps the pin


def test_bad_pin_is_a_usage_error(capsys):
    for bad in ("w1", "w1=_,tp:1", "=tp"):
        assert main(["plan", EXAMPLE, "--mesh", "dp=2", "--pin", bad]) == 2
        assert "write KEY=DIMS[:pN]" in capsys.readouterr().err


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


# -- hygiene (issue 16): errors as one line, --out checked first and written atomically, signals
def _shardplan() -> list[str]:
    script = Path(sys.executable).parent / "shardplan"
    return [str(script)] if script.exists() else [sys.executable, "-m", "shardplan.cli"]


PROGRESS_LINE = re.compile(r"^\[ *\d+\.\d s\] [a-z]+: ")
"""A planning-progress line (``progress.py``): printed before an error, not part of it."""


def _stderr_lines(capsys) -> list[str]:
    """stderr without the progress lines: what an error printed."""
    lines = capsys.readouterr().err.strip().splitlines()
    return [line for line in lines if not PROGRESS_LINE.match(line)]


@pytest.mark.parametrize(
    ("out", "words"),
    [("missing/plan.json", "no directory"), (".", "is a directory")],
)
def test_out_is_checked_before_the_model_is_even_loaded(tmp_path, capsys, out, words):
    marker = tmp_path / "loaded"
    model = tmp_path / "model.py"
    model.write_text(f"def make():\n    open({str(marker)!r}, 'w').close()\n")
    code = main(["plan", str(model), "--mesh", "dp=2", "--out", str(tmp_path / out)])
    lines = _stderr_lines(capsys)
    assert code == 1
    assert len(lines) == 1
    assert words in lines[0]
    assert not marker.exists()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_out_in_a_read_only_place_is_refused(capsys):
    """/proc refuses new files even to root (a chmod'ed directory would not stop root)."""
    assert main(["plan", EXAMPLE, "--mesh", "dp=2", "--out", "/proc/plan.json"]) == 1
    assert "cannot write /proc/plan.json" in capsys.readouterr().err


def test_a_failed_write_keeps_the_previous_plan(tmp_path, capsys, monkeypatch):
    """A full disk at the write (simulated at fsync) leaves the old file whole, and no temp."""
    import errno
    import os

    out = tmp_path / "plan.json"
    out.write_text("previous good plan")

    def full_disk(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full_disk)
    args = ["plan", EXAMPLE, "--mesh", "dp=2", "--time-limit", "5", "--out", str(out)]
    assert main(args) == 1
    assert "No space left on device" in capsys.readouterr().err
    assert out.read_text() == "previous good plan"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("raise RuntimeError('no GPU here')\n", "importing"),
        ("def make():\n    return {}['missing key']\n", ":make() failed: KeyError"),
        ("def make():\n    raise ValueError('bad config\\nsecond line')\n", "ValueError: bad"),
    ],
)
def test_an_exception_in_the_users_file_is_one_line(tmp_path, capsys, source, words):
    model = tmp_path / "model.py"
    model.write_text(source)
    assert main(["plan", str(model), "--mesh", "dp=2"]) == 1
    lines = _stderr_lines(capsys)
    assert len(lines) == 1, lines
    assert words in lines[0]
    assert "--debug" in lines[0]
    assert main(["plan", str(model), "--mesh", "dp=2", "--debug"]) == 1  # --debug at the end
    err = capsys.readouterr().err
    assert "Traceback" in err
    assert words in err


@pytest.mark.jax
def test_a_jax_if_on_a_traced_value_is_one_line(tmp_path, capsys):
    pytest.importorskip("jax")
    model = tmp_path / "branchy.py"
    model.write_text(
        "import jax\n\n"
        "def step(x):\n    if x.sum() > 0:\n        return x * 2\n    return x\n\n"
        "def make():\n    return step, (jax.ShapeDtypeStruct((8, 4), 'float32'),)\n"
    )
    assert main(["plan", str(model), "--mesh", "dp=2"]) == 1
    lines = _stderr_lines(capsys)
    assert len(lines) == 1, lines
    assert "branches in Python on a traced JAX value" in lines[0]
    assert "jax.lax.cond" in lines[0]


def test_show_on_a_binary_file_is_one_line(tmp_path, capsys):
    binary = tmp_path / "plan.json"
    binary.write_bytes(bytes(range(256)))
    assert main(["show", str(binary)]) == 1
    lines = _stderr_lines(capsys)
    assert lines == [f"shardplan: error: {binary} is not a plan file (binary, not JSON text)"]


def test_repeated_mesh_is_a_usage_error(capsys):
    assert main(["plan", EXAMPLE, "--mesh", "dp=2", "--mesh", "tp=4"]) == 2
    assert "--mesh: given twice" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["plan", "show", "passes", "calibrate", "whatif"])
def test_every_subcommand_help_lists_the_clusters_and_default(capsys, command):
    assert main([command, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal width
    listed = out.split("clusters: ")[1].split(" (default")[0].split(", ")
    assert {"a100-80gb", "b200", "cpu-test", "h100-sxm", "h200-sxm", "tpu-v5p"} <= set(listed)
    assert "(default h100-sxm)" in out


def test_ctrl_c_prints_interrupted_and_exits_130(tmp_path):
    """SIGINT while the user's factory runs: one line, exit 130 (the factory says when it is
    inside, so the signal never lands during interpreter start-up)."""
    import signal

    model = tmp_path / "slow.py"
    model.write_text(
        "import sys, time\n\ndef make():\n"
        "    print('ready', file=sys.stderr, flush=True)\n    time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [*_shardplan(), "plan", str(model), "--mesh", "dp=2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stderr.readline() == "ready\n"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert err == "shardplan: interrupted\n"


def test_a_closed_pipe_is_quiet(tmp_path):
    """``shardplan passes | head -0``: the reader is gone before anything is written."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)
    result = subprocess.run(
        [*_shardplan(), "passes"], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120
    )
    os.close(write_end)
    assert result.returncode == 0
    assert result.stderr == ""


def test_plan_prefer_throughput_splits_an_idle_mesh(tmp_path, capsys):
    """``--prefer throughput``: the example graph at a tiny size leaves 8 H100s repeating the
    same step; the flag returns the data-parallel plan and its summary says why."""
    import shardplan as sp

    tiny = tmp_path / "tiny.py"
    tiny.write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT / 'examples')!r})\n"
        "from mlp_graph import make as _make\n\n\n"
        "def make():\n    return _make(batch=8, model=64, hidden=128)\n"
    )
    args = ["plan", f"{tiny}:make", "--mesh", "dp=2,tp=4", "--cluster", "h100-sxm", "-q"]
    with pytest.warns(sp.IdleDevicesWarning, match="8 devices repeat the same work"):
        assert main(args) == 0
    assert "idle devices   8 devices repeat the same work" in capsys.readouterr().out
    assert main([*args, "--prefer", "throughput"]) == 0
    out = capsys.readouterr().out
    assert "batch over dp×tp" in out
    assert "idle devices   prefer='throughput': the batch is split over dp×tp" in out
