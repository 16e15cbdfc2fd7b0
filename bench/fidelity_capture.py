"""Per-layer cost of a published configuration from a graph captured through the torch frontend.

``bench/fidelity.py --capture`` uses this to check the analytic per-layer model against the
planner's own cost model on real model code: each row's transformer is built from HF classes on
the ``meta`` device (OPT blocks for the GPTs, Llama blocks for Llama 3, see ``_hf_model``;
nothing is allocated),
its training step (forward, loss, backward, AdamW) is captured with one and with two layers at the
row's micro-batch, and both graphs are priced by ``sp.evaluate`` under
``sp.strategies.megatron(tp=..., sequence_parallel=..., recompute=..., tp_comm_overlap=...)``
on a ``{"tp": t}`` mesh of the row's cluster with the calibration applied
(``costmodel.calibration.apply``). The
difference of the two is one layer: its model FLOPs and its simulated step time (compute plus
exposed TP communication), less the update ops' compute.

Pipeline stages, the data-parallel reduction and the logits head stay with the analytic model:
``sp.evaluate`` does not price pipelines yet (``pp`` > 1 raises).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import cache

from shardplan.api.evaluate import model_flops
from shardplan.costmodel import get_cluster
from shardplan.costmodel.calibration import apply, default_calibration, with_attention_kernel
from shardplan.costmodel.cluster import register_cluster
from shardplan.costmodel.op_times import plan_op_times
from shardplan.costmodel.phases import Phase, op_phases
from transformer_cost import Config, Model


@dataclass(frozen=True, slots=True)
class CapturedLayer:
    """One layer's cost, from the difference of a two-layer and a one-layer captured step."""

    flops: float
    """Global model FLOPs of the layer (forward + backward + update), one micro-batch."""
    step_time: float
    """Simulated seconds of the layer's forward and backward on one tensor-parallel group
    (``sp.evaluate``), without its AdamW update (which runs once per step, not per
    micro-batch; the analytic ``optimizer_time`` prices it)."""
    ops: int
    """IR ops the layer adds to the graph."""


