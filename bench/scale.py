"""Planning time and memory at model scale (issue 7): Llama-3-8B shapes, 1..32 layers.

Each configuration runs in its own subprocess so its peak resident memory is its own. For each
one: how the graph is obtained (``ir``: the framework-free training-step builder in
``shardplan.ir.models``; ``torch``: make_fx capture of a HF ``LlamaForCausalLM`` on the meta
device), then the planner's phases (``plan.timings``) and the total wall time.

    .venv/bin/python bench/scale.py                 # table + bench/results/scale.json
    .venv/bin/python bench/scale.py --quick         # fewer rows
    .venv/bin/python bench/scale.py --memory        # the memory-bound rows only (issue 15)
    .venv/bin/python bench/scale.py --quick --record run.json   # + a benchmark record

Memory-bound rows (issue 15): HF Llama shapes where the 80 GB limit binds (Llama-3-70B in bf16,
80 layers; Llama-3-8B left in float32, 32 layers), 16 x 8192 tokens on dp=8 x tp=8, and a
Llama-3-405B shape (126 layers, hidden 16384, 128/8 heads, ffn 53248) on pp=8 x dp=2 x tp=8: the
``sp.plan`` call (capture included; wall and CPU seconds), the solver status and gap, the plan's
step and peak, and the best fitting hand-written strategy (``evaluate.best_baseline``) priced
by the same cost model. Latest (``sp.plan`` alone, the shared 2-core box at load 3-5; see
docs/design.md, "Made cheap"): 8B f32 38.6 s wall / 25.5 s CPU, gap 1.05%, 2647.0 ms (was
137.7 / 105.4 s back to back); 70B bf16 111 / 99 s, gap 9.5%, 3001.4 ms (was 324 / 171 s);
405B on pp 8 x dp 2 x tp 8 (first run) 510 / 329 s, gap 8.7%, 11922.6 ms, full recomputation,
reported peak 356 GiB: that was ``plan.peak_memory_bytes``, the sub-mesh solve's view of the
whole model under 8 x the budget; the row now reports the fullest stage's peak, as ``print(plan)``
and ``sp.evaluate`` do (not re-run since). With the primal heuristic (``solver/recompute.py``,
``sp.plan`` with capture, back to back at load 2.4-3.8): 70B 107.3 -> 39.7 s, 3001.4 -> 2744.3
ms, gap 9.5% -> 1.67%; 8B f32 19.0 -> 11.7 s, same plan (2647.0 ms, 1.05%). With the seed's
pricing and the Lagrangian bound made cheap (docs/design.md, "The 70B row's pricing and bound
made cheap"; wall / CPU s with capture, back to back at load 2.4-6.5): 70B 64.4 / 31.3 -> 20.8 /
16.6 s, the same 2744.3 ms plan at gap 1.78% (bound 2.9154 s, was 2.9187 s); 8B f32 18.5 / 13.8
-> 15.1 / 10.0 s, the same plan. Each row also reports ``trade``, the plan summary's memory
trade (recomputed layers, sharded states, headroom). The 405B-shaped row with each cap's
sub-mesh solve seeded from its LP (``solver/pipeline.py``, back to back at load
3-8): 580.5 s wall / 306.1 CPU s -> 213-301 / 152-171 s, gap 8.7% -> 3.4%, 11922.6 -> 11134.2 ms
(87 layers full, 39 selective); without CP-SAT's capped search after each cap's seed (it found
no plan there), back to back with main at load ~5.5: 291.0 / 122.7 s -> 143.1 / 73.5 s, the same
plan; the 60 s target is not met (docs/design.md "Pipelines"). Since batch factors are sized
per micro-batch under a cap (2026-11-27) its first cap's LP seed does not fit in that space, so
the cap gives up at once and is solved again at whole-batch sizes: the same plan (11134.2 ms,
gap 2.2%), 32.0 s wall / 31.3 CPU s (39.8 / 26.8 just before, at another load). On the idle VM
(2026-11-27, one row per fresh process): 405B 31.9 s, 70B 9.5 s, 8B f32 5.8 s: every target met.
Re-measured from an export of main at 077d57c (load 5-6): 70B 48.3 s wall / 19.9 s CPU, 8B f32
23.6 / 9.4 s, the same plans; the seed-plan reuse since is within noise (docs/design.md, "Where
the 70B call's seconds go").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from shardplan.api.records import WallClock, add_record_argument, save_record

ROOT = Path(__file__).resolve().parents[1]
LLAMA3_8B = dict(dim=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, seq=8192)

CHILD = r"""
import json, resource, sys, time, warnings
warnings.simplefilter("ignore")
source, layers, mesh_text, per_dp = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
import shardplan as sp
axes = dict((k, int(v)) for k, v in (p.split("=") for p in mesh_text.split(",")))
dp = axes.get("dp", axes.get("x", 1)) if "dp" in axes else 1
batch = per_dp * max(dp, 1)
start = time.perf_counter()
if source == "ir":
    from shardplan.ir.models import LLAMA3_8B, training_step
    model = training_step(LLAMA3_8B, batch=batch, layers=layers)
    args = ()
else:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=8192)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)  # bf16 weights, fp32 AdamW moments
    ids = torch.empty((batch, 8192), dtype=torch.long, device="meta")
    args = ({"input_ids": ids, "labels": ids},)
built = time.perf_counter() - start
plan = sp.plan(model, *args, mesh=sp.Mesh(axes, cluster="h100-sxm"))
total = time.perf_counter() - start
print(json.dumps(dict(source=source, layers=layers, mesh=mesh_text, batch=batch,
    ops=len(plan.graph.ops), build=built, total=total, plan=total - built, timings=plan.timings,
    choices=plan.solver.num_choices, status=plan.solver.status,
    step_ms=plan.step_time * 1e3, peak_gib=plan.peak_memory_bytes / 2**30,
    rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)))
"""


MEMORY_CHILD = r"""
import json, resource, sys, time, warnings
warnings.simplefilter("ignore")
name = sys.argv[1]
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import shardplan as sp
from shardplan.api.evaluate import best_baseline
from shardplan.solver.summary import memory_trade, strategy_words
shapes = {
    "70b-bf16": (dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8), torch.bfloat16, {"dp": 8, "tp": 8}),
    "8b-f32": (dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8), torch.float32, {"dp": 8, "tp": 8}),
    "405b-pp": (dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
        num_attention_heads=128, num_key_value_heads=8), torch.bfloat16,
        {"pp": 8, "dp": 2, "tp": 8}),
}
shape, dtype, axes = shapes[name]
config = LlamaConfig(vocab_size=128256, max_position_embeddings=8192, **shape)
with torch.device("meta"):
    model = LlamaForCausalLM(config).to(dtype)
ids = torch.empty((16, 8192), dtype=torch.long, device="meta")
mesh = sp.Mesh(axes, cluster="h100-sxm")
wall, cpu = time.perf_counter(), time.process_time()
plan = sp.plan(model, {"input_ids": ids, "labels": ids}, mesh=mesh)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
s = plan.solver
gap = (s.objective - s.bound) / s.objective if s.objective > 0 else 0.0
base = best_baseline(plan.graph, mesh) if "pp" not in axes else None
stages = plan.pipeline.stages if plan.pipeline is not None else ()
peak = max(s.memory_bytes for s in stages) if stages else plan.peak_memory_bytes  # per device
print(json.dumps(dict(name=name, plan_s=wall, plan_cpu_s=cpu, status=s.status, gap=gap,
    seed=s.fallback or None, timings=plan.timings,
    step_ms=plan.step_time * 1e3, peak_gib=peak / 2**30,
    strategy=strategy_words(plan), trade=memory_trade(plan),
    recompute={m: list(plan.recompute.values()).count(m) for m in set(plan.recompute.values())},
    baseline=base[0] if base else None, baseline_step_ms=base[1].step_time * 1e3 if base else None,
    rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)))
