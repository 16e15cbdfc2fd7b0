"""Fused RMSNorm capture: price a model's RMSNorms as the one-kernel norm its run launches.

HF's RMSNorm is eager PyTorch: an fp32 cast, ``pow``, ``mean``, ``rsqrt``, two ``mul`` and a
cast back, each a kernel with its own HBM round trip (the elementwise fusion of
``costmodel/fusion.py`` keeps some of them on chip, never the fp32 copy that two ops read).
Runs on Transformer Engine (``rms_norm: te``), Apex or Liger launch one fused kernel instead:
forward reads ``x`` and writes ``y`` and the per-row ``rstd``, backward reads ``dy``, ``x``,
``rstd`` and writes ``dx`` and the weight gradient. :func:`use_fused_rms_norm` switches a
model's RMSNorm modules to two custom ops (``shardplan::rms_norm_fused`` and its backward) that
trace to the IR's ``rms_norm`` / ``rms_norm_backward`` row kernels and are priced as such.

The ops compute exactly HF's formula (``weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)``)
on plain tensors and on DTensors (rows split, or everything replicated), so a plan captured
with them applies and runs.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from ...ir.errors import ArgumentError


def _accumulate(x: torch.Tensor) -> torch.dtype:
    """fp32, as HF computes the norm (fp64 stays fp64)."""
    return torch.promote_types(x.dtype, torch.float32)


@torch.library.custom_op("shardplan::rms_norm_fused", mutates_args=())
def rms_norm_fused(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x[..., h], weight[h] -> (y[..., h], rstd[..., 1] in fp32): HF's RMSNorm."""
    x32 = x.to(_accumulate(x))
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x32 * rstd).to(x.dtype), rstd


@rms_norm_fused.register_fake
def _(x, weight, eps):  # type: ignore[no-untyped-def]
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1), dtype=_accumulate(x))


@torch.library.custom_op("shardplan::rms_norm_fused_backward", mutates_args=())
def rms_norm_fused_backward(
    grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy, x, rstd, weight) -> (dx, dweight) of :func:`rms_norm_fused`."""
    acc = _accumulate(x)
    x32, g32 = x.to(acc), grad.to(acc)
    normed = x32 * rstd
    dweight = (g32 * normed.to(x.dtype).to(acc)).reshape(-1, x.shape[-1]).sum(0)
    gn = g32 * weight.to(acc)
    dx = rstd * (gn - normed * (gn * normed).mean(-1, keepdim=True))
    return dx.to(x.dtype), dweight.to(weight.dtype)


@rms_norm_fused_backward.register_fake
def _(grad, x, rstd, weight):  # type: ignore[no-untyped-def]
    return torch.empty_like(x), torch.empty_like(weight)


def _setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x, weight, _ = inputs
    ctx.save_for_backward(x, output[1], weight)
    ctx.mark_non_differentiable(output[1])  # rstd: no gradient flows in (no zeros traced)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_y, grad_rstd):  # type: ignore[no-untyped-def]
    if grad_y is None:  # y unused
        return None, None, None
    x, rstd, weight = ctx.saved_tensors
    dx, dweight = rms_norm_fused_backward(grad_y, x, rstd, weight)
    return dx, dweight, None


rms_norm_fused.register_autograd(_backward, setup_context=_setup)


def _register_dtensor_strategies() -> None:
    """Per mesh dim: every tensor replicated, or a row dim of ``x`` split (``y``, ``rstd`` and
    ``dx`` split alike, the weight replicated, its gradient ``Partial``: a sum over rows)."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    r = Replicate()

    @register_sharding(torch.ops.shardplan.rms_norm_fused.default)
    def _forward(x, weight, eps):  # type: ignore[no-untyped-def]
        rows = [([Shard(d), Shard(d)], [Shard(d), r, None]) for d in range(x.ndim - 1)]
        return [([r, r], [r, r, None]), *rows]

    @register_sharding(torch.ops.shardplan.rms_norm_fused_backward.default)
    def _backward_rule(grad, x, rstd, weight):  # type: ignore[no-untyped-def]
        rows = [
            ([Shard(d), Partial()], [Shard(d), Shard(d), Shard(d), r]) for d in range(x.ndim - 1)
        ]
        return [([r, r], [r, r, r, r]), *rows]


_register_dtensor_strategies()


def _eps(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _computes_rms_norm(module: nn.Module, eps: float) -> bool:
    """Whether ``module``'s own forward is HF's RMSNorm: run on a small CPU probe with the
    module's weight shape (a module on ``meta`` has no values to run)."""
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):  # bf16: the casts must sit where HF's do
        weight = torch.rand(module.weight.shape, generator=generator) + 0.5
        x = torch.randn(3, weight.shape[0], generator=generator).to(dtype)
        probe = nn.Module()
        probe.__dict__.update({k: v for k, v in module.__dict__.items() if k != "_parameters"})
        probe._parameters = {"weight": nn.Parameter(weight.to(dtype))}
        probe._modules, probe._buffers = {}, {}
        try:
            with torch.no_grad():
                got = type(module).forward(probe, x)
        except Exception:  # a forward that cannot run on the probe is no match
            return False
        want, _ = rms_norm_fused(x, probe.weight.detach(), eps)
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype:
            return False
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            return False
    return True


def _fused_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm_fused(hidden_states, self.weight, self.shardplan_eps)[0]


def use_fused_rms_norm(model: nn.Module) -> int:
    """Switch every RMSNorm module of ``model`` (a ``*Norm`` class with a 1-D ``weight``, an
    ``eps`` or ``variance_epsilon``, and a forward that computes HF's formula, casts included:
    checked on an fp32 and a bf16 probe; LayerNorms, Gemma's ``1 + weight`` and OLMo-2's
    weight-before-cast are left alone) to the fused ops. Returns how many were switched; the
    switch stays on the model, so ``plan.apply`` runs the same ops (their results equal HF's)."""
    if not isinstance(model, nn.Module):
        raise ArgumentError(
            f"use_fused_rms_norm takes a torch.nn.Module, got {type(model).__name__}: pass the "
            "model whose RMSNorms to switch (before sp.plan / sp.evaluate)"
        )
    switched = 0
    for module in model.modules():
        weight, eps = getattr(module, "weight", None), _eps(module)
        if "Norm" not in type(module).__name__ or eps is None:
            continue
        if not isinstance(weight, torch.Tensor) or weight.ndim != 1:
            continue
        if getattr(module, "shardplan_eps", None) is None and not _computes_rms_norm(module, eps):
            continue
        module.shardplan_eps = eps
        module.forward = types.MethodType(_fused_forward, module)
        switched += 1
    return switched


__all__ = ["rms_norm_fused", "rms_norm_fused_backward", "use_fused_rms_norm"]
