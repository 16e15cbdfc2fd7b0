"""The README's JAX GPT planned unrolled has at least the scanned variant's freedom: its modelled
step is no worse (issue 23), and its alike layers share solver variables as torch layers do."""

from __future__ import annotations

import jax_gpt
import pytest
import shardplan as sp
from shardplan.frontend.jax.capture import capture
from shardplan.passes.repeated_layers import find_repeated_layers

pytestmark = pytest.mark.jax


def test_unrolled_layers_are_recognised_as_repeated() -> None:
    step, args = jax_gpt.make(jax_gpt.GPTConfig(n_layers=3), abstract=True)
    graph, _ = capture(step, *args)
    layers = find_repeated_layers(graph).layers
    assert layers.get("params['layers'][") == [0, 1, 2]


@pytest.mark.slow
def test_unrolled_step_is_no_worse_than_scan() -> None:
    mesh = sp.Mesh({"dp": 2, "tp": 4}, cluster="cpu-test")
    steps = {}
    for scan in (False, True):
        step, args = jax_gpt.make(jax_gpt.GPTConfig(scan_layers=scan), abstract=True)
        plan = sp.plan(step, *args, mesh=mesh, time_limit=120)
        assert plan.solver.status in ("OPTIMAL", "FEASIBLE")
        steps[scan] = plan.step_time
    assert steps[False] <= steps[True] * 1.005
