"""Measured serving steps on one GPU: prefill and decode of an HF Llama with a static KV cache.

Ground truth for inference planning (issue 19): Llama-3-8B layer shapes (bf16, random weights,
``--layers`` layers, GQA 32/8 heads), a ``StaticCache`` of ``context`` tokens, then

- prefill: one forward of ``batch x prompt`` tokens filling the cache;
- decode: one forward of ``batch x 1`` tokens at position ``context - 1``, timed eager and as a
  CUDA-graph replay (what serving engines run; eager decode is host-launch bound).

Also a tiny Mixtral training step (eager experts), ground truth for MoE pricing (issue 18).

    python bench/serve_gpu.py --out data/calibration/h100-sxm-serving.json
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

from shardplan.api.records import WallClock, add_record_argument, save_record

DECODE = [(1, 4096), (16, 4096), (64, 4096), (64, 1024), (8, 32768)]  # (batch, context)
PREFILL = [(1, 2048), (1, 8192), (8, 2048)]  # (batch, prompt)
LLAMA = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
             num_attention_heads=32, num_key_value_heads=8)  # fmt: skip
MIXTRAL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=4,
               num_attention_heads=16, num_key_value_heads=4, num_local_experts=8,
               num_experts_per_tok=2)  # fmt: skip


def _events_time(fn, iters: int) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def llama(layers: int, max_len: int):  # type: ignore[no-untyped-def]
    import torch
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=layers, max_position_embeddings=max_len,
                                      **LLAMA)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()


def measure_decode(model, batch: int, context: int, iters: int) -> dict:  # type: ignore[no-untyped-def]
    import torch
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=context)
    ids = torch.randint(0, 1000, (batch, 1), device="cuda")
    position = torch.tensor([context - 1], device="cuda")

    def step() -> None:
        model(input_ids=ids, past_key_values=cache, cache_position=position, use_cache=True)

    with torch.no_grad():
        eager = _events_time(step, iters)
        graph_seconds = None
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            graph_seconds = _events_time(graph.replay, iters)
        except Exception as exc:
            print(f"decode b{batch} ctx{context}: no CUDA graph ({type(exc).__name__}: {exc})")
    kv_bytes = 2 * model.config.num_hidden_layers * 8 * 128 * context * batch * 2
    return {"batch": batch, "context": context, "eager_seconds": eager,
            "graph_seconds": graph_seconds, "kv_cache_bytes": kv_bytes}  # fmt: skip


def measure_prefill(model, batch: int, prompt: int, iters: int) -> dict:  # type: ignore[no-untyped-def]
    """The prompt's forward (causal flash attention), last position's logits only. Run without a
    cache object: HF's static-cache prefill passes an explicit mask that the fused kernels
    reject on this build; writing K/V into a cache adds only a copy of the cache bytes."""
    import torch

    ids = torch.randint(0, 1000, (batch, prompt), device="cuda")

    def step() -> None:
        model(input_ids=ids, use_cache=False, logits_to_keep=1)

    with torch.no_grad():
        return {"batch": batch, "prompt": prompt, "seconds": _events_time(step, iters)}


def measure_mixtral(iters: int, batch: int = 8, seq: int = 1024) -> dict:
    import torch
    import transformers

    config = transformers.MixtralConfig(max_position_embeddings=seq, **MIXTRAL)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, MIXTRAL["vocab_size"], (batch, seq), device="cuda")

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return {"config": MIXTRAL, "batch": batch, "seq": seq,
            "step_seconds": _events_time(step, iters)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    import torch
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("serving.json"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iters", type=int, default=10)
    add_record_argument(parser)
    args = parser.parse_args(argv)
    clock = WallClock()
    out = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
           "torch": torch.__version__, "transformers": transformers.__version__,
           "llama": {**LLAMA, "num_hidden_layers": args.layers},
           "decode": [], "prefill": []}  # fmt: skip
    model = llama(args.layers, 32768)
    for batch, context in DECODE:
        row = measure_decode(model, batch, context, args.iters)
        out["decode"].append(row)
        print(f"decode b{batch} ctx{context}: eager {row['eager_seconds'] * 1e3:.2f} ms, graph "
              f"{(row['graph_seconds'] or 0) * 1e3:.2f} ms", flush=True)  # fmt: skip
        torch.cuda.empty_cache()
    for batch, prompt in PREFILL:
        row = measure_prefill(model, batch, prompt, args.iters)
        out["prefill"].append(row)
        print(f"prefill b{batch} x {prompt}: {row['seconds'] * 1e3:.2f} ms", flush=True)
        torch.cuda.empty_cache()
    del model
    torch.cuda.empty_cache()
    try:
        out["mixtral_train"] = measure_mixtral(args.iters)
        print(f"mixtral step: {out['mixtral_train']['step_seconds'] * 1e3:.1f} ms", flush=True)
    except Exception as exc:
        print(f"mixtral: {type(exc).__name__}: {exc}")
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    save_record(args, "serve_gpu", results=out, wall_times=clock.total())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
