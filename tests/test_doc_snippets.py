"""Every Python code block of README.md and docs/*.md runs, each in a fresh interpreter.

A block runs as written. A block that continues from objects a reader already has (a model, a
training step, a device mesh) says so on the line before it, visibly in the markdown source:

    <!-- snippet-setup: torch -->

and runs after that set-up's code (``SETUPS``): a tiny model built the way ``examples/`` build
theirs, on simulated devices or ranks. So the documentation cannot drift from the code: a renamed
function, a changed signature or a wrong import fails here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SNIPPET_TIMEOUT = 300
"""Seconds one block may take (with its set-up) on a busy 2-core machine: most take 5-45; the
pipeline / mesh-search block of the README takes 40-190 (two pipelined plans of a tiny Llama
and a search over 10 mesh shapes)."""

_FENCE = re.compile(r"^```python\s*$")
_SETUP = re.compile(r"^<!-- snippet-setup: ([\w-]+) -->$")

_TORCH_WORLD = """
from shardplan.frontend.torch import simulate
from torch.distributed.device_mesh import init_device_mesh
simulate.simulated_world(8)
device_mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
simulate.local_ranks(8).__enter__()     # every rank's tensor in this one process
"""

SETUPS: dict[str, str] = {
    # A tiny HF Llama with real weights, its token ids, and a (dp=2, tp=4) mesh of simulated ranks.
    "torch": """
from hf_llama import make
model, (batch,) = make(kv_heads=4)
input_ids = batch["input_ids"]
"""
    + _TORCH_WORLD,
    # ... and a plan of it, for blocks that apply or follow a plan.
    # (2x2: docs/torch.md's follow_plan section is about HF Llama on 2x2.)
    "torch-plan": """
import torch
import shardplan as sp
from hf_llama import make
from shardplan.frontend.torch import simulate
from torch.distributed.device_mesh import init_device_mesh
model, (batch,) = make(kv_heads=4)
plan = sp.plan(model, batch, mesh=sp.Mesh({"dp": 2, "tp": 2}, cluster="cpu-test"))
simulate.simulated_world(4)
device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
simulate.local_ranks(4).__enter__()
""",
    # An 8-layer HF Llama on the meta device (nothing allocated) and its keyword inputs.
    "torch-meta": """
import shardplan as sp
from hf_llama import make
model, (batch,) = make(layers=4, device="meta")
""",
    # A planned 2-stage pipeline of a tiny Llama, seen from rank 0 of a simulated world.
    "torch-pipeline": """
import shardplan as sp
from hf_llama import make
from shardplan.frontend.torch.pipeline import (
    build_pipeline_schedule, build_pipeline_stage, pipeline_schedule, pipeline_spec,
)
model, (batch,) = make(layers=4)
ids = batch["input_ids"]
plan = sp.plan(model, batch, mesh=sp.Mesh({"pp": 2}, cluster="cpu-test"), microbatches=2)
# a world of exactly the 2 pipeline ranks, as a real launch has (simulate.simulated_world makes
# a larger one, of which meshes are sub-meshes: the default pipeline group would be all of it)
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
rank = 0
""",
    # The JAX MLP training step of examples/jax_mlp.py and its arguments, 8 simulated devices.
    "jax": """
from jax_mlp import make
train_step, (params, opt_state, batch) = make()
""",
}


@dataclass(frozen=True)
class Snippet:
    document: Path
    line: int
    """1-based line of the opening fence."""
    code: str
    setup: str | None

    @property
    def id(self) -> str:
        return f"{self.document.relative_to(ROOT)}:{self.line}"


def python_snippets(path: Path) -> list[Snippet]:
    """The ```python blocks of a markdown file, with the set-up named on the line before."""
    lines = path.read_text().splitlines()
    snippets, i = [], 0
    while i < len(lines):
        if _FENCE.match(lines[i]):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            match = _SETUP.match(previous.strip())
            code = "\n".join(lines[i + 1 : end]) + "\n"
            snippets.append(Snippet(path, i + 1, code, match.group(1) if match else None))
            i = end
        i += 1
    return snippets


SNIPPETS = [s for doc in DOCUMENTS for s in python_snippets(doc)]


def test_every_setup_named_in_the_docs_exists():
    unknown = {s.id: s.setup for s in SNIPPETS if s.setup is not None and s.setup not in SETUPS}
    assert not unknown, f"unknown snippet-setup names (add them to SETUPS): {unknown}"
    assert len(SNIPPETS) >= 6  # README's PyTorch, JAX, pipeline, rule, pass; docs/torch.md


def _program(snippet: Snippet) -> str:
    prelude = f"import sys\nsys.path.insert(0, {str(ROOT / 'examples')!r})\n"
    setup = textwrap.dedent(SETUPS[snippet.setup]) if snippet.setup else ""
    return prelude + setup + f"# --- {snippet.id}\n" + snippet.code


@pytest.mark.slow
@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.id for s in SNIPPETS])
def test_snippet_runs(snippet: Snippet, tmp_path: Path):
    script = tmp_path / "snippet.py"
    script.write_text(_program(snippet))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"  # simulated JAX devices
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,  # a block that saves a file writes it here
        env=env,
        capture_output=True,
        text=True,
        timeout=SNIPPET_TIMEOUT,
    )
    took = time.perf_counter() - start
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{snippet.id} failed after {took:.0f} s:\n{output[-4000:]}"
    assert "Traceback" not in output, output[-4000:]


_SP_NAME = re.compile(r"`[^`]*?\bsp\.([A-Za-z_][\w.]*)")
"""A name used through ``sp.`` inside inline code: ``sp.whatif(...)``, ``sp.strategies.dp``."""


def test_every_sp_name_the_docs_use_exists() -> None:
    """Inline code like ``sp.whatif(...)`` works after ``import shardplan as sp`` (issue 37:
    the README showed ``sp.whatif``, which the package did not export)."""
    import shardplan as sp

    missing = set()
    for document in DOCUMENTS:
        for dotted in _SP_NAME.findall(document.read_text()):
            target: object = sp
            for part in dotted.rstrip(".").split("."):
                if not hasattr(target, part):
                    missing.add(f"{document.name}: sp.{dotted}")
                    break
                target = getattr(target, part)
    assert not missing, sorted(missing)


def test_readme_memory_breakdown_by_kind_works() -> None:
    """The README's ``plan.memory_breakdown()["kv_cache"]`` (a ``MemoryProfile`` indexed by
    kind); an unknown kind names the known ones."""
    import shardplan as sp
    from shardplan.ir import Graph, Origin, Role, TensorType

    assert 'memory_breakdown()["kv_cache"]' in (ROOT / "README.md").read_text()
    g = Graph(name="tiny")
    x = g.add_input("x", TensorType((64, 32), "f32"), Role.INPUT, Origin(path="x"))
    w = g.add_input("w", TensorType((32, 16), "f32"), Role.PARAMETER, Origin(path="w"))
    g.set_outputs([g.add_op("dot", [x, w], [TensorType((64, 16), "f32")], names=["y"]).result])
    plan = sp.plan(g, mesh=sp.Mesh({"dp": 2}, cluster="cpu-test"), time_limit=5)
    memory = plan.memory_breakdown()
    assert memory["kv_cache"] == memory.by_category.get("kv_cache", 0) == 0
    assert memory["parameters"] == memory.by_category["parameters"] > 0
    assert "parameters" in memory
    assert dict(memory.items()) == memory.by_category
    with pytest.raises(KeyError, match=r"no memory kind 'kv_cach'; kinds: .*kv_cache"):
        memory["kv_cach"]
