"""CP-SAT is imported only where a search runs: its module pulls in pandas, ~0.75 CPU s that an
LP-integral plan (the JAX GPT's) never needs (docs/design.md "Planning speed")."""

import subprocess
import sys

CHECK = (
    "import sys, shardplan.solver.planner, shardplan.solver.ilp, shardplan.solver.memory, "
    "shardplan.solver.stages; "
    "print('ortools.sat.python.cp_model' in sys.modules, 'pandas' in sys.modules)"
)


def test_planner_import_leaves_cpsat_and_pandas_out() -> None:
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
