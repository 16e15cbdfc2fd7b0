"""MoE fidelity: published mixture-of-experts training throughput vs the product's prediction.

    .venv/bin/python bench/fidelity_moe.py [--json out.json]

Each row's HF model is captured on ``meta`` (bf16; experts through the GShard dispatch of
``frontend/torch/moe.py`` at the ``LOAD_IMBALANCE`` capacity, or the row's own
``capacity_factor``) at one micro-batch per GPU, and ``sp.evaluate`` prices the published layout
(``sp.strategies.expert_parallel``) on the row's mesh of the calibrated H100 cluster; a step of
``GA`` micro-batches is ``GA`` times the micro-batch's forward and backward plus one optimizer
update (the ops traced under the ``optimizer`` module, once per step: the 30B row's AdamW
update of its 3.8B local parameters is 4.5% of a micro-batch's time, so counting it ``GA``
times over-priced that row by 5%). Nothing is fitted per row: the calibration is the one every
fidelity row uses (``costmodel.calibration``), with the attention kernel each run's software
launched (``MoERow.attention``, below).

Each row is captured as its run was configured: the Qwen3-30B-A3B row is NeMo Automodel's
benchmark recipe (``examples/benchmark/configs/qwen3_moe_30b_te_deepep.yaml``), which trains
with ``fake_balanced_gate: true`` (every expert gets exactly its share: capacity 1.0, no load
imbalance), ``activation_checkpointing: true`` (each decoder block recomputed whole in the
backward: ``recompute="full"``; without it the step needs ~250 GiB per GPU) and a
cross-entropy on the bf16 logits (``MaskedCrossEntropy`` with ``fp32_upcast: false``).

Every row ran on Transformer Engine on H100 (the 30B recipe's ``backend: attn: te, linear: te,
rms_norm: te``; Megatron-Core's TE layer specs for the other two), so every row is captured
with the kernels TE launches there: its attention is cuDNN's fused attention (TE's
``DotProductAttention`` drops FlashAttention for FusedAttention on Hopper; priced at
``ATTENTION_KERNELS["h100-sxm"]["cudnn"]``, this project's H100 measurement, not the default
FA2 level) and its RMSNorms one fused kernel each (``frontend.torch.norms.use_fused_rms_norm``:
forward reads ``x`` and writes ``y``, where HF's eager chain writes an fp32 copy of ``x`` and
several intermediates).

A row with ``pp > 1`` (``overrides`` carries ``pp`` and ``microbatches``) is captured at its
global batch instead, on a mesh with a ``pp`` axis: ``sp.evaluate`` prices the pipeline itself
(``plan_pipeline``'s stage model with Megatron's equal stages and the row's micro-batch count,
1F1B, bubble, p2p, embedding on the first stage and head and loss on the last) and its step is
the row's step; its ``compute_s`` is the plan's compute (every layer, the whole batch, on one
stage's devices) over ``pp``: a device's compute with no bubble.

A row with ``capture_layers = (a, b)`` is too large to capture whole in the bench's time (94
layers of 128 experts): it is evaluated with ``a`` and with ``b`` decoder layers and the step
extrapolated linearly to all of them (``t(a) + (L - a) * (t(b) - t(a)) / (b - a)``: every
layer is the same, and the embedding, head and loss are in ``t(a)``).

The Mixtral-8x22B row is Megatron-Core's token-drop run (``--moe-expert-capacity-factor 1.0
--moe-pad-expert-input-to-capacity``), captured at capacity 1.0: padded to capacity, every
expert runs exactly ``C = S * K / E`` slots per group, which is what the GShard dispatch
captures, so no load imbalance is assumed (the dropless run, 455 TFLOP/s, would need one: its
busiest expert sets the pace). Its published throughput is model TFLOP/s per GPU; it is turned
into seconds per step with Megatron-LM's model-FLOPs count (``megatron/training/training.py``
``num_floating_point_operations``, the form before the causal-mask halving of the attention
scores: ``12 L h^2 B s [(1 + g/n + s/h) q/h + (f/h) K 3/2 + V/(2 L h)]``; the later form,
``s/(2h)``, counts 3.4% fewer FLOPs and would make the published step 4.22 s).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fidelity_capture import _calibrated_cluster
from shardplan.api.records import WallClock, add_record_argument, save_record


@dataclass(frozen=True, slots=True)
class MoERow:
    source: str
    label: str
    config: dict
    """HF config keyword arguments (the model's ``config.json``)."""
    family: str
    """``qwen3_moe`` or ``mixtral`` (HF class)."""
    gpus: int
    micro_batch: int
    """Sequences per GPU per micro-batch (the source's MBS / LBS)."""
    accumulation: int
    seq: int
    published_step: float
    """Seconds per global step, from the source."""
    mesh: dict | None = None
    """Mesh axes (default ``{"dp": gpus}``)."""
    strategy: dict | None = None
    """``sp.strategies.expert_parallel`` arguments (default: EP over the data axes + FSDP)."""
    capture_layers: tuple[int, int] | None = None
    """Two layer counts to capture and extrapolate from (None: the whole model)."""
    capacity_factor: float | None = None
    """Expert capacity the model is captured at (``use_dispatch``); None: the frontend's
    ``LOAD_IMBALANCE`` for a model on ``meta``."""
    overrides: dict | None = None
    """``ParallelStrategy`` fields set over ``expert_parallel``'s (``pp``, ``microbatches``,
    ``sequence_parallel``, ``tp_comm_overlap``): what ``expert_parallel`` does not take."""
    dispatcher: str = "gshard"
    """The run's token dispatcher (``frontend.torch.moe.DISPATCHER``): ``"deepep"`` for a run
    on DeepEP (each token sent once per rank holding any of its experts), ``"gshard"`` for
    Megatron-Core's ``alltoall`` one (every token-expert slot)."""
    loss_upcast: bool = True
    """Whether the run's cross-entropy upcasts the logits to fp32 (HF's loss, Megatron's); False
    for a loss on the bf16 logits (NeMo Automodel's ``MaskedCrossEntropy(fp32_upcast=False)``),
    captured as ``F.cross_entropy`` of the model's logits."""
    attention: str = "fa2"
    """The fused-attention kernel the run launched (``costmodel.calibration.ATTENTION_KERNELS``):
    ``"cudnn"`` for Transformer Engine on Hopper (its DotProductAttention selects cuDNN's
    FusedAttention there), ``"fa2"`` for FlashAttention-2."""
    fused_norms: bool = False
    """Whether the run's RMSNorms are one fused kernel (TE's, Megatron-Core's TENorm): captured
    through ``frontend.torch.norms.use_fused_rms_norm``; False: HF's eager chain."""


NEMO_AUTOMODEL = (
    "NeMo Automodel performance summary, DGX-H100 BF16 pre-training table "
    "(docs.nvidia.com/nemo/automodel/nightly/performance-summary.html): Qwen3 MoE 30B on 8 GPUs, "
    "GBS 512, LBS 4, GA 16, seq 4096, EP 8, FSDP 8, TE + DeepEP, 21.773 s per global step "
    "(12,040 tokens/s/GPU, 277 model TFLOP/s/GPU); recipe "
    "github.com/NVIDIA-NeMo/Automodel examples/benchmark/configs/qwen3_moe_30b_te_deepep.yaml "
    "(fake balanced gate, activation checkpointing, Adam, loss without fp32 upcast)"
)

QWEN3_30B_A3B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], tie_word_embeddings=False,
)  # fmt: skip
"""Qwen/Qwen3-30B-A3B config.json (30.5B parameters, 3.3B active per token)."""

