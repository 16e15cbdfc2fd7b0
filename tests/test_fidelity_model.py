"""Properties of the fidelity benchmark's analytic model (``bench/transformer_cost.py``)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from shardplan.costmodel import collective_time
from shardplan.costmodel.calibration import default_calibration
from shardplan.ir import Mesh
from transformer_cost import Config, Model, _dp_exposed, estimate, optimizer_time

H100 = "h100-sxm"
MODEL = Model("gpt-7b", 32, 4096, 32, 16384, 131072, dropout=False)
CONFIG = Config(2, 1, 48, 192, 4096, flash_attention=True)


def test_fp32_gradients_double_the_reduce_scatter_volume():
    """Without overlap the exposed DP time is RS(gradients) + AG(bf16 parameters): going from
    16-bit to fp32 gradients adds exactly the extra reduce-scatter bytes' time."""
    c16, c32 = replace(CONFIG, grad_bytes=2), replace(CONFIG, grad_bytes=4)
    mesh = Mesh({"dp": 48, "pp": 1, "tp": 2}, cluster=H100)
    params = (MODEL.layers * MODEL.layer_params() + MODEL.vocab * MODEL.hidden) / 2
    expected = collective_time("reduce-scatter", 4 * params / 48, "dp", mesh)
    expected -= collective_time("reduce-scatter", 2 * params / 48, "dp", mesh)
    extra = _dp_exposed(MODEL, c32, H100, 0.0, 0.0) - _dp_exposed(MODEL, c16, H100, 0.0, 0.0)
    assert extra == pytest.approx(expected, rel=1e-9)
    assert extra > 0


def test_distributed_optimizer_shards_only_the_adam_step():
    """The Adam step shrinks with dp under a distributed optimizer; zeroing the local
    gradient buffer does not, so the time approaches the zeroing cost as dp grows."""
    cal = default_calibration(H100)
    small, large = (optimizer_time(MODEL, replace(CONFIG, dp=d), H100, cal) for d in (2, 4096))
    replicated = optimizer_time(MODEL, replace(CONFIG, distributed_optimizer=False), H100, cal)
    assert replicated > small > large > 0
    zero_only = optimizer_time(MODEL, replace(CONFIG, dp=10**9), H100, cal)
    assert large == pytest.approx(zero_only, rel=0.01)


def test_estimate_with_the_analytic_layer_time_is_unchanged():
    """Overriding the layer time with the analytic one reproduces the analytic estimate, and a
    slower layer gives a slower step (the captured path only swaps the per-layer price)."""
    base = estimate(MODEL, CONFIG, H100)
    same = estimate(MODEL, CONFIG, H100, layer_time=base.layer_forward + base.layer_backward)
    slower = estimate(
        MODEL, CONFIG, H100, layer_time=2 * (base.layer_forward + base.layer_backward)
    )
    assert same.step_time == pytest.approx(base.step_time, rel=1e-12)
    assert slower.step_time > base.step_time


def test_step_includes_the_per_step_optimizer_work():
    est = estimate(MODEL, CONFIG, H100)
    assert est.optimizer > 0
    assert est.step_time == pytest.approx(
        est.pipeline.step_time + est.dp_exposed + est.optimizer, rel=1e-12
    )
