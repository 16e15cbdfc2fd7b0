"""Analytic per-layer cost of a Megatron-style transformer training step (used by fidelity).

Time comes from the cost model's parts - the calibrated roofline (``Calibration.matmul_time`` /
``memory_time``), alpha-beta collectives on the cluster's links (``collective_time``) and the
pipeline schedule simulation (``schedule_pipeline``) - applied to one layer's kernels and scaled
by the layer count. Nothing here is fitted to a published row.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardplan.costmodel import collective_time, get_cluster
from shardplan.costmodel.calibration import Calibration, default_calibration
from shardplan.costmodel.pipeline import PipelineResult, schedule_pipeline
from shardplan.ir import Mesh

BYTES = 2  # bf16 / fp16 activations and weights
F32 = 4

# HBM bytes per logit element of an unfused fp32 softmax cross-entropy (Megatron's
# vocab-parallel cross-entropy casts the logits to fp32 first). Forward: cast (read 2, write 4),
# max (read 4), subtract the max in place (4 + 4), exp in place (4 + 4), sum (read 4), divide in
# place (4 + 4) -- the softmax is kept for backward. Backward: scale the saved softmax by the
# loss gradient in place (4 + 4; the one-hot subtraction touches one element per row) and cast
# the gradient back to 16 bits (read 4, write 2). Counted from the algorithm's passes.
CE_FORWARD_BYTES = 2 + 4 + 4 + 8 + 8 + 4 + 8
CE_BACKWARD_BYTES = 8 + 6

# HBM bytes per parameter of a mixed-precision Adam step over the parameters this GPU updates:
# gradient norm for clipping (read the fp32 gradient, 4); Adam (read gradient, fp32 master, m,
# v: 16; write master, m, v: 12); copy the master into the 16-bit model weight (read 4, write 2).
ADAM_BYTES = 4 + 16 + 12 + 6
# fp16 with a dynamic loss scale (Micikevicius et al. 2018) keeps 16-bit model gradients: they are
# copied into the fp32 main gradients (read 2, write 4), checked for inf/nan and unscaled in place
# (read 4, write 4) before the step.
LOSS_SCALE_BYTES = 6 + 8


@dataclass(frozen=True, slots=True)
class Model:
    """Decoder-only transformer shapes."""

    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    kv_heads: int = 0
    """0: multi-head attention (kv_heads = heads)."""
    gated_mlp: bool = False
    """SwiGLU (Llama): two up projections."""
    dropout: bool = True

    @property
    def kv_hidden(self) -> int:
        return self.hidden * (self.kv_heads or self.heads) // self.heads

    def layer_params(self) -> int:
        h, f = self.hidden, self.ffn
        attention = h * (h + 2 * self.kv_hidden) + h * h
        return attention + (3 if self.gated_mlp else 2) * h * f

    def model_flops(self, tokens: float, seq: int) -> float:
        """Model FLOPs of one step: 6 N T for the weights plus 12 l s h T for attention.

        For a GPT (ffn = 4h) this is Korthikanti'22's ``72 B s l h^2 (1 + s/6h + V/12lh)``
        exactly (ref §1); recomputation is not counted (MFU convention).
        """
        weights = self.layers * self.layer_params() + self.vocab * self.hidden
        return 6 * weights * tokens + 12 * self.layers * seq * self.hidden * tokens


@dataclass(frozen=True, slots=True)
class Config:
    """A published parallel configuration (Megatron vocabulary)."""

    tp: int
    pp: int
    dp: int
    global_batch: int
    seq: int
    micro_batch: int = 1
    chunks: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    """``"none"``, ``"selective"`` (attention core) or ``"full"``."""
    flash_attention: bool = False
    tp_overlap: bool = False
    """Megatron-Core ``--tp-comm-overlap``: TP collectives run under the adjacent GEMMs."""
    dp_overlap: bool = False
    """``--overlap-grad-reduce``: gradient reduction under the last micro-batch's backward."""
    grad_bytes: int = F32
    """Bytes per element of the gradient buffer that is accumulated over micro-batches and
    reduced across data parallelism. Megatron-LM forces fp32 accumulation and reduction for
    bf16 (``megatron/training/arguments.py``: "bfloat16 requires gradient accumulation and
    all-reduce to be done in fp32", unless ``--grad-reduce-in-bf16``)."""
    distributed_optimizer: bool = True
    """Optimizer states and the Adam step are sharded over data parallelism (ZeRO-1)."""
    loss_scale: bool = False
    """fp16 with dynamic loss scaling (Korthikanti'22 runs are fp16)."""
    cp: int = 1
    """Context parallelism (Llama 3's all-gather CP): each GPU holds ``seq / cp`` tokens of
    every sequence; attention all-gathers K/V over cp (forward, and again in backward) and
    reduce-scatters dK/dV, exposed (the paper: "the all-gather communication latency is
    exposed in the critical path"); the causal work is balanced (head-tail chunks)."""
    p2p_overlap: bool = True
    """Pipeline sends and receives run beside compute (Megatron-Core's
    ``--overlap-p2p-communication``). False for 2022 Megatron-LM, whose schedules waited for
    each batched send/receive (``schedule_pipeline(..., blocking_p2p=True)``)."""

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def local_tokens(self) -> int:
        """Tokens of one micro-batch on one GPU of a context-parallel group."""
        return self.micro_batch * self.seq // self.cp


