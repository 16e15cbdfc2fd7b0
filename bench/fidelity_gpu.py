"""The product's predicted step time against training steps measured on one H100.

``bench/step_gpu.py`` measured forward + backward + AdamW of small HF models on one H100 SXM
(``data/calibration/h100-sxm-steps.json``). This script captures the same models on ``meta`` and
prices them with ``sp.evaluate(model, ..., strategy=sp.strategies.dp())`` on a one-device mesh,
with the shipped calibration (``h100-sxm``) and with the calibration fitted to the kernel sweep
(``data/calibration/h100-sxm-measured.json``), and prints predicted / measured - 1 against the
eager step and the ``torch.compile``'d one (fused elementwise kernels, as the cost model
assumes).

    .venv/bin/python bench/fidelity_gpu.py [--case NAME] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from shardplan.api.records import WallClock, add_record_argument, save_record

ROOT = Path(__file__).resolve().parents[1]
STEPS = ROOT / "data" / "calibration" / "h100-sxm-steps.json"
FITTED = ROOT / "data" / "calibration" / "h100-sxm-measured.json"


def fitted_cluster() -> str:
    """Register the catalogue H100 with the measured calibration applied; return its name."""
    from shardplan.costmodel.calibration import apply, load_calibration
    from shardplan.costmodel.cluster import register_cluster

    cluster = apply(load_calibration(FITTED), "h100-sxm")
    register_cluster(cluster)
    return cluster.name


def predict(row: dict, cluster: str) -> float:
    """``sp.evaluate``'s step time of a measured case, captured from HF on ``meta``."""
    import shardplan as sp
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from step_gpu import build

    with torch.device("meta"):
        model = build(row["family"], row["config"], row["seq"]).to(torch.bfloat16)
    ids = torch.empty((row["batch"], row["seq"]), dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = sp.evaluate(
            model,
            {"input_ids": ids, "labels": ids},
            mesh=sp.Mesh({"dp": 1}, cluster=cluster),
            strategy=sp.strategies.dp(),
        )
    return result.step_time


def compare(names: list[str] | None = None) -> list[dict]:
    data = json.loads(STEPS.read_text())
    clusters = {"shipped": "h100-sxm", "fitted": fitted_cluster()}
    rows = []
    measured = {(s["name"], s.get("compiled", False)): s for s in data["steps"]}
    for (name, compiled), step in measured.items():
        if compiled or (names and name not in names):
            continue
        row = {"name": name, "eager": step["step_seconds"]}
        if (name, True) in measured:
            row["compiled"] = measured[name, True]["step_seconds"]
        for label, cluster in clusters.items():
            row[label] = predict(step, cluster)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append")
    parser.add_argument("--json", type=Path)
    add_record_argument(parser)
    args = parser.parse_args(argv)
    clock = WallClock()
    rows = compare(args.case)
    print("predicted / measured - 1 against eager and torch.compile'd steps on one H100")
    print(f"{'case':<18}{'eager ms':>9}{'compiled':>9}{'shipped':>9}{'vs eager':>9}"
          f"{'vs comp.':>9}{'fitted':>9}{'vs eager':>9}{'vs comp.':>9}")  # fmt: skip
    for r in rows:
        line = f"{r['name']:<18}{r['eager'] * 1e3:>9.1f}{r.get('compiled', 0) * 1e3:>9.1f}"
        for label in ("shipped", "fitted"):
            line += f"{r[label] * 1e3:>9.1f}{r[label] / r['eager'] - 1:>+9.1%}"
            line += f"{r[label] / r['compiled'] - 1:>+9.1%}" if "compiled" in r else f"{'':>9}"
        print(line)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    save_record(args, "fidelity_gpu", results=rows, wall_times=clock.total())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
