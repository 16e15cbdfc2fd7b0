"""Microbenchmarks that produce a calibration JSON for ``shardplan calibrate`` / ``fit``.

    # one GPU (matmul, attention, HBM):
    python bench/microbench_gpu.py --cluster h100-sxm --out measurements.json
    # collectives too (all-reduce / all-gather bus bandwidth), one process per GPU:
    torchrun --nproc-per-node 8 bench/microbench_gpu.py --cluster h100-sxm --out m.json
    # CPU smoke test with tiny sizes (gloo when several processes):
    python bench/microbench_gpu.py --cpu --out /tmp/m.json

Output (the format ``costmodel.calibration.fit`` reads)::

    {"cluster": "h100-sxm", "device": "...", "date": "...",
     "matmul": [{"m", "n", "k", "dtype", "flops", "seconds", "tflops"}],
     "attention": [{"batch", "heads", "seq", "head_dim", "flops", "seconds"}],
     "hbm": [{"bytes", "seconds"}],
     "collectives": [{"kind", "bytes", "devices", "level", "seconds", "busbw"}]}

Bus bandwidth follows nccl-tests: all-reduce ``2(n-1)/n * S / t``, all-gather ``(n-1)/n * S / t``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from record import WallClock, add_record_argument, save_record

GPU_GEMMS = [
    (512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096),
    (8192, 8192, 8192), (4096, 4096, 16384), (16384, 4096, 4096), (8192, 1024, 8192),
]  # fmt: skip
CPU_GEMMS = [(64, 64, 64), (128, 128, 128), (256, 256, 256)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, iters: int) -> float:
    """Median seconds of ``fn`` after two warm-up calls."""
    for _ in range(2):
        fn()
    _sync(device)
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def bench_matmul(device: torch.device, dtype: torch.dtype, shapes, iters: int) -> list[dict]:
    rows = []
    name = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}[dtype]
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        seconds = _time(lambda a=a, b=b: a @ b, device, iters)
        flops = 2.0 * m * n * k
        rows.append({"m": m, "n": n, "k": k, "dtype": name, "flops": flops,
                     "seconds": seconds, "tflops": flops / seconds / 1e12})  # fmt: skip
    return rows


def bench_attention(device: torch.device, dtype: torch.dtype, cpu: bool, iters: int) -> list[dict]:
    rows = []
    shapes = (
        [(1, 4, 128, 32)] if cpu else [(1, 32, 2048, 128), (1, 32, 4096, 128), (1, 64, 8192, 128)]
    )
    for b, h, s, d in shapes:
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype) for _ in range(3))
        fn = lambda q=q, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            q, k, v, is_causal=True
        )
        seconds = _time(fn, device, iters)
        flops = 4.0 * b * h * s * s * d / 2  # causal half, as FlashAttention counts
        rows.append({"batch": b, "heads": h, "seq": s, "head_dim": d, "flops": flops,
                     "seconds": seconds})  # fmt: skip
    return rows


def bench_hbm(device: torch.device, cpu: bool, iters: int) -> list[dict]:
    rows = []
    for mib in [4, 16] if cpu else [64, 256, 1024, 4096]:
        src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        seconds = _time(lambda s=src, d=dst: d.copy_(s), device, iters)
        rows.append({"bytes": 2.0 * src.numel(), "seconds": seconds})  # read + write
    return rows


def bench_collectives(device: torch.device, cpu: bool, iters: int, local: int) -> list[dict]:
    n = dist.get_world_size()
    level = "intra-node" if n <= local else "inter-node"
    rows = []
    for mib in [1, 4] if cpu else [1, 16, 64, 256, 1024]:
        numel = mib * 2**20 // 2
        buf = torch.ones(numel, dtype=torch.float32 if cpu else torch.bfloat16, device=device)
        out = torch.empty(numel * n, dtype=buf.dtype, device=device)
        size = buf.numel() * buf.element_size()
        ar = _time(lambda buf=buf: dist.all_reduce(buf), device, iters)
        ag = _time(lambda o=out, b=buf: dist.all_gather_into_tensor(o, b), device, iters)
        rows.append({"kind": "all-reduce", "bytes": size, "devices": n, "level": level,
                     "seconds": ar, "busbw": 2 * (n - 1) / n * size / ar})  # fmt: skip
        rows.append({"kind": "all-gather", "bytes": size * n, "devices": n, "level": level,
                     "seconds": ag, "busbw": (n - 1) / n * size * n / ag})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="calibration microbenchmarks")
    parser.add_argument("--cluster", default="h100-sxm", help="catalogue cluster to fit against")
    parser.add_argument("--out", type=Path, default=Path("measurements.json"))
    parser.add_argument("--cpu", action="store_true", help="tiny sizes on CPU (smoke test)")
    parser.add_argument("--iters", type=int, default=10)
    add_record_argument(parser)
    args = parser.parse_args(argv)
    clock = WallClock()
    cpu = args.cpu or not torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo" if cpu else "nccl")
    rank = dist.get_rank() if world > 1 else 0
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    device = torch.device("cpu" if cpu else f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.float32 if cpu else torch.bfloat16
    result = {
        "cluster": "cpu-test" if cpu and args.cluster == "h100-sxm" else args.cluster,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": datetime.date.today().isoformat(),
        "matmul": bench_matmul(device, dtype, CPU_GEMMS if cpu else GPU_GEMMS, args.iters),
        "attention": bench_attention(device, dtype, cpu, args.iters),
        "hbm": bench_hbm(device, cpu, args.iters),
        "collectives": bench_collectives(device, cpu, args.iters, local) if world > 1 else [],
    }
    if world > 1:
        dist.destroy_process_group()
    if rank == 0:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}: {len(result['matmul'])} GEMMs, {len(result['hbm'])} copies, "
              f"{len(result['collectives'])} collectives")  # fmt: skip
        save_record(args, "microbench_gpu", results=result, wall_times=clock.total(),
                    inputs={"world_size": world, "local_world_size": local})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
