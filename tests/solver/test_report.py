"""``plan.report(full=True)``: deterministic tables and the ASCII picture of parameter layouts;
the one-screen summary ``print(plan)`` is tested in test_summary.py."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from shardplan import Sharding
from shardplan.solver.report import format_bytes, format_plan, format_seconds, plan_picture


def _make_plan():
    """The hand-built plan of test_serialize.py (loaded by path: tests are not a package)."""
    path = Path(__file__).with_name("test_serialize.py")
    spec = importlib.util.spec_from_file_location("_serialize_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_plan()


def _text_in_subprocess(hash_seed: str) -> str:
    """format_plan of the hand-built plan in a fresh interpreter with its own string hashing
    (so set and dict-of-set iteration orders differ from this process's)."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('c', {str(Path(__file__)).__repr__()})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "sys.stdout.write(m.format_plan(m._make_plan(), full=True))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return done.stdout


def test_format_plan_is_deterministic_plain_text():
    """The same plan gives the same text whatever the insertion order of its tables and the
    interpreter's hash seed; no ANSI escapes; the fixed width holds."""
    plan = _make_plan()
    text = format_plan(plan, full=True)
    made = _make_plan()
    shuffled = dataclasses.replace(
        made,
        shardings=dict(reversed(list(made.shardings.items()))),
        operand_shardings=dict(reversed(list(made.operand_shardings.items()))),
        memory=dict(reversed(list(made.memory.items()))),
    )
    assert format_plan(shuffled, full=True) == text
    assert _text_in_subprocess("1") == text
    assert _text_in_subprocess("2") == text
    assert "\x1b[" not in text
    assert max(len(line) for line in text.splitlines()) <= 110


def test_full_report_has_every_section():
    text = _make_plan().report(full=True)
    assert '<["dp"=2, "tp"=4]> = 8 devices, cluster h100-sxm' in text
    assert "42.5 µs modelled (compute 30 µs, communication 12.5 µs)" in text
    assert "80 KiB peak (activations 64 KiB, parameters 16 KiB)" in text
    assert "OPTIMAL, objective 42.5 µs, gap 0.00%, 370 ms, 42 variables, 3 choices" in text
    assert 'fc1.weight   param   bf16[64,256]   [{}, {"tp"}]   [64,64]' in text
    assert "%out = dot(%a, %w2)" in text
    assert "all-reduce[tp] 512 B 12.5 µs" in text
    assert "%out -> output 0" in text


def test_plan_picture_draws_column_and_row_splits():
    picture = plan_picture(_make_plan())
    assert picture.splitlines()[:4] == [
        'fc1.weight  bf16[64,256]  [{}, {"tp"}]',
        "  +---+---+---+---+   dim 0 (64): whole",
        "  | 0 | 1 | 2 | 3 |   dim 1 (256): split 4 ways over tp -> 64 each",
        "  +---+---+---+---+   replicated over dp=2",
    ]
    assert "  | 3 |" in picture


def test_plan_picture_elides_wide_splits_and_shows_partial():
    made = _make_plan()
    made.graph.inputs[1].type = type(made.graph.inputs[1].type)((64, 256), "bf16")
    wide = {"w1": Sharding.of(None, ("dp", "tp")), "w2": Sharding.of(None, None, partial=["tp"])}
    plan = dataclasses.replace(
        made, mesh=type(made.mesh)({"dp": 2, "tp": 16}), shardings={**made.shardings, **wide}
    )
    picture = plan_picture(plan)
    assert "+---+---+---+---+---+---+---+---+.." in picture
    assert "partial (pending sum) over tp" in picture


def test_units():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**30) == "3 GiB"
    assert format_seconds(1.25e-5) == "12.5 µs"
    assert format_seconds(0.25) == "250 ms"
    assert format_seconds(2.0) == "2 s"


def test_plan_and_evaluation_reprs_are_one_line():
    """The dataclass default repr printed the whole graph (megabytes for a real model)."""
    import shardplan as sp

    plan = _make_plan()
    assert "\n" not in repr(plan)
    assert len(repr(plan)) < 200
    assert repr(plan).startswith(f"<Plan {plan.graph.name} on ")
    ev = sp.evaluate(plan.graph, mesh=plan.mesh, strategy=sp.strategies.dp())
    assert "plan=" not in repr(ev)
    assert len(repr(ev)) < 600