@dataclass(frozen=True, slots=True)
class Estimate:
    step_time: float
    pipeline: PipelineResult
    layer_forward: float
    layer_backward: float
    tp_comm_per_layer: float
    dp_exposed: float
    optimizer: float = 0.0


def _mesh(config: Config, cluster: str) -> Mesh:
    axes = {"dp": config.dp, "pp": config.pp, "cp": config.cp, "tp": config.tp}
    return Mesh(axes, cluster=cluster)


def _gemms(m: Model, c: Config) -> tuple[list[float], float]:
    """Per-GPU FLOPs of one layer's forward GEMMs (weights) and of the attention core."""
    t, tokens, h = c.tp, c.local_tokens, m.hidden
    up = (2 if m.gated_mlp else 1) * m.ffn
    weights = [h * (h + 2 * m.kv_hidden), h * h, h * up, m.ffn * h]
    core = 4 * c.local_tokens * c.seq * h / t  # QK^T and PV: local queries, all keys
    return [2 * tokens * w / t for w in weights], core


def _memory_bytes(m: Model, c: Config) -> tuple[float, float]:
    """HBM bytes of one layer's forward elementwise kernels: (hidden-sized, attention scores).

    Norms, residual adds, dropouts and the activation touch ``b s h`` tensors (split by tp only
    under sequence parallelism); a non-fused attention core also reads and writes the
    ``b a s^2`` score tensor (mask+softmax, dropout), which flash attention never stores.
    """
    e = c.local_tokens * m.hidden * BYTES
    sp = c.tp if c.sequence_parallel else 1
    hidden = (2 * 2 + 2 * 3) * e / sp  # two norms (r+w), two residual adds (2r+w)
    if m.dropout:
        hidden += 2 * 2.5 * e / sp  # read, write, 1-byte mask
    ratio = m.ffn / m.hidden
    hidden += (3 if m.gated_mlp else 2) * ratio * e / c.tp  # activation on the ffn width
    scores = 0.0
    if not c.flash_attention:
        scores = m.heads * c.local_tokens * c.seq * BYTES / c.tp
        scores *= 2 + (2.5 if m.dropout else 0)
    return hidden, scores


