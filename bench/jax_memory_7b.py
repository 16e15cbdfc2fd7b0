"""Peak resident memory of planning a 7B-shaped GPT step from ShapeDtypeStructs (issue 3,
acceptance 5: under 1 GB).

Usage: ``python bench/jax_memory_7b.py [--layers 32] [--mesh 8 8] [--time-limit 60]``.
Prints the phases' peak RSS and writes ``bench/results/jax_memory_7b.json``.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import jax_gpt  # noqa: E402
import shardplan as sp  # noqa: E402
from shardplan.api.records import WallClock, add_record_argument, save_record  # noqa: E402
from shardplan.frontend.jax.capture import capture  # noqa: E402

LLAMA_7B = dict(vocab=32000, d_model=4096, n_heads=32, d_ff=11008, seq=4096, batch=8)


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--mesh", type=int, nargs="+", default=[8, 8])
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--dtype", default="bfloat16")
    add_record_argument(parser)
    ns = parser.parse_args()
    clock = WallClock()
    config = jax_gpt.GPTConfig(n_layers=ns.layers, scan_layers=True, dtype=ns.dtype, **LLAMA_7B)
    step, args = jax_gpt.make(config, abstract=True)
    result: dict[str, float | int | str] = {"start_mib": peak_mib()}
    start = time.perf_counter()
    graph, _ = capture(step, *args)
    result.update(ops=len(graph.ops), capture_s=time.perf_counter() - start, capture_mib=peak_mib())
    mesh = sp.Mesh(dict(zip(("dp", "tp"), ns.mesh, strict=False)), cluster="h100-sxm")
    start = time.perf_counter()
    plan = sp.plan(step, *args, mesh=mesh, time_limit=ns.time_limit)
    result.update(
        plan_s=time.perf_counter() - start, peak_mib=peak_mib(), status=plan.solver.status
    )
    for key, value in result.items():
        print(f"{key:>12}: {value:.1f}" if isinstance(value, float) else f"{key:>12}: {value}")
    out = ROOT / "bench" / "results" / "jax_memory_7b.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"layers": ns.layers, "mesh": ns.mesh, **result}, indent=2))
    save_record(ns, "jax_memory_7b", results=result, wall_times=clock.total(),
                inputs={"model": LLAMA_7B, "cluster": "h100-sxm"})  # fmt: skip


if __name__ == "__main__":
    main()