def _hf_model(m: Model, layers: int, seq: int, flash_attention: bool = True):
    """A HF causal LM with ``m``'s shapes and ``layers`` blocks, bf16, on ``meta``.

    The captured code is the computation the published run executed:

    - attention: fused (``sdpa``, lowered to the IR's ``attention`` op) where the run used flash
      attention, else HF's ``eager`` attention, which materialises the ``b a s^2`` scores
      (QK^T, scale, mask, softmax, dropout, PV) as Megatron-LM's non-flash path did in 2022;
    - dropout 0.1 (Megatron's default hidden and attention dropout) where the run had dropout;
    - the GPT MLP activation is ``gelu`` (one kernel, as Megatron's fused bias-GeLU), not HF's
      default ``gelu_new``, which is written as a chain of eight elementwise torch calls.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    if m.gated_mlp:
        config = LlamaConfig(
            vocab_size=m.vocab, hidden_size=m.hidden, intermediate_size=m.ffn,
            num_hidden_layers=layers, num_attention_heads=m.heads,
            num_key_value_heads=m.kv_heads or m.heads, max_position_embeddings=seq,
            attn_implementation="sdpa" if flash_attention else "eager",
        )  # fmt: skip
        cls = LlamaForCausalLM
    else:
        p = 0.1 if m.dropout else 0.0
        config = OPTConfig(
            vocab_size=m.vocab, hidden_size=m.hidden, num_hidden_layers=layers,
            ffn_dim=m.ffn, num_attention_heads=m.heads, max_position_embeddings=seq,
            word_embed_proj_dim=m.hidden, do_layer_norm_before=True, activation_function="gelu",
            dropout=p, attention_dropout=p, layerdrop=0.0, enable_bias=True,
            attn_implementation="sdpa" if flash_attention else "eager",
        )  # fmt: skip
        cls = OPTForCausalLM
    with torch.device("meta"):
        return cls(config).to(torch.bfloat16)


def _calibrated_cluster(cluster: str, attention: str | None = None) -> str:
    """Register the cluster with its generation's calibration (and the fused-attention kernel
    the run launched, ``calibration.ATTENTION_KERNELS``; None: the default's); return the
    registered name."""
    calibration = default_calibration(cluster)
    if attention is not None:
        calibration = with_attention_kernel(calibration, attention)
    calibrated = apply(calibration, get_cluster(cluster))
    register_cluster(calibrated)
    return calibrated.name


def _evaluate(m: Model, c: Config, cluster: str, layers: int):
    import shardplan as sp
    import torch

    model = _hf_model(m, layers, c.seq, c.flash_attention)
    ids = torch.empty((c.micro_batch, c.seq), dtype=torch.long, device="meta")
    axes = {"cp": c.cp, "tp": c.tp} if c.cp > 1 else {"tp": c.tp}  # a context-parallel group
    mesh = sp.Mesh(axes, cluster=_calibrated_cluster(cluster))
    recompute = None if c.recompute == "none" else c.recompute
    strategy = sp.strategies.megatron(
        tp=c.tp,
        sequence_parallel=c.sequence_parallel,
        recompute=recompute,
        tp_comm_overlap=c.tp_overlap and c.sequence_parallel and c.tp > 1,
        cp="cp" if c.cp > 1 else None,
        dp=() if c.cp > 1 else None,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sp.evaluate(model, {"input_ids": ids, "labels": ids}, mesh=mesh, strategy=strategy)


@cache
def captured_layer(m: Model, c: Config, cluster: str) -> CapturedLayer:
    """One layer of ``m`` under ``c``'s tensor parallelism, priced by ``sp.evaluate``."""
    one, two = (_evaluate(m, c, cluster, n) for n in (1, 2))
    flops = model_flops(two.plan.graph) - model_flops(one.plan.graph)
    ops = len(two.plan.graph.ops) - len(one.plan.graph.ops)
    plans = (one.plan, two.plan)
    if c.cp > 1:  # gradients are reduced over cp once per step (analytic, with dp), not per layer
        plans = tuple(_without_once_per_step_comm(p) for p in plans)
    time = _without_update(plans[1]) - _without_update(plans[0])
    return CapturedLayer(flops, time, ops)


def _without_once_per_step_comm(plan):  # type: ignore[no-untyped-def]
    """A copy of ``plan`` re-simulated without the reshards into its update ops and into the
    state carried to the next step (gradient reductions over the context-parallel axis, and
    gathers of what the update left sharded over it): they run once per step, not once per
    layer and micro-batch, and the analytic model prices them per step (``_dp_exposed``)."""
    import dataclasses

    from shardplan.costmodel.simulate import simulate

    phases = op_phases(plan.graph)
    update = {i for i, op in enumerate(plan.graph.ops) if phases[op] is Phase.UPDATE}
    kept = dataclasses.replace(plan, reshards=[
        r for r in plan.reshards
        if not r.consumer.startswith("alias:")
        and not (r.consumer.startswith("op:") and int(r.consumer.split(":")[1]) in update)
    ])  # fmt: skip
    return dataclasses.replace(kept, exposed_comm_time=simulate(kept).exposed_comm_time)


def _without_update(plan) -> float:
    """Step time less the compute of the optimizer-update ops (they run last, on the compute
    stream, so removing them shortens the step by their time)."""
    phases = op_phases(plan.graph)
    times = plan_op_times(plan)
    update = sum(
        t for op, t in zip(plan.graph.ops, times, strict=True) if phases[op] is Phase.UPDATE
    )
    return plan.step_time - update


def layer_key(c: Config) -> Config:
    """The part of a configuration one captured layer depends on (rows sharing it share one
    capture): parallel degrees other than tp, the batch and the data-parallel overlap flag do
    not matter; tensor-parallel communication overlap does."""
    return Config(
        c.tp,
        1,
        1,
        c.micro_batch,
        c.seq,
        c.micro_batch,
        1,
        c.sequence_parallel,
        c.recompute,
        c.flash_attention,
        tp_overlap=c.tp_overlap,
        cp=c.cp,
    )