"""
MEMORY_ROWS = ("70b-bf16", "8b-f32", "405b-pp")


def run_memory(name: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", MEMORY_CHILD, name], capture_output=True, text=True, cwd=ROOT,
        timeout=1800,
    )  # fmt: skip
    if out.returncode:
        return dict(name=name, error=out.stderr.strip()[-300:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory_table(rows: list[dict]) -> str:
    head = f"{'model':9} {'plan s':>7} {'cpu s':>6} {'status':>9} {'gap':>6} {'step ms':>8} "
    head += f"{'peak GiB':>8} {'RSS MB':>7} {'baseline':>22} {'its ms':>8}  plan"
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name']:9} error: {r['error']}")
            continue
        base = f"{r['baseline_step_ms']:8.1f}" if r["baseline_step_ms"] else f"{'-':>8}"
        lines.append(
            f"{r['name']:9} {r['plan_s']:7.1f} {r['plan_cpu_s']:6.1f} {r['status']:>9} "
            f"{r['gap'] * 100:5.1f}% {r['step_ms']:8.1f} {r['peak_gib']:8.1f} {r['rss_mb']:7.0f} "
            f"{r['baseline']!s:>22} {base}  {r['strategy']}"
        )
    return "\n".join(lines)


def run(source: str, layers: int, mesh: str, per_dp: int = 2) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, source, str(layers), mesh, str(per_dp)],
        capture_output=True, text=True, cwd=ROOT, timeout=900,
    )  # fmt: skip
    if out.returncode:
        return dict(source=source, layers=layers, mesh=mesh, error=out.stderr.strip()[-300:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    head = f"{'graph':6} {'layers':>6} {'mesh':>10} {'ops':>6} {'capture':>8} {'price':>6} "
    head += f"{'shrink':>7} {'solve':>6} {'plan s':>7} {'total s':>8} {'RSS MB':>7} {'step ms':>8}"
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['source']:6} {r['layers']:>6} {r['mesh']:>10}  error: {r['error']}")
            continue
        t = r["timings"]
        capture = t.get("capture", r["build"])
        lines.append(
            f"{r['source']:6} {r['layers']:>6} {r['mesh']:>10} {r['ops']:>6} {capture:8.2f} "
            f"{t.get('price', 0):6.2f} {t.get('shrink', 0):7.2f} {t.get('solve', 0):6.2f} "
            f"{_plan_seconds(r):7.2f} {r['total']:8.2f} {r['rss_mb']:7.0f} {r['step_ms']:8.1f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sources", default="ir,torch")
    parser.add_argument("--memory", action="store_true", help="only the memory-bound rows")
    parser.add_argument("--rows", default=",".join(MEMORY_ROWS), help="memory-bound rows to run")
    parser.add_argument("--layers", help="layer counts, e.g. 1,4 (default: by --quick)")
    parser.add_argument("--meshes", default="dp=8,tp=8;dp=64", help="meshes, ';'-separated")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="results dir")
    add_record_argument(parser)
    args = parser.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    clock = WallClock()
    if args.memory:
        with clock("rows"):
            memory_rows = [run_memory(name) for name in args.rows.split(",")]
        print(memory_table(memory_rows))
        (out / "scale_memory.json").write_text(json.dumps(memory_rows, indent=2, sort_keys=True))
        inputs = {"rows": args.rows.split(","), "cluster": "h100-sxm"}
        save_record(args, "scale-memory", inputs=inputs, results=memory_rows,
                    wall_times=clock.total())  # fmt: skip
        return
    layer_counts = [1, 4, 32] if args.quick else [1, 4, 8, 16, 32]
    if args.layers:
        layer_counts = [int(n) for n in args.layers.split(",")]
    meshes = args.meshes.split(";")
    rows = []
    for source in args.sources.split(","):
        for mesh in meshes:
            for layers in layer_counts:
                if source == "torch" and mesh == "dp=64" and layers > 4:
                    continue  # torch capture dominates; one mesh shows its scaling
                name = f"{source} L={layers} {mesh}"
                with clock(name):
                    rows.append(run(source, layers, mesh))
                print(f"  {name}: {clock.times[name]:.1f} s", file=sys.stderr)
    text = table(rows)
    print(text)
    (out / "scale.json").write_text(json.dumps(rows, indent=2, sort_keys=True))
    inputs = {
        "model": LLAMA3_8B, "sources": args.sources.split(","), "layers": layer_counts,
        "meshes": meshes, "cluster": "h100-sxm", "per_dp_batch": 2,
    }  # fmt: skip
    save_record(args, "scale", inputs=inputs, results=rows, wall_times=clock.total())
    for source in args.sources.split(","):
        ratio = _ratio(rows, source, "dp=8,tp=8")
        if ratio:
            print(f"{source} on (8,8): 32 layers plan in {ratio:.2f}x the time of 4 layers")


def _plan_seconds(row: dict) -> float:
    """The planning call's wall time: for the builder, building the graph is its capture."""
    return row["total"] if row["source"] == "ir" else row["plan"]


def _ratio(rows: list[dict], source: str, mesh: str) -> float | None:
    by_layers = {
        r["layers"]: _plan_seconds(r)
        for r in rows
        if r.get("source") == source and r.get("mesh") == mesh and "total" in r
    }
    if 4 in by_layers and 32 in by_layers:
        return by_layers[32] / by_layers[4]
    return None


if __name__ == "__main__":
    main()