MCORE_MOE_ZOO = (
    "Megatron-Core MoE model zoo, Qwen3 best practice, H100 table, 'Intra-node EP strategy' row "
    "(github.com/yanring/Megatron-MoE-ModelZoo, best_practice/qwen3/readme.md): Qwen3-235B-A22B "
    "on 256 H100 (NVLink 4, InfiniBand 8 x 50 GB/s per node), BF16, DeepEP, seq 4096, TP 2, "
    "EP 8, ETP 1, PP 1, DP 128 (expert DP 32), FSDP on, MBS 4, GBS 2048, GA 4, full recompute: "
    "17.6 s per step (276 TFLOP/s per GPU)"
)

QWEN3_235B_A22B = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
    num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], tie_word_embeddings=False,
)  # fmt: skip
"""Qwen/Qwen3-235B-A22B config.json (235B parameters, 22B active per token)."""

MCORE_MIXTRAL = (
    "Megatron-Core MoE model zoo (github.com/yanring/Megatron-MoE-ModelZoo), Mixtral-8x22B: "
    "runtime_configs/benchmarking/runtime.conf (TP 2, PP 8, EP 8, CP 1, VPP 1, MBS 1, GBS 256, "
    "56 layers, alltoall dispatcher, grouped GEMM, 16 nodes = 128 H100, seq 4096), "
    "model_configs/benchmarking/Mixtral-8x22B.yaml (expert TP 1, distributed optimizer, "
    "overlapped grad reduce and param gather, sequence parallel, TP comm overlap, flash "
    "attention, BF16, no recompute), best_practice/Mixtral/run_mixtral_8x22B.sh: token-drop "
    "training (capacity factor 1.0, padded to capacity) 'around 470TFLOPS for H100' = "
    "4.37 s per step by Megatron-LM's model-FLOPs count"
)