def layer_times(m: Model, c: Config, cluster: str, cal: Calibration) -> tuple[float, float, float]:
    """(forward, backward incl. recomputation, TP communication) seconds of one layer."""
    cl = get_cluster(cluster)
    weights, core = _gemms(m, c)
    gemm_f = sum(cal.matmul_time(f, 0, "bf16", cl) for f in weights)
    heads_per_gpu = c.micro_batch * m.heads // c.tp
    if c.flash_attention:  # causal blocks skipped; backward 2.5x forward FLOPs (FlashAttention-2)
        # at the backward kernel's own rate (Calibration.attention_backward_slowdown)
        core_f = cal.attention_time(core / 2, cl)
        core_b = cal.attention_backward_time(core_f)
    else:  # batched GEMMs of one head each
        core_f = heads_per_gpu * cal.matmul_time(core / heads_per_gpu, 0, "bf16", cl)
        core_b = 2 * core_f
    hidden, scores = _memory_bytes(m, c)
    kernels = 8 if m.dropout else 6
    mem_f = cal.memory_time(hidden, cl) + kernels * cal.kernel_floor + cal.memory_time(scores, cl)
    tp_f, tp_b = _tp_comm(m, c, cluster)
    cp_f, cp_b = _cp_comm(m, c, cluster)
    exposed_f = max(0.0, tp_f - gemm_f) if c.tp_overlap else tp_f
    exposed_b = max(0.0, tp_b - 2 * gemm_f) if c.tp_overlap else tp_b
    # what is hidden still takes the collective's SMs from the GEMMs it runs under
    taxed = cal.overlap_penalty(tp_f - exposed_f), cal.overlap_penalty(tp_b - exposed_b)
    forward = gemm_f + core_f + mem_f + exposed_f + cp_f + taxed[0]
    backward = 2 * gemm_f + core_b + 2 * mem_f + exposed_b + cp_b + taxed[1]
    if c.recompute == "full":
        backward += forward
    elif c.recompute == "selective" and not c.flash_attention:
        backward += core_f + cal.memory_time(scores, cl)
    return forward, backward, tp_f + tp_b


def _cp_comm(m: Model, c: Config, cluster: str) -> tuple[float, float]:
    """Forward and backward context-parallel collectives of one layer: K and V all-gathered
    (forward, and again in backward), dK and dV reduce-scattered; bf16, heads split by tp."""
    if c.cp == 1:
        return 0.0, 0.0
    mesh = _mesh(c, cluster)
    kv = 2 * c.micro_batch * c.seq * m.kv_hidden * BYTES / c.tp  # K and V, gathered
    gather = collective_time("all-gather", kv, "cp", mesh)
    scatter = collective_time("reduce-scatter", kv / c.cp, "cp", mesh)
    return gather, gather + scatter


def _tp_comm(m: Model, c: Config, cluster: str) -> tuple[float, float]:
    """Forward and backward tensor-parallel collectives of one layer (Korthikanti'22 §4.2.2)."""
    if c.tp == 1:
        return 0.0, 0.0
    mesh = _mesh(c, cluster)
    e = c.local_tokens * m.hidden * BYTES
    if not c.sequence_parallel:  # g/g-bar: one all-reduce per block each way
        ar = collective_time("all-reduce", e, "tp", mesh)
        return 2 * ar, 2 * ar
    ag = collective_time("all-gather", e, "tp", mesh)
    rs = collective_time("reduce-scatter", e / c.tp, "tp", mesh)
    # backward re-gathers the norm outputs for the weight gradients (Calculon's seq_par_ag_redo)
    return 2 * (ag + rs), 2 * (ag + rs) + (0.0 if c.tp_overlap else 2 * ag)


def _ends(m: Model, c: Config, cluster: str, cal: Calibration) -> tuple[float, float, float]:
    """(embedding forward, logits+loss forward, logits+loss backward) of one micro-batch."""
    cl = get_cluster(cluster)
    tokens = c.local_tokens
    embed = cal.memory_time(2 * tokens * m.hidden * BYTES, cl)
    logits = cal.matmul_time(2 * tokens * m.hidden * m.vocab / c.tp, 0, "bf16", cl)
    elements = tokens * m.vocab / c.tp
    loss_f = cal.memory_time(CE_FORWARD_BYTES * elements, cl)
    loss_b = cal.memory_time(CE_BACKWARD_BYTES * elements, cl)
    return embed, logits + loss_f, 2 * logits + loss_b


