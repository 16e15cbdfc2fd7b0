"""``import shardplan`` must work where neither torch nor jax is installed (DESIGN.md §2)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKED = ("torch", "jax", "jaxlib")

SCRIPT = textwrap.dedent(
    """
    import sys

    BLOCKED = {blocked!r}

    class Block:
        # A meta-path finder that fails every import of a blocked package, as if not installed.
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{{name}} is blocked for this test")
            return None

    sys.meta_path.insert(0, Block())
    import shardplan as sp
    from shardplan import cli
    from shardplan.solver import report, serialize

    mesh = sp.Mesh({{"dp": 2, "tp": 4}}, cluster="h100-sxm")
    sharding = sp.Sharding.of("dp", "tp")
    sharding.check(sp.TensorType((8, 16), "bf16"), mesh)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not loaded, loaded
    print("ok", sharding, mesh)
    """
).format(blocked=BLOCKED)


def test_import_shardplan_with_torch_and_jax_blocked():
    """Core, CLI, report and serialisation import and work with the frameworks blocked."""
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith('ok [{"dp"}, {"tp"}]')


def test_blocking_really_blocks():
    """The finder does make ``import torch`` fail, so the test above proves something."""
    script = SCRIPT.replace("import shardplan as sp", "import torch  # noqa")
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "torch is blocked" in result.stderr