MIXTRAL_8X22B = dict(
    vocab_size=32000, hidden_size=6144, intermediate_size=16384, num_hidden_layers=56,
    num_attention_heads=48, num_key_value_heads=8, head_dim=128, num_local_experts=8,
    num_experts_per_tok=2, rope_theta=1e6, max_position_embeddings=65536, rms_norm_eps=1e-5,
    sliding_window=None, tie_word_embeddings=False,
)  # fmt: skip
"""mistralai/Mixtral-8x22B-v0.1 config.json (141B parameters, 39B active per token)."""


def _megatron_step_seconds(config: dict, batch: int, seq: int, gpus: int, flops: float) -> float:
    """Seconds per step of a run reported at ``flops`` model FLOP/s per GPU: Megatron-LM's
    ``num_floating_point_operations`` (module docstring) over ``gpus * flops``."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, groups = config["num_attention_heads"], config["num_key_value_heads"]
    query = config["head_dim"] * heads / h
    attention = (1 + groups / heads + seq / h) * query
    mlp = config["intermediate_size"] / h * config["num_experts_per_tok"] * 3 / 2  # SwiGLU
    logits = config["vocab_size"] / (2 * layers * h)
    total = 12 * batch * seq * layers * h * h * (attention + mlp + logits)
    return total / (gpus * flops)


ROWS = [
    # the benchmark recipe's balanced gate, block checkpointing and bf16 loss; its TE
    # attention, linear and RMSNorm (``backend: attn: te, rms_norm: te``; docstring)
    MoERow(NEMO_AUTOMODEL, "Qwen3-30B-A3B 8xH100 EP8 FSDP8", QWEN3_30B_A3B, "qwen3_moe",
           gpus=8, micro_batch=4, accumulation=16, seq=4096, published_step=21.773,
           strategy=dict(shard_params=True, recompute="full"), capacity_factor=1.0,
           dispatcher="deepep", loss_upcast=False, attention="cudnn", fused_norms=True),
    # TP 2 x EP 8 folded (Megatron-Core's parallel folding: the experts split whole over the
    # 8 GPUs of a node, tp among them), DP 128 = dp x ep, expert DP 32 = dp, FSDP over both
    MoERow(MCORE_MOE_ZOO, "Qwen3-235B-A22B 256xH100 TP2 EP8 FSDP", QWEN3_235B_A22B,
           "qwen3_moe", gpus=256, micro_batch=4, accumulation=4, seq=4096, published_step=17.6,
           mesh={"dp": 32, "ep": 4, "tp": 2},
           strategy=dict(ep=("ep", "tp"), tp="tp", shard_params=True, recompute="full"),
           capture_layers=(2, 4), dispatcher="deepep", attention="cudnn", fused_norms=True),
    # EP 8 folded over tp x 4 data ranks (ETP 1: whole experts, one node), expert DP 2 = dp,
    # DP 8 = dp x ep; distributed optimizer (ZeRO-1), sequence parallel + TP comm overlap
    MoERow(MCORE_MIXTRAL, "Mixtral-8x22B 128xH100 TP2 PP8 EP8", MIXTRAL_8X22B, "mixtral",
           gpus=128, micro_batch=1, accumulation=32, seq=4096,
           published_step=_megatron_step_seconds(MIXTRAL_8X22B, 256, 4096, 128, 470e12),
           mesh={"pp": 8, "dp": 2, "ep": 4, "tp": 2},
           strategy=dict(ep=("ep", "tp"), tp="tp", shard_states=True),
           capacity_factor=1.0, attention="cudnn", fused_norms=True,
           overrides=dict(pp=8, microbatches=32, sequence_parallel=True, tp_comm_overlap=True)),
]  # fmt: skip


def _model(row: MoERow, layers: int | None = None):  # type: ignore[no-untyped-def]
    import torch
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    classes = {"qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
               "mixtral": (MixtralConfig, MixtralForCausalLM)}  # fmt: skip
    if row.family not in classes:
        raise ValueError(f"unknown family {row.family!r} (one of {sorted(classes)})")
    config_class, model_class = classes[row.family]
    kwargs = dict(row.config)
    if layers is not None:
        kwargs["num_hidden_layers"] = layers
    config = config_class(**kwargs)
    config._attn_implementation = "sdpa"  # the run's attention is fused (TE), not eager
    with torch.device("meta"):
        model = model_class(config).to(torch.bfloat16)
    if row.fused_norms:
        from shardplan.frontend.torch.norms import use_fused_rms_norm

        if not use_fused_rms_norm(model):
            raise ValueError(f"{row.label}: {model_class.__name__} has no RMSNorm to fuse")
    if row.capacity_factor is not None:
        from shardplan.frontend.torch.moe import use_dispatch

        if not use_dispatch(model, capacity_factor=row.capacity_factor):
            raise ValueError(f"{row.label}: {model_class.__name__} has no experts to dispatch")
    return model


def _evaluate(row: MoERow, layers: int | None):  # type: ignore[no-untyped-def]
    """``sp.evaluate`` of one micro-batch step of the row's layout (``layers``: a truncated
    model)."""
    import shardplan as sp
    import torch

    axes = row.mesh or {"dp": row.gpus}
    if math.prod(axes.values()) != row.gpus:
        raise ValueError(f"{row.label}: mesh {axes} is not {row.gpus} GPUs")
    model = _model(row, layers)
    pp = axes.get("pp", 1)
    data = row.gpus // (axes.get("tp", 1) * pp)  # data ranks: a micro-batch each
    batch = data * row.micro_batch * (row.accumulation if pp > 1 else 1)  # pp: the global batch
    ids = torch.zeros((batch, row.seq), dtype=torch.long, device="meta")
    mesh = sp.Mesh(axes, cluster=_calibrated_cluster("h100-sxm", row.attention))
    strategy = sp.strategies.expert_parallel(**(row.strategy or {"shard_params": True}))
    if row.overrides:
        extra = "-".join(f"{k}={v}" for k, v in row.overrides.items())
        strategy = replace(strategy, name=f"{strategy.name}-{extra}", **row.overrides)
    if strategy.pp != pp or (pp > 1 and strategy.microbatches != row.accumulation):
        raise ValueError(f"{row.label}: pp {strategy.pp} / micro-batches "
                         f"{strategy.microbatches} do not match mesh {axes} and GA "
                         f"{row.accumulation}")  # fmt: skip
    from shardplan.frontend.torch.moe import dispatcher

    inputs, loss = {"input_ids": ids, "labels": ids}, {}
    if not row.loss_upcast:  # the loss on the bf16 logits, as the run computes it
        inputs, loss = {"input_ids": ids}, dict(loss_fn=_bf16_loss, loss_inputs=(ids,))
    with warnings.catch_warnings(), dispatcher(row.dispatcher):
        warnings.simplefilter("ignore")
        ev = sp.evaluate(model, inputs, mesh=mesh, strategy=strategy, memory_limit=math.inf,
                         **loss)  # fmt: skip
    return ev, strategy


def _bf16_loss(output, labels):  # type: ignore[no-untyped-def]
    """Token cross-entropy of the logits in their own dtype (no fp32 upcast)."""
    import torch.nn.functional as F

    return F.cross_entropy(output.logits.flatten(0, 1), labels.flatten())


def _split(ev) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """``(micro-batch seconds without the optimizer update, the update's seconds)``: the update
    runs once per step, after the last micro-batch, on the compute stream, so removing its ops
    shortens the step by their time. Its ops are the ones the torch capture traces under the
    ``optimizer`` module (``frontend/torch/optim_splice.py``). ``costmodel.phases``' ``UPDATE``
    now agrees with it but for a few tiny ops (the 30B and 235B rows' update seconds differ in
    the tenth significant digit), so the records keep the traced module as the definition."""
    from shardplan.costmodel.op_times import plan_op_times

    plan = ev.plan
    times = plan_op_times(plan)
    update = sum(t for op, t in zip(plan.graph.ops, times, strict=True)
                 if op.origin.module == "optimizer")  # fmt: skip
    if not update:
        raise ValueError(f"{plan.graph.name}: no optimizer ops in the captured step")
    return ev.step_time - update, update


def predict(row: MoERow) -> dict:
    """``sp.evaluate`` of one micro-batch step of the published layout: ``GA`` times its
    forward and backward plus one optimizer update (a pipelined row: the whole step)."""
    start = time.perf_counter()
    if row.capture_layers is None:
        ev, strategy = _evaluate(row, None)
        compute = ev.plan.compute_time
        # a pipeline's step prices its one update itself (module docstring)
        micro, update = (ev.step_time, 0.0) if strategy.pp > 1 else _split(ev)
        peak = ev.peak_memory_bytes
    elif (row.overrides or {}).get("pp", 1) > 1:
        raise ValueError(f"{row.label}: a pipelined row is captured whole (its step is the "
                         "schedule's, not linear in the layers); drop capture_layers")  # fmt: skip
    else:  # two truncated models, extrapolated to every layer (module docstring)
        a, b = row.capture_layers
        (ev_a, strategy), (ev_b, _) = _evaluate(row, a), _evaluate(row, b)
        scale = (row.config["num_hidden_layers"] - a) / (b - a)

        def extrapolated(x: float, y: float) -> float:
            return x + scale * (y - x)

        (micro_a, update_a), (micro_b, update_b) = _split(ev_a), _split(ev_b)
        micro, update = extrapolated(micro_a, micro_b), extrapolated(update_a, update_b)
        compute = extrapolated(ev_a.plan.compute_time, ev_b.plan.compute_time)
        peak = extrapolated(ev_a.peak_memory_bytes, ev_b.peak_memory_bytes)
    if strategy.pp > 1:  # the pipeline's step is the whole step (module docstring)
        step, compute, micro = micro, compute / strategy.pp, micro / row.accumulation
    else:  # GA micro-batches, then one optimizer update (its ops are compute only)
        step = micro * row.accumulation + update
        compute = (compute - update) * row.accumulation + update
    return {
        "source": row.source, "label": row.label, "published_s": row.published_step,
        "predicted_s": step,
        "error": step / row.published_step - 1, "micro_step_s": micro, "update_s": update,
        "compute_s": compute, "peak_gib": peak / 2**30,
        "wall_s": time.perf_counter() - start, "strategy": strategy.name, "row": asdict(row),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    add_record_argument(parser)
    args = parser.parse_args()
    clock = WallClock()
    results = []
    for row in ROWS:
        r = predict(row)
        results.append(r)
        print(f"{r['label']:38s} published {r['published_s']:7.2f} s  predicted "
              f"{r['predicted_s']:7.2f} s  error {r['error']:+.1%}  (compute alone "
              f"{r['compute_s']:.2f} s; {r['strategy']}, peak {r['peak_gib']:.1f} GiB, "
              f"{r['wall_s']:.0f} s)", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    save_record(args, "fidelity_moe", results=results, wall_times=clock.total())


if __name__ == "__main__":
    main()
