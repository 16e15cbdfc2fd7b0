"""Fixtures for the torch frontend tests: the example models and a simulated world."""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
MODELS = Path(__file__).resolve().parent  # test-only models (moe_models.py)
if str(MODELS) not in sys.path:
    sys.path.insert(0, str(MODELS))


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` (examples are scripts, not part of the package)."""
    spec = importlib.util.spec_from_file_location(
        f"shardplan_example_{name}", EXAMPLES / f"{name}.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def examples() -> dict[str, ModuleType]:
    return {name: load_example(name) for name in ("torch_mlp", "hf_llama", "hf_gpt2")}


@pytest.fixture(autouse=True)
def _quiet_dtensor() -> None:
    """DTensor warns about sequential per-axis collectives; they are expected here."""
    warnings.filterwarnings("ignore", message=".*sequential.*")
    warnings.filterwarnings("ignore", message="Full backward hook is firing.*")


@pytest.fixture(autouse=True, scope="module")
def _fresh_fallback_strategies() -> None:
    """Each test file starts from DTensor's own strategy registry: the fallback's registrations
    (``frontend/torch/fallback.py``) are process-wide, and one file's (an encoder's attention,
    a fill) changed what a later file's models ran."""
    from shardplan.frontend.torch import fallback

    fallback.reset()
