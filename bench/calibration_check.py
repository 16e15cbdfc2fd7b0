"""How well the cost model reproduces kernel times measured on a GPU.

Reads the raw sweep ``bench/microbench_gpu.py --full`` wrote (committed for one H100 SXM in
``data/calibration/h100-sxm-measured-raw.json``), fits a ``Calibration`` from it, and prices every
measured kernel three ways:

- ``shipped``: the product's roofline (``costmodel.compute.compute_time``) on the catalogue
  cluster with the shipped calibration (``DEFAULTS``, sourced priors) applied;
- ``fitted``: the same roofline with the fitted calibration applied;
- ``curve``: the fitted calibration's size curve (``Calibration.matmul_time``), GEMMs only.

It prints the median and worst relative error per kernel class and writes the rows as JSON.

    .venv/bin/python bench/calibration_check.py [--raw FILE] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from shardplan.api.records import WallClock, add_record_argument, save_record
from shardplan.costmodel.calibration import DEFAULTS, apply, fit, gpu_seconds
from shardplan.costmodel.cluster import get_cluster
from shardplan.costmodel.compute import compute_time

ROOT = Path(__file__).resolve().parents[1]
RAW = ROOT / "data" / "calibration" / "h100-sxm-measured-raw.json"
L2_BYTES = 50e6  # H100 SXM L2: a weight this small stays cached across graph replays


def kernels(raw: dict) -> list[dict]:
    """Every measured kernel as ``{class, name, flops, bytes, dtype, measured}``."""
    out = []
    for r in raw.get("matmul", []):
        size = {"bf16": 2, "f16": 2, "tf32": 4, "f32": 4}[r["dtype"]]
        nbytes = size * (r["m"] * r["k"] + r["k"] * r["n"] + r["m"] * r["n"])
        out.append({"class": "gemm " + r["dtype"], "name": f"{r['m']}x{r['n']}x{r['k']}",
                    "flops": r["flops"], "bytes": nbytes, "dtype": r["dtype"],
                    "measured": gpu_seconds(r)})  # fmt: skip
    for r in raw.get("gemv", []):
        if r["weight_bytes"] < L2_BYTES:
            continue
        nbytes = r["weight_bytes"] + 2 * r["m"] * (r["k"] + r["n"])
        out.append({"class": "decode gemm", "name": f"{r['m']}x{r['n']}x{r['k']}",
                    "flops": r["flops"], "bytes": nbytes, "dtype": "bf16",
                    "measured": gpu_seconds(r)})  # fmt: skip
    for r in raw.get("attention_decode", []):
        out.append({"class": "decode attention", "name": f"b{r['batch']} ctx{r['context']}",
                    "flops": 4.0 * r["batch"] * r["heads"] * r["context"] * r["head_dim"],
                    "bytes": r["kv_bytes"], "dtype": "bf16",
                    "measured": gpu_seconds(r)})  # fmt: skip
    for r in raw.get("grouped_gemm", []):
        tokens = r["experts"] * r["tokens_per_expert"]
        nbytes = r["weight_bytes"] + 2 * tokens * (r["hidden"] + r["ffn"])
        name = f"E{r['experts']} t{r['tokens_per_expert']} {r['hidden']}x{r['ffn']}"
        out.append({"class": "moe bmm", "name": name, "flops": r["flops"], "bytes": nbytes,
                    "dtype": "bf16",
                    "measured": float(r["bmm_graph_seconds"] or r["bmm_seconds"])})  # fmt: skip
    for r in raw.get("elementwise", []):
        out.append({"class": "elementwise", "name": f"{r['op']} {r['tokens']}x{r['hidden']}",
                    "flops": 0.0, "bytes": r["bytes"], "dtype": "bf16",
                    "measured": gpu_seconds(r)})  # fmt: skip
    for r in raw.get("attention_train", []):
        if r["causal"]:
            name = f"b{r['batch']} h{r['heads']} s{r['seq']} d{r['head_dim']}"
            out.append({"class": "attention fwd+bwd", "name": name,
                        "flops": r["fwd_bwd_flops"], "bytes": 0.0, "dtype": "bf16",
                        "measured": float(r["fwd_bwd_seconds"]), "attention": True})  # fmt: skip
    return out


def price(kernel: dict, cluster, calibration=None) -> float:
    if kernel.get("attention"):
        return kernel["flops"] / (cluster.peak("bf16") * cluster.fused_attention_efficiency)
    if calibration is not None:
        return calibration.matmul_time(kernel["flops"], kernel["bytes"], kernel["dtype"], cluster)
    return compute_time(kernel["flops"], kernel["bytes"], kernel["dtype"], cluster)


def check(raw: dict) -> dict:
    """Rows with the three predictions and a per-class error summary."""
    base = get_cluster(raw.get("cluster", "h100-sxm"))
    fitted = fit(raw, base)
    shipped_cluster = apply(DEFAULTS.get(base.name, fitted), base)
    fitted_cluster = apply(fitted, base)
    rows = []
    for k in kernels(raw):
        row = dict(k)
        row["shipped"] = price(k, shipped_cluster)
        row["fitted"] = price(k, fitted_cluster)
        if k["class"].startswith("gemm"):
            row["curve"] = price(k, fitted_cluster, fitted)
        rows.append(row)
    summary = {}
    for cls in dict.fromkeys(r["class"] for r in rows):
        sel = [r for r in rows if r["class"] == cls]
        summary[cls] = {"n": len(sel)}
        for key in ("shipped", "fitted", "curve"):
            errs = [r[key] / r["measured"] - 1 for r in sel if key in r]
            if errs:
                worst = max(errs, key=abs)
                summary[cls][key] = {
                    "median_abs": statistics.median(map(abs, errs)),
                    "worst": worst,
                }
    return {"device": raw.get("device"), "date": raw.get("date"),
            "fitted": json.loads(fitted.to_json()), "summary": summary, "rows": rows}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--raw", type=Path, default=RAW)
    parser.add_argument("--json", type=Path)
    add_record_argument(parser)
    args = parser.parse_args(argv)
    clock = WallClock()
    result = check(json.loads(args.raw.read_text()))
    print(f"{result['device']} ({result['date']}): predicted / measured - 1, median |err| (worst)")
    print(f"{'class':<20}{'n':>4}  {'shipped':>18}  {'fitted':>18}  {'size curve':>18}")
    for cls, s in result["summary"].items():
        cells = [
            f"{s[k]['median_abs']:>7.1%} ({s[k]['worst']:+7.1%})" if k in s else f"{'':>18}"
            for k in ("shipped", "fitted", "curve")
        ]
        print(f"{cls:<20}{s['n']:>4}  " + "  ".join(cells))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    save_record(args, "calibration_check", results=result, wall_times=clock.total())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
