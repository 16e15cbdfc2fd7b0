"""Microbenchmarks that produce a calibration JSON for ``shardplan calibrate`` / ``fit``.

    # one GPU (matmul, attention, HBM):
    python bench/microbench_gpu.py --cluster h100-sxm --out measurements.json
    # collectives too (all-reduce / all-gather bus bandwidth), one process per GPU:
    torchrun --nproc-per-node 8 bench/microbench_gpu.py --cluster h100-sxm --out m.json
    # CPU smoke test with tiny sizes (gloo when several processes):
    python bench/microbench_gpu.py --cpu --out /tmp/m.json
    # the calibration sweep committed under data/calibration/ (one GPU, ~3 min on an H100):
    python bench/microbench_gpu.py --full --out data/calibration/h100-sxm-measured-raw.json

Output (the format ``costmodel.calibration.fit`` reads)::

    {"cluster": "h100-sxm", "device": "...", "date": "...",
     "matmul": [{"m", "n", "k", "dtype", "flops", "seconds", "tflops"}],
     "attention": [{"batch", "heads", "seq", "head_dim", "flops", "seconds"}],
     "hbm": [{"bytes", "seconds"}],
     "collectives": [{"kind", "bytes", "devices", "level", "seconds", "busbw"}]}

Rows of small kernels also carry ``graph_seconds``: the GPU-side time from CUDA-graph replays,
without the host's per-call launch cost. ``--full`` adds the sweeps the cost model's
shape-dependent terms need: GEMMs by shape and dtype
(bf16, f16, tf32, f32), skinny decode GEMMs (few rows against a large weight: bandwidth bound),
fused attention forward and forward+backward (causal and not, by sequence and head size),
decode attention (one query against a KV cache), MoE expert GEMMs (one batched GEMM vs a loop of
per-expert GEMMs at small tokens-per-expert) and memory-bound elementwise kernels::

     "gemv": [{"m", "n", "k", "dtype", "weight_bytes", "seconds"}],
     "attention_train": [{"batch", "heads", "seq", "head_dim", "causal", "fwd_flops",
                          "fwd_seconds", "fwd_bwd_seconds"}],
     "attention_decode": [{"batch", "heads", "context", "head_dim", "kv_bytes", "seconds"}],
     "grouped_gemm": [{"experts", "tokens_per_expert", "hidden", "ffn", "flops", "bmm_seconds",
                       "loop_seconds"}],
     "elementwise": [{"op", "bytes", "seconds"}],
     "conv": [{"batch", "in_channels", "out_channels", "kernel", "groups", "flops", "seconds"}]

(``conv``: ResNet-50's cuDNN convolutions in fp16 channels-last, fitted to
``Calibration.conv_efficiency``).

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
from shardplan.api.records import WallClock, add_record_argument, save_record

GPU_GEMMS = [
    (512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096),
    (8192, 8192, 8192), (4096, 4096, 16384), (16384, 4096, 4096), (8192, 1024, 8192),
]  # fmt: skip
CPU_GEMMS = [(64, 64, 64), (128, 128, 128), (256, 256, 256)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, iters: int) -> float:
    """Median seconds of ``fn`` after two warm-up calls.

    On a GPU each sample runs ``fn`` back to back between CUDA events, enough times to fill about
    a millisecond, so launch latency overlaps as it does inside a training step.
    """
    for _ in range(2):
        fn()
    _sync(device)
    if device.type == "cuda":
        return _time_cuda(fn, iters)
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def _time_cuda(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    once = max(start.elapsed_time(end) / 1e3, 1e-6)
    reps = max(1, min(200, int(1e-3 / once)))
    samples = []
    for _ in range(iters):
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / reps)
    return sorted(samples)[len(samples) // 2]


def _time_graph(fn, device: torch.device, iters: int) -> float | None:
    """GPU-side seconds of ``fn``: replays of a CUDA graph of back-to-back calls, so the host's
    launch cost (tens of microseconds per eager call on a VM) drops out. ``None`` off a GPU."""
    if device.type != "cuda":
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    once = _time_cuda(fn, 3)
    reps = max(1, min(100, int(2e-3 / once)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return _time_cuda(graph.replay, iters) / reps


def bench_matmul(device: torch.device, dtype: torch.dtype, shapes, iters: int) -> list[dict]:
    rows = []
    name = _dtype_name(dtype)
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        seconds = _time(lambda a=a, b=b: a @ b, device, iters)
        flops = 2.0 * m * n * k
        row = {"m": m, "n": n, "k": k, "dtype": name, "flops": flops,
               "seconds": seconds, "tflops": flops / seconds / 1e12}  # fmt: skip
        graph = _time_graph(lambda a=a, b=b: a @ b, device, iters)
        if graph is not None:
            row["graph_seconds"] = graph
        rows.append(row)
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


def _dtype_name(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}[dtype]


# -- the --full sweep ---------------------------------------------------------------------------

SWEEP_GEMMS = [
    # square, from launch-bound to saturated
    (256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048),
    (4096, 4096, 4096), (8192, 8192, 8192), (16384, 16384, 16384),
    # Llama-3-8B layer GEMMs at 8192 tokens, whole and split 2/4/8 ways (TP column / row)
    (8192, 4096, 4096), (8192, 14336, 4096), (8192, 4096, 14336), (8192, 1024, 4096),
    (8192, 7168, 4096), (8192, 3584, 4096), (8192, 1792, 4096), (8192, 4096, 1792),
    (8192, 4096, 512), (8192, 4096, 3584), (8192, 128256, 4096), (8192, 16032, 4096),
    # Llama-3-70B at 4096 tokens, TP 8
    (4096, 1024, 8192), (4096, 3584, 8192), (4096, 8192, 3584), (4096, 8192, 1024),
    # few tokens (small micro-batch / context-parallel shard)
    (1024, 4096, 4096), (512, 14336, 4096), (256, 4096, 14336), (128, 8192, 8192),
]  # fmt: skip
SWEEP_DTYPE_GEMMS = [(1024, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 8192)]
DECODE_ROWS = [1, 8, 32, 64, 128, 256, 512]
DECODE_WEIGHTS = [(4096, 4096), (4096, 14336), (8192, 8192), (8192, 28672)]  # (k, n)
ATTN_TRAIN = [  # (batch, heads, seq, head_dim)
    (8, 32, 1024, 128), (4, 32, 2048, 128), (2, 32, 4096, 128), (1, 32, 8192, 128),
    (1, 32, 16384, 128), (1, 8, 32768, 128), (1, 4, 8192, 128), (4, 16, 2048, 64),
    (1, 64, 8192, 128),
]  # fmt: skip
ATTN_DECODE = [  # (batch, kv heads, context, head_dim)
    (1, 8, 4096, 128), (16, 8, 4096, 128), (64, 8, 4096, 128), (64, 1, 4096, 128),
    (8, 8, 32768, 128), (1, 8, 131072, 128), (128, 8, 2048, 128),
]  # fmt: skip
MOE = [  # (experts, tokens per expert, hidden, ffn): Mixtral-8x7B and fine-grained shapes
    (8, 16, 4096, 14336), (8, 64, 4096, 14336), (8, 256, 4096, 14336), (8, 1024, 4096, 14336),
    (8, 4096, 4096, 14336), (64, 16, 2048, 1408), (64, 64, 2048, 1408), (64, 256, 2048, 1408),
    (64, 1024, 2048, 1408), (2, 2048, 4096, 14336), (16, 512, 5120, 1536),
]  # fmt: skip


CONVS = [  # (batch, in channels, size, out channels, kernel, stride, groups): ResNet-50 v1.5
    (256, 3, 224, 64, 7, 2, 1), (256, 64, 56, 64, 1, 1, 1), (256, 64, 56, 64, 3, 1, 1),
    (256, 64, 56, 256, 1, 1, 1), (256, 128, 28, 128, 3, 1, 1), (256, 256, 14, 256, 3, 1, 1),
    (256, 512, 7, 512, 3, 1, 1), (256, 1024, 14, 256, 1, 1, 1), (256, 2048, 7, 512, 1, 1, 1),
    # ResNeXt grouped and MobileNet/ConvNeXt depthwise (memory-bound)
    (256, 128, 56, 128, 3, 1, 32), (256, 96, 56, 96, 7, 1, 96),
]  # fmt: skip


def sweep_conv(device: torch.device, iters: int) -> list[dict]:
    """cuDNN forward convolutions, fp16 channels-last (the AMP recipe's layout); FLOPs count
    2 per multiply-add. ``compute_bound``: more FLOPs than the HBM bytes' worth at peak."""
    rows = []
    for n, c, size, k, r, stride, groups in CONVS:
        x = torch.randn(n, c, size, size, device=device, dtype=torch.float16)
        x = x.to(memory_format=torch.channels_last)
        w = torch.randn(k, c // groups, r, r, device=device, dtype=torch.float16)
        w = w.to(memory_format=torch.channels_last)

        def fn(x=x, w=w, s=stride, g=groups, p=r // 2):  # type: ignore[no-untyped-def]
            return torch.nn.functional.conv2d(x, w, stride=s, padding=p, groups=g)

        out = fn()
        flops = 2.0 * out.numel() * (c // groups) * r * r
        nbytes = (x.numel() + w.numel() + out.numel()) * 2
        row = {"batch": n, "in_channels": c // groups, "size": size, "out_channels": k // groups,
               "kernel": r, "stride": stride, "groups": groups, "dtype": "f16", "flops": flops,
               "bytes": nbytes, "seconds": _time(fn, device, iters),
               "compute_bound": groups == 1 or c // groups > 1}  # fmt: skip
        rows.append(row)
    return rows


def sweep_gemms(device: torch.device, iters: int) -> list[dict]:
    rows = bench_matmul(device, torch.bfloat16, SWEEP_GEMMS, iters)
    rows += bench_matmul(device, torch.float16, SWEEP_DTYPE_GEMMS, iters)
    torch.backends.cuda.matmul.allow_tf32 = True
    rows += bench_matmul(device, torch.float32, SWEEP_DTYPE_GEMMS, iters)
    torch.backends.cuda.matmul.allow_tf32 = False
    rows += bench_matmul(device, torch.float32, SWEEP_DTYPE_GEMMS, iters)
    return rows


def sweep_gemv(device: torch.device, iters: int) -> list[dict]:
    """Decode-step GEMMs: a few token rows against a whole weight (reads dominate)."""
    rows = []
    for k, n in DECODE_WEIGHTS:
        w = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        for m in DECODE_ROWS:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            seconds = _time(lambda x=x, w=w: x @ w, device, iters)
            graph = _time_graph(lambda x=x, w=w: x @ w, device, iters)
            rows.append({"m": m, "n": n, "k": k, "dtype": "bf16", "weight_bytes": 2.0 * k * n,
                         "flops": 2.0 * m * n * k, "seconds": seconds,
                         "graph_seconds": graph})  # fmt: skip
        del w
    return rows


def sweep_attention_train(device: torch.device, iters: int) -> list[dict]:
    """Fused (flash) attention, forward and forward + backward; FLOPs as FlashAttention counts."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = []
    for b, h, s, d in ATTN_TRAIN:
        for causal in (True, False):
            q, k, v = (
                torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16, requires_grad=True)
                for _ in range(3)
            )
            fwd = _time(lambda q=q, k=k, v=v, c=causal: sdpa(q, k, v, is_causal=c), device, iters)
            grad = torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16)

            def step(q=q, k=k, v=v, grad=grad, c=causal):
                sdpa(q, k, v, is_causal=c).backward(grad)

            both = _time(step, device, iters)
            flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
            rows.append({"batch": b, "heads": h, "seq": s, "head_dim": d, "causal": causal,
                         "fwd_flops": flops, "fwd_seconds": fwd,
                         "fwd_bwd_flops": 3.5 * flops, "fwd_bwd_seconds": both})  # fmt: skip
            del q, k, v, grad
    return rows


def sweep_attention_decode(device: torch.device, iters: int) -> list[dict]:
    """One query per sequence against a KV cache: the cache read is the cost."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = []
    for b, h, c, d in ATTN_DECODE:
        q = torch.randn(b, h, 1, d, device=device, dtype=torch.bfloat16)
        k, v = (torch.randn(b, h, c, d, device=device, dtype=torch.bfloat16) for _ in range(2))
        seconds = _time(lambda q=q, k=k, v=v: sdpa(q, k, v), device, iters)
        graph = _time_graph(lambda q=q, k=k, v=v: sdpa(q, k, v), device, iters)
        rows.append({"batch": b, "heads": h, "context": c, "head_dim": d,
                     "kv_bytes": 2.0 * 2 * b * h * c * d, "seconds": seconds,
                     "graph_seconds": graph})  # fmt: skip
        del q, k, v
    return rows


def sweep_grouped_gemm(device: torch.device, iters: int) -> list[dict]:
    """MoE expert GEMMs (the up projection): all experts in one batched GEMM vs one GEMM each."""
    rows = []
    for e, t, hidden, ffn in MOE:
        x = torch.randn(e, t, hidden, device=device, dtype=torch.bfloat16)
        w = torch.randn(e, hidden, ffn, device=device, dtype=torch.bfloat16)
        bmm = _time(lambda x=x, w=w: torch.bmm(x, w), device, iters)

        def loop(x=x, w=w):
            for i in range(x.shape[0]):
                x[i] @ w[i]

        looped = _time(loop, device, iters)
        rows.append({"experts": e, "tokens_per_expert": t, "hidden": hidden, "ffn": ffn,
                     "flops": 2.0 * e * t * hidden * ffn, "weight_bytes": 2.0 * e * hidden * ffn,
                     "bmm_seconds": bmm, "loop_seconds": looped,
                     "bmm_graph_seconds": _time_graph(lambda x=x, w=w: torch.bmm(x, w), device,
                                                      iters),
                     "loop_graph_seconds": _time_graph(loop, device, iters)})  # fmt: skip
        del x, w
    return rows


def sweep_elementwise(device: torch.device, iters: int) -> list[dict]:
    """Memory-bound kernels of a layer (bytes = read + written)."""
    rows = []
    for tokens, hidden in [(8192, 4096), (32768, 4096), (16384, 8192)]:
        x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
        y = torch.randn_like(x)
        w = torch.ones(hidden, device=device, dtype=torch.bfloat16)
        n = 2.0 * x.numel()
        cases = {
            "add": (lambda x=x, y=y: x + y, 3 * n),
            "silu_mul": (lambda x=x, y=y: torch.nn.functional.silu(x) * y, 3 * n),
            "rms_norm": (
                lambda x=x, w=w, h=hidden: torch.nn.functional.rms_norm(x, (h,), w),
                2 * n,
            ),
            "softmax": (lambda x=x: torch.softmax(x, dim=-1), 2 * n),
        }
        for op, (fn, nbytes) in cases.items():
            rows.append({"op": op, "tokens": tokens, "hidden": hidden, "bytes": nbytes,
                         "seconds": _time(fn, device, iters),
                         "graph_seconds": _time_graph(fn, device, iters)})  # fmt: skip
        del x, y
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="calibration microbenchmarks")
    parser.add_argument("--cluster", default="h100-sxm", help="catalogue cluster to fit against")
    parser.add_argument("--out", type=Path, default=Path("measurements.json"))
    parser.add_argument("--cpu", action="store_true", help="tiny sizes on CPU (smoke test)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--full", action="store_true", help="the calibration sweep (one GPU)")
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
    if args.full and device.type == "cuda":
        sweeps = {
            "matmul": sweep_gemms,
            "gemv": sweep_gemv,
            "attention_train": sweep_attention_train,
            "attention_decode": sweep_attention_decode,
            "grouped_gemm": sweep_grouped_gemm,
            "elementwise": sweep_elementwise,
            "conv": sweep_conv,
        }
        for key, sweep in sweeps.items():
            begin = time.perf_counter()
            result[key] = sweep(device, args.iters)
            print(f"{key}: {len(result[key])} rows in {time.perf_counter() - begin:.1f} s",
                  flush=True)  # fmt: skip
        result["torch"] = torch.__version__
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
