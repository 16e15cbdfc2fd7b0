"""The HTML report (``solver/html_report.py``): self-contained, its numbers are the plan's, and it
renders in a real browser (headless Chromium from Debian's packages, which
``scripts/install_browser.sh`` installs when absent) with no script errors."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import shardplan as sp
from shardplan.costmodel.simulate import shared_reshards, simulate
from shardplan.ir import Role
from shardplan.ir.models import TransformerConfig, training_step
from shardplan.solver.html_assets import AXIS_COLOURS, MEMORY_COLOURS

ROOT = Path(__file__).resolve().parents[2]
BROWSER_TIMEOUT = 180
"""Seconds for one headless Chromium run (11 s measured on the loaded 2-core box)."""


# -- fixtures -----------------------------------------------------------------------------------
@pytest.fixture
def transformer_plan(tiny_llama_plan):
    return tiny_llama_plan


@pytest.fixture(scope="module")
def pipeline_plan():
    config = TransformerConfig("tiny", 4, 256, 4, 1024, 512, 128)
    mesh = sp.Mesh({"pp": 2, "dp": 2, "tp": 2}, cluster="h100-sxm")
    return sp.plan(training_step(config, batch=8), mesh=mesh, microbatches=4)


class _Elements(HTMLParser):
    """Every start tag as (tag, attributes), in document order."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, {k: v or "" for k, v in attrs}))

    def find(self, tag: str, **wanted: str) -> list[dict[str, str]]:
        return [
            a for t, a in self.tags if t == tag and all(a.get(k) == v for k, v in wanted.items())
        ]


# -- the page, parsed ---------------------------------------------------------------------------
def test_report_is_one_self_contained_file(transformer_plan, tmp_path):
    text = transformer_plan.to_html(tmp_path / "plan.html")
    assert (tmp_path / "plan.html").read_text(encoding="utf-8") == text
    assert not re.search(r"https?://", text), "the page must not fetch anything"
    page = _Elements(text)
    assert not [a for t, a in page.tags if "src" in a or "href" in a or t == "link"]
    for section in ("summary", "mesh", "layouts", "memory-bar", "timeline", "reshards"):
        assert any(a.get("id") == section for _, a in page.tags), section


def test_layout_map_shows_every_parameter_layout(transformer_plan):
    page = _Elements(transformer_plan.to_html())
    rows = page.find("tr", **{"class": "layout"})
    params = [v for v in transformer_plan.graph.inputs if v.role is Role.PARAMETER]
    assert sum(int(r["data-count"]) for r in rows) == len(params)  # alike layers folded
    assert len(rows) < len(params)
    by_name = {r["data-name"]: r["data-layout"] for r in rows}
    for value in params:  # layers.0.mlp.up_proj.weight -> the row layers.0-1.mlp.up_proj.weight
        name = re.sub(r"\.(\d+)\.", ".0-1.", value.origin.path)
        assert by_name.get(name, by_name.get(value.origin.path)) == str(
            transformer_plan.shardings[value.name]
        ), value.origin.path
    dims = [a for a in page.find("span", **{"class": "dim"}) if "data-dim" in a]
    used = {axis for a in dims for axis in a["data-axes"].split(",") if axis}
    assert used <= set(transformer_plan.mesh.axis_names)


def test_memory_bars_and_timeline_equal_the_plan(transformer_plan):
    page = _Elements(transformer_plan.to_html())
    segments = page.find("div", **{"class": "segment"})
    assert {a["data-kind"]: int(a["data-bytes"]) for a in segments} == transformer_plan.memory
    bar = page.find("div", id="memory-bar")[0]
    assert int(bar["data-peak"]) == transformer_plan.peak_memory_bytes
    assert int(bar["data-limit"]) == int(transformer_plan.memory_limit)
    compute = page.find("rect", **{"class": "compute"})
    assert sum(int(a["data-count"]) for a in compute) == len(transformer_plan.graph.ops)
    comm = page.find("rect", **{"class": "comm"})
    shared = shared_reshards(transformer_plan.reshards)
    assert len(comm) == sum(1 for s in shared if s is None)  # one box per collective run
    kinds = {op.kind for op in transformer_plan.graph.ops}
    for box in compute:  # the hover text names the op (or the first and last of a merged run)
        assert box["data-tip"].split()[0] in kinds | {str(int(box["data-count"]))}
    moved = {r.value for r in transformer_plan.reshards if r.collectives}
    collective_kinds = {c.kind for r in transformer_plan.reshards for c in r.collectives}
    for box in comm:  # ... and the collective: kind, axes, bytes, the value moved
        assert box["data-tip"].split("[")[0] in collective_kinds
        assert re.search(r": %(\S+) -> ", box["data-tip"])[1] in moved
    step = simulate(transformer_plan).step_time
    ends = [float(a["data-end"]) for a in compute + comm]
    assert max(ends) == pytest.approx(step)
    assert step == pytest.approx(transformer_plan.step_time)


