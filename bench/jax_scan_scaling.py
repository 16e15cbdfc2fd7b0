"""Planning time of a scanned GPT step versus its layer count (issue 3, acceptance 4).

Usage: ``python bench/jax_scan_scaling.py [--layers 4 32] [--mesh 8] [--repeat 3]``.
``plan s`` is the best of ``--repeat`` calls of ``sp.plan`` (capture included).
Prints a table and writes ``bench/results/jax_scan_scaling.json``. Arguments are
ShapeDtypeStructs, so nothing model-sized is allocated.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import jax_gpt  # noqa: E402
import shardplan as sp  # noqa: E402
from shardplan.api.records import WallClock, add_record_argument, save_record  # noqa: E402
from shardplan.frontend.jax.capture import capture  # noqa: E402


def measure(layers: int, mesh: sp.Mesh, time_limit: float, repeat: int) -> dict[str, float]:
    """Best of ``repeat`` runs (the least disturbed by other load on the machine)."""
    config = jax_gpt.GPTConfig(n_layers=layers, scan_layers=True)
    step, args = jax_gpt.make(config, abstract=True)
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        graph, _ = capture(step, *args)
        captured = time.perf_counter()
        plan = sp.plan(step, *args, mesh=mesh, time_limit=time_limit)
        done = time.perf_counter()
        runs.append((done - captured, captured - start, plan))
    plan_s, capture_s, plan = min(runs, key=lambda r: r[0])
    return {
        "layers": layers, "ops": len(graph.ops), "capture_s": capture_s, "plan_s": plan_s,
        "runs_s": [r[0] for r in runs], "status": plan.solver.status,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--mesh", type=int, nargs="+", default=[8])
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--repeat", type=int, default=3, help="runs per size; the best counts")
    add_record_argument(parser)
    ns = parser.parse_args()
    clock = WallClock()
    mesh = sp.Mesh(dict(zip(("dp", "tp"), ns.mesh, strict=False)))
    rows = [measure(n, mesh, ns.time_limit, ns.repeat) for n in ns.layers]
    print(f"{'layers':>6} {'ops':>7} {'capture s':>10} {'plan s':>9} status")
    for r in rows:
        timings = f"{r['capture_s']:>10.2f} {r['plan_s']:>9.2f}"
        print(f"{r['layers']:>6} {r['ops']:>7} {timings} {r['status']}")
    ratio = rows[-1]["plan_s"] / max(rows[0]["plan_s"], 1e-9)
    print(f"plan time ratio {rows[-1]['layers']} vs {rows[0]['layers']} layers: {ratio:.2f}x")
    out = ROOT / "bench" / "results" / "jax_scan_scaling.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"mesh": ns.mesh, "rows": rows, "ratio": ratio}, indent=2))
    save_record(ns, "jax_scan_scaling", results={"rows": rows, "ratio": ratio},
                wall_times=clock.total())  # fmt: skip


if __name__ == "__main__":
    main()
