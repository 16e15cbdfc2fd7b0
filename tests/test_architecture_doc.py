"""docs/architecture.md stays true: it names every module of the package under its folder, and
its pipeline block is the default pipeline the planner runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()
FOLDERS = [
    "ir",
    "passes",
    "costmodel",
    "solver",
    "frontend",
    "frontend/torch",
    "frontend/jax",
    "api",
]


def _section(folder: str) -> str:
    start = DOC.index(f"### `{folder}/`")
    end = DOC.find("\n### ", start + 1)
    return DOC[start : end if end != -1 else None]


def test_every_module_has_its_sentence() -> None:
    missing = []
    for folder in FOLDERS:
        listed = set(re.findall(r"^- `([\w]+\.py)`: \S", _section(folder), re.M))
        for path in sorted((ROOT / folder).glob("*.py")):
            if path.name not in listed:
                missing.append(f"{folder}/{path.name}")
        stale = listed - {p.name for p in (ROOT / folder).glob("*.py")}
        missing += [f"{folder}/{name} (listed, no such module)" for name in sorted(stale)]
    assert not missing, f"docs/architecture.md, 'Modules': add or drop {missing}"


def test_the_pipeline_block_is_the_default_pipeline() -> None:
    from shardplan.solver.planner import default_pipeline_text

    section = DOC[DOC.index("## The planner as a pipeline of passes") :]
    block = section[section.index("```\n") + 4 : section.index("\n```", section.index("```\n"))]
    assert block.strip() == default_pipeline_text()


def test_every_unit_of_the_layer_table_is_drawn() -> None:
    from layer_contract import LAYERS

    drawn = DOC[DOC.index("## Layers") : DOC.index("## The planner")]
    for tier in LAYERS:
        for unit in tier.split("|"):
            assert unit in drawn, f"the layer drawing lacks {unit!r}"


def test_every_keyword_of_sp_plan_is_documented_in_a_group() -> None:
    import inspect

    import shardplan as sp

    doc = inspect.getdoc(sp.plan) or ""
    groups = [line for line in doc.splitlines() if line and not line[0].isspace()]
    assert len(groups) >= 6, groups  # the summary, the groups' intro and one header per group
    undocumented = [
        name
        for name in inspect.signature(sp.plan).parameters
        if not any(
            line.strip().startswith((f"{name}:", f"{name},")) or f", {name}:" in line
            for line in doc.splitlines()
        )
    ]
    assert not undocumented, f"sp.plan's docstring lacks {undocumented}"