def test_pipeline_schedule_is_drawn(pipeline_plan):
    page = _Elements(pipeline_plan.to_html())
    pipe = pipeline_plan.pipeline
    tasks = page.find("rect", **{"class": "task forward"})
    assert len(tasks) == len(pipe.stages) * pipe.microbatches
    assert len(page.find("rect", **{"class": "task backward"})) == len(tasks)
    assert not page.find("svg", id="timeline")  # one stage's streams would mislead
    for stage in pipe.stages:  # each stage's peak, as planned
        (row,) = page.find("tr", **{"data-stage": str(stage.index)})
        assert float(row["data-bytes"]) == stage.memory_bytes


# -- in a real browser --------------------------------------------------------------------------
def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    pytest.fail(
        "headless Chromium is needed for the HTML report tests: run ./scripts/install_browser.sh "
        "as root (apt-get install -y chromium chromium-driver)"
    )


def _browse(
    page: Path, tmp_path: Path, *flags: str, fragment: str = ""
) -> subprocess.CompletedProcess:
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
    command = [
        _chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
        "--enable-logging=stderr", "--v=0", f"--user-data-dir={profile}", *flags,
        page.resolve().as_uri() + fragment,
    ]  # fmt: skip
    env = {**os.environ, "HOME": str(tmp_path)}
    run = subprocess.run(command, capture_output=True, text=True, timeout=BROWSER_TIMEOUT, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    return run


def _console_errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "CONSOLE" in line and "rror" in line]


def _reshard_column(dom: str, column: int) -> list[str]:
    table = dom.split('id="reshards"', 1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr>(.*?)</tr>", table.split("<tbody>", 1)[1], re.S)
    return [re.findall(r'data-value="([^"]*)"', row)[column] for row in rows]


@pytest.mark.parametrize(("key", "column", "descending"), [("bytes", 5, True), ("value", 0, False)])
def test_browser_runs_the_page_without_errors_and_sorts(
    transformer_plan, tmp_path, key, column, descending
):
    page = tmp_path / "plan.html"
    text = transformer_plan.to_html(page)
    run = _browse(page, tmp_path, "--dump-dom", fragment=f"#sort={key}")
    dom = run.stdout
    assert 'data-ready="1"' in dom, "the page's script did not finish"
    assert "data-js-errors" not in dom
    assert _console_errors(run.stderr) == []
    assert f'data-sorted-by="{key}"' in dom
    cells = _reshard_column(dom, column)
    assert len(cells) == sum(1 for r in transformer_plan.reshards if r.collectives)
    assert sorted(cells) == sorted(_reshard_column(text, column))  # the same rows, reordered
    values = [float(c) for c in cells] if key == "bytes" else cells
    assert values == sorted(values, reverse=descending)


def test_browser_check_catches_a_script_error(transformer_plan, tmp_path):
    """The two checks above can fail: a page whose script throws is caught by both."""
    page = tmp_path / "broken.html"
    text = transformer_plan.to_html().replace("</body>", "<script>notDefined();</script></body>")
    page.write_text(text, encoding="utf-8")
    run = _browse(page, tmp_path, "--dump-dom")
    assert "data-js-errors" in run.stdout
    assert _console_errors(run.stderr)


def test_screenshot_shows_the_coloured_elements(transformer_plan, tmp_path):
    import matplotlib.image

    page = tmp_path / "plan.html"
    transformer_plan.to_html(page)
    shot = tmp_path / "plan.png"
    _browse(page, tmp_path, f"--screenshot={shot}", "--window-size=1400,1000")
    pixels = (matplotlib.image.imread(shot)[..., :3] * 255).round().astype(int)
    assert pixels.shape[:2] == (1000, 1400)
    colours = {tuple(int(c[i : i + 2], 16) for i in (1, 3, 5)) for c in AXIS_COLOURS[:2]}
    colours |= {
        tuple(int(MEMORY_COLOURS[k][i : i + 2], 16) for i in (1, 3, 5))
        for k in ("parameters", "activations", "optimizer_states")
    }  # fmt: skip
    flat = pixels.reshape(-1, 3)
    for colour in colours:  # mesh-axis chips, memory segments, timeline boxes
        hits = np.all(np.abs(flat - np.array(colour)) <= 2, axis=1).sum()
        assert hits >= 20, f"colour {colour} not rendered"
