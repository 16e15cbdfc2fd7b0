"""Context parallelism at Llama-3-8B scale (issue 22): does the planner split the sequence?

Llama-3-8B shapes (bf16, 32 layers) on ``Mesh({"dp": 8, "tp": 8}, cluster="h100-sxm")``: one
sequence of 131,072 tokens (context parallelism should pay) and 64 sequences of 8,192 (it
should not). For each: the planned step, whether attention's query sequence is split and on
which axis, and the hand-written Megatron strategy with ``cp`` under the same cost model.

    .venv/bin/python bench/context_parallel.py                  # torch capture (HF LlamaConfig)
    .venv/bin/python bench/context_parallel.py --source ir      # the IR builder (seconds)
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

from shardplan.api.records import WallClock, add_record_argument, save_record

ROOT = Path(__file__).resolve().parents[1]
CASES = (("long", 1, 131072), ("batch", 64, 8192))


def model_and_args(source: str, batch: int, seq: int, layers: int):  # type: ignore[no-untyped-def]
    """The Llama-3-8B training step: captured from HF on meta, or built in the IR."""
    if source == "ir":
        from shardplan.ir.models import LLAMA3_8B, training_step

        return training_step(LLAMA3_8B, batch=batch, layers=layers, seq=seq), ()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=seq,
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.empty((batch, seq), dtype=torch.long, device="meta")
    return model, ({"input_ids": ids, "labels": ids},)


def query_split_axes(plan) -> list[str]:  # type: ignore[no-untyped-def]
    """Mesh axes attention's query sequence is split over (empty: no context parallelism)."""
    axes: set[str] = set()
    for i, op in enumerate(plan.graph.ops):
        if op.kind in ("attention", "attention_backward"):
            q = plan.operand_shardings[(i, 1 if op.kind == "attention_backward" else 0)]
            axes.update(q.dims[2])
    return sorted(axes)


def run_case(source: str, name: str, batch: int, seq: int, layers: int) -> dict:
    import shardplan as sp

    mesh = sp.Mesh({"dp": 8, "tp": 8}, cluster="h100-sxm")
    start = time.perf_counter()
    model, args = model_and_args(source, batch, seq, layers)
    plan = sp.plan(model, *args, mesh=mesh)
    planned = time.perf_counter() - start
    row = dict(
        case=name, source=source, batch=batch, seq=seq, layers=layers, plan_s=planned,
        step_s=plan.step_time, peak_gib=plan.peak_memory_bytes / 2**30,
        status=plan.solver.status, cp_axes=query_split_axes(plan),
    )  # fmt: skip
    hand = sp.strategies.megatron(tp="tp", cp="dp", dp=(), recompute=None)
    ev = sp.evaluate(plan.graph, mesh=mesh, strategy=hand)
    row["megatron_cp_step_s"] = ev.step_time
    row["contiguous_step_s"] = contiguous_step(plan.graph, mesh) if row["cp_axes"] else None
    return row


def contiguous_step(graph, mesh) -> float:  # type: ignore[no-untyped-def]
    """The step replanned with attention priced for contiguous (unbalanced) query chunks, as
    this repository's emitters run them (the default prices head-tail balanced chunks)."""
    import shardplan as sp

    for op in graph.ops:
        if op.kind in ("attention", "attention_backward"):
            op.attrs["load_balance"] = False
    try:
        return sp.plan(graph, mesh=mesh).step_time
    finally:
        for op in graph.ops:
            op.attrs.pop("load_balance", None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--source", choices=("torch", "ir"), default="torch")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--case", choices=[c[0] for c in CASES])
    add_record_argument(parser)
    args = parser.parse_args()
    clock = WallClock()
    warnings.simplefilter("ignore")
    rows = [
        run_case(args.source, name, batch, seq, args.layers)
        for name, batch, seq in CASES
        if args.case in (None, name)
    ]
    print(f"{'case':6} {'batch x seq':>12} {'plan s':>7} {'step s':>7} {'peak GiB':>8} "
          f"{'CP axes':>8} {'megatron+cp step s':>19} {'contiguous step s':>18}")  # fmt: skip
    for r in rows:
        print(
            f"{r['case']:6} {r['batch']:>4} x {r['seq']:<6} {r['plan_s']:7.1f} {r['step_s']:7.3f} "
            f"{r['peak_gib']:8.1f} {','.join(r['cp_axes']) or '-':>8} "
            f"{r['megatron_cp_step_s']:19.3f} "
            + (f"{r['contiguous_step_s']:18.3f}" if r["contiguous_step_s"] else f"{'-':>18}")
        )
    out = ROOT / "bench" / "results" / f"context_parallel_{args.source}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    cases = [dict(zip(("case", "batch", "seq"), c, strict=True)) for c in CASES]
    save_record(args, "context_parallel", results=rows, wall_times=clock.total(),
                inputs={"cases": cases})  # fmt: skip


if __name__ == "__main__":
    main()
