"""torchtitan configurations for Llama 3 (issue 40): emitted, checked, priced, searched.

Rows (torchtitan's own ``llama3_args`` on ``meta``, bf16 as FSDP2's mixed precision computes,
global batch = one 8192-token sequence per device, h100-sxm):

- ``8B`` on 64 devices and ``70B`` on 256 devices: the free plan on ``dp=W/8, tp=8``
  (``sp.plan``), its ``to_torchtitan()`` configuration (passed through torchtitan's
  ``ConfigManager``, ``ParallelDims`` and model checks) priced with ``sp.evaluate``, and the gap;
- the search over torchtitan's space (degrees x schedule x AC x micro-batches) for the same
  model and world: its size, its wall time (the issue's target: <= 10 s for 8B on 64), the
  closed-form best five, each re-priced exactly with ``sp.evaluate``, and the best pipelined
  configuration re-priced the same way (how the closed form prices torchtitan's pipelines,
  docs/torchtitan.md "Pipelines").

    .venv/bin/python bench/torchtitan_search.py            # table + bench/results/torchtitan.json
    .venv/bin/python bench/torchtitan_search.py --skip-70b
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import shardplan as sp
from shardplan.api.records import WallClock, add_record_argument, save_record
from shardplan.frontend.torch import torchtitan as tt

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = "h100-sxm"
SEQ = 8192


def row(flavor: str, world: int, exact: int, clock: WallClock) -> dict:
    with clock(f"{flavor}-capture"):
        graph, _ = tt.capture_llama(flavor, world, SEQ, mixed_precision="bfloat16")
    _, heads, kv = tt.heads(flavor)
    start = time.perf_counter()
    search = sp.search_torchtitan(graph, world, heads, kv, cluster=CLUSTER, flavor=flavor)
    search_seconds = time.perf_counter() - start
    with clock(f"{flavor}-free-plan"):
        mesh = sp.Mesh({"dp": world // 8, "tp": 8}, cluster=CLUSTER)
        plan = sp.plan(graph, mesh=mesh, prefer="throughput")
    with clock(f"{flavor}-to-torchtitan"):
        emission = plan.to_torchtitan(flavor=flavor)
        tt.check(emission.config, world)  # torchtitan's parsing, ParallelDims, model checks
    fitting = [p for p in search.ranked if p.fits]
    pipelined = [p for p in fitting if p.config.pp > 1][:1]
    with clock(f"{flavor}-exact-top"):
        best = [_exact(graph, priced, search) for priced in fitting[:exact]]
    with clock(f"{flavor}-exact-pipelined"):
        best_pp = [_exact(graph, priced, search) for priced in pipelined]
    search.free_step = plan.step_time
    print(f"\n== Llama-3-{flavor} on {world} devices ({world} x {SEQ} tokens) ==")
    print(emission.report())
    print(f"search: {len(search.ranked)} configurations ranked in {search_seconds:.2f} s")
    print(search.table(10))
    return {
        "model": flavor, "world": world, "free_plan_ms": plan.step_time * 1e3,
        "free_plan_mesh": dict(mesh.axes), "emitted": emission.config.label(),
        "emitted_overrides": emission.overrides, "emitted_ms": (emission.titan_step or 0) * 1e3,
        "gap": emission.gap, "differences": emission.differences,
        "search_configs": len(search.ranked), "search_seconds": search_seconds,
        "search_best": best, "search_best_pipelined": best_pp,
    }  # fmt: skip


def _exact(graph, priced, search) -> dict:  # type: ignore[no-untyped-def]
    """One closed-form row re-priced with ``sp.evaluate`` (recorded in the search's table)."""
    c = priced.config
    ev = sp.evaluate(graph, mesh=c.mesh(CLUSTER), strategy=c.strategy())
    search.exact[c.label()] = ev.step_time
    print(
        f"  {c.label()}: closed form {priced.step_time * 1e3:.1f} ms "
        f"{priced.memory_bytes / 2**30:.1f} GiB, evaluate {ev.step_time * 1e3:.1f} ms "
        f"{ev.peak_memory_bytes / 2**30:.1f} GiB{'' if ev.fits else ' (does not fit)'}"
    )
    return {"config": c.label(), "closed_form_ms": priced.step_time * 1e3,
            "closed_form_gib": priced.memory_bytes / 2**30, "evaluate_ms": ev.step_time * 1e3,
            "evaluate_gib": ev.peak_memory_bytes / 2**30, "fits": ev.fits,
            "overrides": c.overrides()}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-70b", action="store_true")
    parser.add_argument("--exact", type=int, default=5, help="best configurations re-priced")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "torchtitan.json")
    add_record_argument(parser)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    clock = WallClock()
    rows = [row("8B", 64, args.exact, clock)]
    if not args.skip_70b:
        rows.append(row("70B", 256, args.exact, clock))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    save_record(args, "torchtitan", results=rows, wall_times=clock.total())


if __name__ == "__main__":
    main()
