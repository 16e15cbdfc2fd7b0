"""Measured training steps of small HF models on one GPU: ground truth for the cost model.

Each case builds an HF causal LM from a config (random weights, bf16, SDPA attention), then times
forward + backward + AdamW step (median of ``--iters`` steps after warm-up, CUDA events) and the
peak allocated memory; with ``--compile`` also the ``torch.compile``'d forward (fused
elementwise kernels, as the cost model assumes). ``bench/fidelity_gpu.py`` prices the same
cases with ``sp.evaluate`` and compares. Runs where a GPU is (no shardplan import needed there):

    python bench/step_gpu.py --compile --out data/calibration/h100-sxm-steps.json
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

from shardplan.api.records import WallClock, add_record_argument, save_record

CASES = {
    # name: (family, config kwargs, batch, seq)
    "llama-1b-4l": ("llama", dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                    num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4), 4, 2048),
    "llama-1b-4l-long": ("llama", dict(vocab_size=32000, hidden_size=2048,
                         intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
                         num_key_value_heads=4), 1, 16384),
    "llama3-8b-2l": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                     num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8), 1, 8192),
    "gpt2-medium": ("gpt2", dict(vocab_size=50257, n_embd=1024, n_layer=24, n_head=16,
                    n_positions=1024), 8, 1024),
}  # fmt: skip


def build(family: str, kwargs: dict, seq: int):  # type: ignore[no-untyped-def]
    import transformers

    if family == "gpt2":
        config = transformers.GPT2Config(**kwargs)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(max_position_embeddings=seq, **kwargs)
    return transformers.LlamaForCausalLM(config)


def measure(name: str, iters: int, compile: bool = False) -> dict:
    import torch

    family, kwargs, batch, seq = CASES[name]
    torch.manual_seed(0)
    model = build(family, kwargs, seq)
    model.config._attn_implementation = "sdpa"
    model = model.to(device="cuda", dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    forward = torch.compile(model) if compile else model
    ids = torch.randint(0, kwargs["vocab_size"], (batch, seq), device="cuda")

    def step() -> None:
        loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    params = sum(p.numel() for p in model.parameters())
    result = {"name": name, "compiled": compile, "family": family, "config": kwargs,
              "batch": batch, "seq": seq,
              "parameters": params, "step_seconds": sorted(times)[len(times) // 2],
              "step_seconds_min": min(times),
              "peak_allocated_bytes": torch.cuda.max_memory_allocated()}  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> int:
    import torch
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("steps.json"))
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--case", action="append", choices=sorted(CASES))
    parser.add_argument("--compile", action="store_true", help="also time torch.compile'd models")
    add_record_argument(parser)
    args = parser.parse_args(argv)
    clock = WallClock()
    rows = []
    for name in args.case or list(CASES):
        for compile in (False, True) if args.compile else (False,):
            rows.append(measure(name, args.iters, compile))
            torch.cuda.empty_cache()
            print(f"{name}{' compiled' if compile else ''}: "
                  f"{rows[-1]['step_seconds'] * 1e3:.1f} ms, "
                  f"peak {rows[-1]['peak_allocated_bytes'] / 1e9:.1f} GB", flush=True)  # fmt: skip
    out = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
           "torch": torch.__version__, "transformers": transformers.__version__,
           "steps": rows}  # fmt: skip
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    save_record(args, "step_gpu", results=out, wall_times=clock.total())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
