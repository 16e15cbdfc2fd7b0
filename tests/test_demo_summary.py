"""``./scripts/demo.sh`` prints one screen, the README shows that screen, ``--full`` the rest.

One demo run (about 20-50 s on a busy 2-core box: torch import, the meta model, capture and the
solve), shared by the tests below; ``shardplan show`` then reads the saved plan.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest
from plan_digests import check_text

ROOT = Path(__file__).resolve().parents[1]
SCREEN = 40
"""Lines of the default summary (issue 16)."""


@functools.cache
def _demo(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["./scripts/demo.sh", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp("demo") / "plan.json"
    result = _demo(out)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout, out


def _show(*args: str) -> str:
    shardplan = Path(sys.executable).with_name("shardplan")
    result = subprocess.run(
        [str(shardplan), "show", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.slow
def test_demo_prints_one_screen_with_every_part(demo):
    text, _ = demo
    lines = text.splitlines()
    assert len(lines) <= SCREEN, text
    assert max(len(line) for line in lines) <= 110
    assert re.search(
        r"^step time +[\d.]+ ms modelled \(compute [\d.]+ ms, communication", text, re.M
    )
    assert re.search(r"^collectives +(all-gather|reduce-scatter) ×\d+", text, re.M)
    assert re.search(r"^memory/device +[\d.]+ GiB peak \(activations [\d.]+ GiB", text, re.M)
    assert re.search(r"^strategy +batch over dp×tp, [^\n]*\n?[^\n]*recompute none", text, re.M)
    assert "model.layers.0-15.self_attn.q_proj.weight ×16" in text
    assert "model.layers.0-15.mlp.down_proj.weight ×16" in text
    assert "model.layers.1." not in text  # alike layers are shown once
    assert re.search(r"^Costliest reshards \(\d+ with collectives", text, re.M)
    assert "Inputs" not in text


@pytest.mark.slow
def test_readme_shows_the_demo_output(demo):
    """Every line of README's demo block is what the demo prints (the solver's wall time aside)."""
    text, _ = demo
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## What a plan looks like") :]
    block = section[section.index("```\n") + 4 : section.index("\n```", section.index("```\n"))]
    printed = text.splitlines()
    solver = re.compile(r"(, )[\d.]+ (ms|s)(, \d+ variables)")
    assert len(block.splitlines()) == len(printed)
    for want, got in zip(block.splitlines(), printed, strict=True):
        assert solver.sub(r"\1T\3", want) == solver.sub(r"\1T\3", got)


@pytest.mark.slow
def test_show_prints_the_summary_and_full_every_table(demo):
    _, saved = demo
    summary = _show(str(saved))
    assert len(summary.splitlines()) <= SCREEN
    assert "model.layers.0-15.self_attn.q_proj.weight ×16" in summary
    full = _show("--full", str(saved))
    assert len(full.splitlines()) > 1000
    for part in ("Inputs", "Ops (communicating", "Reshards", "Parameter layouts"):
        assert part in full
    assert "model.layers.15.mlp.down_proj.weight  f32[2048,8192]" in full  # every layer's picture


@pytest.mark.slow
def test_demo_plan_is_the_recorded_one(demo):
    """The demo's saved plan, byte for byte (its digest; see tests/plan_digests.py)."""
    _, out = demo
    check_text(__file__, "demo", out.read_text())
