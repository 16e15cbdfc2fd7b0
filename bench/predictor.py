"""The learned mesh-search predictor (issue 20 part 2, CubicML): accuracy and search speed-up.

    .venv/bin/python bench/predictor.py --build      # re-plan the training grid -> model file
    .venv/bin/python bench/predictor.py              # table + bench/results/predictor.json
    .venv/bin/python bench/predictor.py --quick      # held-out accuracy only (no 256-GPU search)
    .venv/bin/python bench/predictor.py --record run.json

``--build`` runs the full mesh search (every shape planned) on each configuration of
``predictor.training_grid()`` and writes ``data/predictor/model.json`` (``--resume`` keeps the
file's rows and plans only the configurations it lacks). The report then

1. scores the predictor on configurations it was not trained on, three ways: every model
   family held out in turn (fit on the other families' configurations, score that family's),
   every cluster held out in turn, and the old fixed split (every fourth configuration). Per
   held-out configuration: Kendall tau between the predictor's ranking of all its shapes and
   the full planner's step times (``predictor.kendall_tau``: pairs the planner ties are left
   out, rejected shapes tie last), top-1 recall (the predictor's first shape is one of the
   planner's best) and top-5 recall (one of the planner's best is among its first five);
   means over the configurations;
2. on the bench models at 256 devices, runs the exhaustive search and the predictor's
   ``top_k`` search (same process, one after the other) and reports both wall times and
   whether they chose the same mesh.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from shardplan.api.records import WallClock, add_record_argument, save_record
from shardplan.solver.predictor import (
    HOLD_OUT,
    MODEL_FILE,
    Config,
    Predictor,
    accuracy,
    cross_validate,
    held_out_split,
    read_rows,
    refeature,
    register_training_clusters,
    retry_rejected,
    search_rows,
    training_grid,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "predictor.json"
EXHAUSTIVE = ROOT / "data" / "predictor" / "exhaustive.json"
"""The exhaustive searches' tables on the bench models (committed: tests check the predictor's
top-k against them without re-running a 256-device search)."""
TOP_K = 3
BENCH = (  # the bench models at 256 devices (two layers of each: per-layer shapes are full size)
    Config("gpt-125m", 2, 1024, 256, 256, "h100-sxm"),
    Config("llama3-8b", 2, 4096, 256, 256, "h100-sxm"),
)


def search_speedup(config: Config, top_k: int, time_limit: float) -> dict:
    """Exhaustive and predicted mesh search on one bench model: wall times and chosen mesh."""
    from shardplan.solver.mesh_search import search_mesh

    register_training_clusters()
    graph = config.graph()
    start = time.perf_counter()
    full = search_mesh(graph, config.devices, config.cluster, time_limit=time_limit)
    full_seconds = time.perf_counter() - start
    start = time.perf_counter()
    fast = search_mesh(graph, config.devices, config.cluster, time_limit=time_limit, top_k=top_k)
    fast_seconds = time.perf_counter() - start
    return dict(
        model=config.name, devices=config.devices, cluster=config.cluster,
        shapes=len(full.candidates), planned=sum(c.plan_seconds > 0 for c in fast.candidates),
        exhaustive_mesh=dict(full.mesh.axes), predicted_mesh=dict(fast.mesh.axes),
        same_mesh=dict(full.mesh.axes) == dict(fast.mesh.axes),
        exhaustive_step=full.step_time, predicted_step=fast.step_time,
        exhaustive_seconds=full_seconds, predicted_seconds=fast_seconds,
        speedup=full_seconds / fast_seconds,
        exhaustive_table=[dict(mesh=c.mesh, step_time=c.step_time) for c in full.candidates],
    )  # fmt: skip


def build(time_limit: float, resume: bool = False) -> Predictor:
    """Plan every grid configuration in full; with ``resume``, keep the model file's rows and
    plan only the configurations it lacks (planning is deterministic, so they are the same)."""
    rows = read_rows(MODEL_FILE) if resume and MODEL_FILE.exists() else []
    done = {(r.model, r.cluster, r.devices) for r in rows}
    for config in training_grid():
        if (config.name, config.cluster, config.devices) in done:
            continue
        start = time.perf_counter()
        found = search_rows(config, time_limit)
        print(f"{config.name:<28} {config.devices:>4} {config.cluster:<16} {len(found):>3} shapes"
              f" {time.perf_counter() - start:7.1f} s", flush=True)  # fmt: skip
        rows += found
        Predictor(rows).save(MODEL_FILE)  # kept as it grows: a long build can be resumed
    predictor = Predictor(rows)
    predictor.save(MODEL_FILE)
    print(f"wrote {MODEL_FILE.relative_to(ROOT)} ({len(rows)} rows)")
    return predictor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true", help="re-plan the grid, rewrite the model")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="with --build: plan only configurations not in the file",
    )
    parser.add_argument(
        "--retry-rejected",
        action="store_true",
        help="plan the file's rejected pp = 1 shapes again with 4x the time limit",
    )
    parser.add_argument(
        "--refeature",
        action="store_true",
        help="recompute the model file's features (after a feature change)",
    )
    parser.add_argument("--quick", action="store_true", help="held-out accuracy only")
    parser.add_argument("--top-k", type=int, default=TOP_K)
    parser.add_argument("--time-limit", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    add_record_argument(parser)
    args = parser.parse_args()
    clock = WallClock()
    if args.build:
        with clock("build"):
            build(args.time_limit, args.resume)
    if args.retry_rejected:
        Predictor(retry_rejected(read_rows(MODEL_FILE), 4 * args.time_limit)).save(MODEL_FILE)
    if args.refeature:
        Predictor(refeature(read_rows(MODEL_FILE))).save(MODEL_FILE)
    with clock("fit"):
        rows = read_rows(MODEL_FILE)
        cross = {by: cross_validate(rows, by) for by in HOLD_OUT}
        train, held = held_out_split(rows)
        cross["every-fourth"] = accuracy(Predictor.fit(train), held)
    for by, scores in cross.items():
        print(f"held out by {by}: {scores['configurations']} configurations, {scores['rows']} "
              f"shapes; Kendall tau mean {scores['tau_mean']:.3f} (median "
              f"{scores['tau_median']:.3f}, min {scores['tau_min']:.3f}); top-1 recall "
              f"{scores['top1_recall']:.2f}, top-5 recall {scores['top5_recall']:.2f}")  # fmt: skip
    scores = cross["family"]
    searches = []
    if not args.quick:
        head = f"{'model':<28} {'cluster':<12} {'shapes':>6} {'planned':>7} {'full s':>8} "
        head += f"{'top-k s':>8} {'speed-up':>8}  same mesh"
        print(head)
        for config in BENCH:
            with clock(f"search {config.name}"):
                r = search_speedup(config, args.top_k, args.time_limit)
            searches.append(r)
            print(f"{r['model']:<28} {r['cluster']:<12} {r['shapes']:>6} {r['planned']:>7} "
                  f"{r['exhaustive_seconds']:8.1f} {r['predicted_seconds']:8.1f} "
                  f"{r['speedup']:7.1f}x  {r['same_mesh']} {r['predicted_mesh']}")  # fmt: skip
    results = dict(top_k=args.top_k, held_out=scores, cross_validation=cross, searches=searches)
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        tables = {r["model"]: dict(devices=r["devices"], cluster=r["cluster"],
                                   mesh=r["exhaustive_mesh"], table=r["exhaustive_table"])
                  for r in searches}  # fmt: skip
        EXHAUSTIVE.write_text(json.dumps(tables, indent=1) + "\n")
    save_record(args, "predictor", results=results, wall_times=clock.total(),
                inputs=dict(bench=[c.name for c in BENCH], grid=len(training_grid())))  # fmt: skip
    assert all(math.isfinite(s["speedup"]) for s in searches)


if __name__ == "__main__":
    main()
