"""Plan quality: the planner against every hand-written strategy under the same cost model.

    .venv/bin/python bench/quality.py [--quick] [--out bench/results]

Per cell (model x mesh x cluster x global batch): each baseline of ``sp.strategies``
evaluated with ``sp.evaluate`` (step time, peak memory or OOM), the planner's plan, and the
ratio planner / best feasible baseline. Writes ``quality.json`` and ``quality.png`` and prints a
table. Models are built by ``shardplan.ir.models`` with 2 layers (full per-layer shapes); the
memory budget is the device's HBM scaled by the fraction of the full model's parameters the
2-layer graph holds, so memory pressure is that of the full model (approximately: the
embedding share differs).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import shardplan as sp
from shardplan import strategies
from shardplan.api.records import WallClock, add_record_argument, save_record
from shardplan.costmodel import get_cluster
from shardplan.ir import models
from shardplan.solver.planner import plan_graph

LAYERS = 2
MODELS = (models.GPT_125M, models.LLAMA3_8B, models.LLAMA3_70B)
MESHES = ({"dp": 8}, {"dp": 2, "tp": 8}, {"dp": 8, "tp": 8})
CLUSTERS = ("h100-sxm", "a100-80gb")
SEQ = 2048
SEQUENCES_PER_DEVICE = 1


def baselines(mesh: sp.Mesh) -> list:
    """No-recompute and full-recompute variants of each strategy that fits the mesh."""
    return [s for s in strategies.baselines(mesh) if s.recompute != "selective"]


def run_cell(config, mesh_axes: dict, cluster: str) -> dict:
    mesh = sp.Mesh(mesh_axes, cluster=cluster)
    batch = SEQUENCES_PER_DEVICE * mesh.size
    graph = models.training_step(config, batch=batch, layers=LAYERS, seq=SEQ)
    full = replace(config, seq=SEQ).params
    small = replace(config, layers=LAYERS, seq=SEQ).params
    limit = get_cluster(cluster).hbm_capacity * small / full
    rows = []
    for strategy in baselines(mesh):
        start = time.perf_counter()
        ev = sp.evaluate(graph, mesh=mesh, strategy=strategy, memory_limit=limit, time_limit=10)
        rows.append(_row(strategy.name, ev.step_time, ev.peak_memory_bytes, ev.fits, start))
    start = time.perf_counter()
    try:
        plan = plan_graph(graph, mesh, memory_limit=limit, time_limit=20)
        planner = _row("planner", plan.step_time, plan.peak_memory_bytes, True, start)
        planner["recompute"] = len(plan.recompute)
    except sp.InfeasiblePlanError:
        planner = _row("planner", float("inf"), 0, False, start)
    feasible = [r["step_time"] for r in rows if r["fits"]]
    best = min(feasible) if feasible else None
    return {
        "model": config.name, "mesh": mesh_axes, "cluster": cluster, "global_batch": batch,
        "seq": SEQ, "layers": LAYERS, "memory_limit": limit, "baselines": rows,
        "planner": planner, "best_baseline": best,
        "ratio": planner["step_time"] / best if best and planner["fits"] else None,
        "best_name": min((r for r in rows if r["fits"]), key=lambda r: r["step_time"])["name"]
        if feasible else None,
    }  # fmt: skip


def _row(name: str, step: float, peak: int, fits: bool, start: float) -> dict:
    wall = time.perf_counter() - start
    return {"name": name, "step_time": step, "peak": int(peak), "fits": fits, "wall": wall}


def table(cells: list[dict]) -> str:
    lines = [
        f"{'model':12s} {'mesh':14s} {'cluster':10s} {'best baseline':24s} {'best ms':>9s} "
        f"{'planner ms':>10s} {'ratio':>6s} {'peak GiB':>8s} {'budget':>7s}"
    ]
    for c in cells:
        mesh = "x".join(f"{k}{v}" for k, v in c["mesh"].items())
        best = f"{c['best_baseline'] * 1e3:9.2f}" if c["best_baseline"] else "      OOM"
        ratio = f"{c['ratio']:6.3f}" if c["ratio"] else "     -"
        p = c["planner"]
        lines.append(
            f"{c['model']:12s} {mesh:14s} {c['cluster']:10s} {c['best_name'] or '-':24s} {best} "
            f"{p['step_time'] * 1e3:10.2f} {ratio} {p['peak'] / 2**30:8.2f} "
            f"{c['memory_limit'] / 2**30:7.2f}"
        )
    return "\n".join(lines)


def plot(cells: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        f"{c['model']}\n{'x'.join(map(str, c['mesh'].values()))} {c['cluster'][:4]}" for c in cells
    ]
    ratios = [c["ratio"] or 0.0 for c in cells]
    fig, ax = plt.subplots(figsize=(max(8, len(cells) * 0.6), 4))
    ax.bar(range(len(cells)), ratios)
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xticks(range(len(cells)), labels, rotation=90, fontsize=6)
    ax.set_ylabel("planner / best feasible baseline (step time)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one cluster, first two models")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    add_record_argument(parser)
    args = parser.parse_args()
    clock = WallClock()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    cells = []
    for cluster in CLUSTERS[:1] if args.quick else CLUSTERS:
        for config in MODELS[:2] if args.quick else MODELS:
            for mesh in MESHES:
                cells.append(run_cell(config, mesh, cluster))
                print(table(cells[-1:]).splitlines()[-1], flush=True)
    print(table(cells))
    wins = [c for c in cells if c["ratio"] and c["ratio"] <= 1 / 1.2]
    worse = [c for c in cells if c["ratio"] and c["ratio"] > 1.0 + 1e-9]
    print(f"cells: {len(cells)}, planner worse than best baseline: {len(worse)}, "
          f"wins by >= 1.2x: {len(wins)}, wall {time.perf_counter() - start:.0f} s")  # fmt: skip
    (out / "quality.json").write_text(json.dumps(cells, indent=1))
    plot(cells, out / "quality.png")
    inputs = {"clusters": CLUSTERS, "models": [m.name for m in MODELS], "meshes": MESHES}
    save_record(args, "quality", results=cells, wall_times=clock.total(), inputs=inputs)


if __name__ == "__main__":
    main()