def estimate(
    m: Model,
    c: Config,
    cluster: str,
    cal: Calibration | None = None,
    layer_time: float | None = None,
) -> Estimate:
    """Predicted iteration time of ``m`` trained under ``c`` on ``cluster``.

    ``layer_time`` replaces the analytic forward + backward seconds of one layer (e.g. a
    captured graph's, ``fidelity_capture.py``); it is split between forward and backward in the
    analytic ratio, which is all the pipeline schedule needs.
    """
    cal = cal or default_calibration(cluster)
    fwd, bwd, tp_comm = layer_times(m, c, cluster, cal)
    if layer_time is not None:
        scale = layer_time / (fwd + bwd)
        fwd, bwd = fwd * scale, bwd * scale
    per_stage = m.layers / c.pp  # uneven splits are averaged
    embed, head_f, head_b = _ends(m, c, cluster, cal)
    forward = [per_stage * fwd] * c.pp
    backward = [per_stage * bwd] * c.pp
    forward[0] += embed
    forward[-1] += head_f
    backward[-1] += head_b
    mesh = _mesh(c, cluster)
    sp = c.tp if c.sequence_parallel else 1
    p2p = collective_time("collective-permute", c.local_tokens * m.hidden * BYTES / sp,
                          "pp", mesh) if c.pp > 1 else 0.0  # fmt: skip
    schedule = "interleaved" if c.chunks > 1 else "1f1b"
    pipe = schedule_pipeline(forward, backward, c.microbatches, schedule, c.chunks, p2p,
                             blocking_p2p=not c.p2p_overlap)  # fmt: skip
    dp = _dp_exposed(m, c, cluster, backward[0], forward[0], cal)
    opt = optimizer_time(m, c, cluster, cal)
    return Estimate(pipe.step_time + dp + opt, pipe, fwd, bwd, tp_comm, dp, opt)


def _local_params(m: Model, c: Config) -> float:
    """Parameters one GPU holds: its pipeline stage (plus the embedding, which the end stages
    hold, as an upper bound) split by tensor parallelism."""
    return (m.layers * m.layer_params() / c.pp + m.vocab * m.hidden) / c.tp


def optimizer_time(m: Model, c: Config, cluster: str, cal: Calibration) -> float:
    """Once-per-step memory-bound work outside the pipeline: zeroing the gradient buffer of the
    local parameters, the loss-scale check, and the Adam step over the parameters this GPU
    updates (its 1/dp shard under a distributed optimizer)."""
    cl = get_cluster(cluster)
    local = _local_params(m, c)
    updated = local / (c.dp * c.cp) if c.distributed_optimizer else local
    per_param = ADAM_BYTES + (LOSS_SCALE_BYTES if c.loss_scale else 0)
    zero = cal.memory_time(c.grad_bytes * local, cl)
    return zero + cal.memory_time(per_param * updated, cl)


def _dp_exposed(
    m: Model, c: Config, cluster: str, last_backward: float, first_forward: float,
    cal: Calibration | None = None,
) -> float:  # fmt: skip
    """Sharded data parallelism (Megatron distributed optimizer; Llama 3's FSDP without
    resharding): a reduce-scatter of the gradients (``grad_bytes`` each, fp32 in both) and an
    all-gather of the updated bf16
    parameters once per step. With overlap the reduce-scatter runs under the last micro-batch's
    backward and the all-gather under the next step's first forward (``--overlap-grad-reduce``,
    ``--overlap-param-gather``); only what sticks out is exposed, and the hidden part slows the
    compute under it by the collective's share of the SMs (``Calibration.overlap_penalty``)."""
    if c.dp * c.cp == 1:
        return 0.0
    params = _local_params(m, c)
    mesh = _mesh(c, cluster)
    group = ("dp", "cp")  # context-parallel ranks hold the same parameters: they reduce too
    rs = collective_time("reduce-scatter", c.grad_bytes * params / (c.dp * c.cp), group, mesh)
    ag = collective_time("all-gather", BYTES * params, group, mesh)
    if not c.dp_overlap:
        return rs + ag
    cal = cal or default_calibration(cluster)
    hidden = min(rs, last_backward) + min(ag, first_forward)
    exposed = max(0.0, rs - last_backward) + max(0.0, ag - first_forward)
    return exposed + cal.overlap_penalty(hidden)
