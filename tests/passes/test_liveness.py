"""Liveness: phases, live ranges and per-layer recomputation sets on a Llama-shaped step."""

from __future__ import annotations

from shardplan.ir.models import TransformerConfig, training_step
from shardplan.passes.liveness import Phase, liveness
from shardplan.solver.memory_rows import reduced_time_points

TINY = TransformerConfig("tiny", 2, 64, 4, 128, 256, 16, kv_heads=2)


def test_liveness_layers_and_windows() -> None:
    graph = training_step(TINY, batch=2)
    live = liveness(graph)
    assert set(live.layers) == {"layers.0", "layers.1"}
    first, second = live.layers["layers.0"], live.layers["layers.1"]
    # Layer 0's window (forward end .. backward start) contains layer 1's: backward is reversed.
    assert first.window[0] < second.window[0] <= second.window[1] < first.window[1]
    assert set(first.saved["selective"]) < set(first.saved["full"])
    for v in first.saved["full"]:
        assert live.define[v] <= first.forward_end
        assert live.last_use[v] >= first.backward_start
    phases = {p for p in live.phase}
    assert phases == {Phase.FORWARD, Phase.BACKWARD, Phase.UPDATE}
    assert all(
        live.phase[i] is Phase.UPDATE for i, op in enumerate(graph.ops) if op.kind == "adamw"
    )


def test_reduced_time_points_keep_every_maximal_live_set() -> None:
    intervals = [(0, 9), (1, 2), (2, 5), (4, 6), (7, 8)]
    kept = reduced_time_points(intervals, 9)
    assert kept == [2, 5, 8]
    live = [{k for k, (a, b) in enumerate(intervals) if a <= t <= b} for t in range(10)]
    for t in range(10):  # every live set is contained in a kept one
        assert any(live[t] <= live[k] for k in kept)
