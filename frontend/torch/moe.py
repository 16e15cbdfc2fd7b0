"""Mixture-of-experts capture: a traceable experts forward for HF MoE models.

HF routes experts through ``grouped_mm`` (a meta kernel that accepts bf16 only) or an eager
loop over the experts that were hit (``nonzero``: data-dependent shapes), so neither traces
on fake tensors. transformers lets a model pick its experts implementation by name
(``ExpertsInterface`` / ``config._experts_implementation``); :func:`use_dispatch` registers
``"shardplan"``, a GShard-style capacity dispatch with static shapes:

    x[T,h] -> groups [G,S,h] -> moe_dispatch -> [E,G,C,h] -> expert matmuls batched over E
      -> moe_combine (weighted by the router's top-k weights) -> [G,S,h] -> [T,h]

Three custom ops (``shardplan::moe_dispatch``, ``moe_combine``, ``moe_combine_wgrad``) carry
the token permutation; their backward is made of the same ops, so a training step traces to
them and lowers to the IR rules of ``ir/moe.py``. The expert matmuls are plain ``bmm``.

``capacity_factor=None`` (the default) is dropless: every group keeps a slot per token for
every expert, so the result equals HF's eager path exactly, and the dispatched buffer holds
``E/K`` times the routed tokens (priced as such). A number ``f`` gives GShard's
``C = ceil(f * S * K / E)`` slots per expert and group; tokens past it are dropped (their
expert output is 0), which is what capacity-based systems run and price.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn

from ...ir.errors import ArgumentError

IMPLEMENTATION = "shardplan"
"""The name :func:`use_dispatch` registers with transformers' ``ExpertsInterface``."""
LOAD_IMBALANCE = 1.25
"""Tokens the busiest expert gets over the mean (settable). A model on ``meta`` (planned from
shapes, never run) is captured with ``capacity_factor=LOAD_IMBALANCE``: a dropless system whose
busiest expert takes 1.25x the mean load runs as long as a capacity-1.25 one (every device waits
for it), so expert matmuls, dispatch buffers and all-to-alls are priced at that load. 1.25 is
the capacity factor Switch Transformer and GShard train with (Fedus et al. 2021, Table 1:
1.0-2.0; Lepikhin et al. 2020)."""
DISPATCHERS = ("gshard", "deepep")
DISPATCHER = "gshard"
"""How the run being priced moves tokens to their experts (settable; ``dispatcher(name)``
sets it for a block). ``"gshard"``: the all-to-all carries every (token, expert) slot of the
capacity buffer (GShard; Megatron-Core's ``alltoall`` dispatcher). ``"deepep"``: each token
goes once to each rank holding any of its top-k experts and is copied to them there (DeepEP's
dispatch and combine kernels, Megatron-Core's ``flex`` dispatcher), so the expert all-to-alls
move ``distinct ranks / top_k`` of the slots (``ir.moe.wire_type``: 0.67 for top-8 of 128
experts on 8 ranks). Pricing only: the emitted step runs the GShard dispatch either way, so a
``follow_plan`` check of a ``"deepep"`` plan sees the full buffer's bytes."""
DEFAULT_GROUPS = 64
"""Token groups: ``gcd(tokens, DEFAULT_GROUPS)``. Groups are what data and expert axes split on
the token side, so their count must be divisible by those axes' product."""


@contextlib.contextmanager
def dispatcher(name: str) -> Iterator[None]:
    """Capture with ``DISPATCHER = name`` inside the block (``"gshard"`` or ``"deepep"``)."""
    global DISPATCHER
    if name not in DISPATCHERS:
        raise ArgumentError(f"unknown MoE dispatcher {name!r}; use one of {DISPATCHERS}")
    saved, DISPATCHER = DISPATCHER, name
    try:
        yield
    finally:
        DISPATCHER = saved


def _slots(idx: torch.Tensor, experts: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot of each (token, choice) in its expert (a running count in token order) and keep."""
    g, s, k = idx.shape
    flat = idx.reshape(g, s * k)
    onehot = nn.functional.one_hot(flat, experts)
    pos = (onehot.cumsum(1) - 1).gather(2, flat.unsqueeze(-1)).squeeze(-1).reshape(g, s, k)
    return pos.clamp(max=capacity - 1), pos < capacity


@torch.library.custom_op("shardplan::moe_dispatch", mutates_args=())
def moe_dispatch(
    x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor | None, experts: int, capacity: int
) -> torch.Tensor:
    """x[G,S,h], idx[G,S,K] (w[G,S,K]) -> [E,G,C,h]: each token copied (times w) to its slots."""
    g, s, h = x.shape
    pos, keep = _slots(idx, experts, capacity)
    out = x.new_zeros(experts, g, capacity, h)
    vals = x.unsqueeze(2).expand(g, s, idx.shape[2], h)
    if w is not None:
        vals = vals * w.to(x.dtype).unsqueeze(-1)
    groups = torch.arange(g, device=x.device).view(g, 1, 1).expand_as(idx)
    out.index_put_((idx[keep], groups[keep], pos[keep]), vals[keep], accumulate=True)
    return out


@moe_dispatch.register_fake
def _(x, idx, w, experts, capacity):  # type: ignore[no-untyped-def]
    return x.new_empty(experts, x.shape[0], capacity, x.shape[2])


def _gathered(y: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """y[E,G,C,h] at each (token, choice)'s slot: [G,S,K,h], and the keep mask [G,S,K]."""
    pos, keep = _slots(idx, y.shape[0], y.shape[2])
    groups = torch.arange(idx.shape[0], device=y.device).view(-1, 1, 1).expand_as(idx)
    return y[idx, groups, pos], keep


@torch.library.custom_op("shardplan::moe_combine", mutates_args=())
def moe_combine(y: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y[E,G,C,h], idx[G,S,K], w[G,S,K] -> [G,S,h]: the weighted sum of each token's slots."""
    vals, keep = _gathered(y, idx)
    return (vals * (w * keep).to(y.dtype).unsqueeze(-1)).sum(2)


@moe_combine.register_fake
def _(y, idx, w):  # type: ignore[no-untyped-def]
    return y.new_empty(idx.shape[0], idx.shape[1], y.shape[3])


@torch.library.custom_op("shardplan::moe_combine_wgrad", mutates_args=())
def moe_combine_wgrad(gout: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """d(combine)/dw: gout[G,S,h] . y at each (token, choice)'s slot -> [G,S,K] (0 if dropped)."""
    vals, keep = _gathered(y, idx)
    return (vals * gout.unsqueeze(2)).sum(-1) * keep.to(y.dtype)


@moe_combine_wgrad.register_fake
def _(gout, y, idx):  # type: ignore[no-untyped-def]
    return gout.new_empty(idx.shape)


def _dispatch_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    ctx.save_for_backward(inputs[1])


def _dispatch_backward(ctx, grad):  # type: ignore[no-untyped-def]
    (idx,) = ctx.saved_tensors
    ones = torch.ones_like(idx, dtype=grad.dtype)  # a DTensor like idx when idx is one
    return moe_combine(grad, idx, ones), None, None, None, None


def _combine_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    y, idx, w = inputs
    ctx.save_for_backward(y, idx, w)


def _combine_backward(ctx, grad):  # type: ignore[no-untyped-def]
    y, idx, w = ctx.saved_tensors
    grad_y = moe_dispatch(grad, idx, w, y.shape[0], y.shape[2])
    grad_w = moe_combine_wgrad(grad, y, idx).to(w.dtype)
    return grad_y, None, grad_w


moe_dispatch.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)
moe_combine.register_autograd(_combine_backward, setup_context=_combine_setup)


def _register_dtensor_strategies() -> None:
    """The layouts each op runs at on DTensors, per mesh dim: the IR rules' (``ir/moe.py``).

    Groups ``g`` and hidden ``h`` split; everything that addresses slots (tokens, choices,
    experts, capacity) stays whole on the device, because the kernels count slot positions
    over the whole group and index experts globally."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    r = Replicate()

    @register_sharding(torch.ops.shardplan.moe_dispatch.default)
    def _dispatch(x, idx, w, experts, capacity):  # type: ignore[no-untyped-def]
        def ins(xp, ip):  # type: ignore[no-untyped-def]
            return [xp, ip, None if w is None else ip, None, None]

        return [([r], ins(r, r)), ([Shard(1)], ins(Shard(0), Shard(0))),
                ([Shard(3)], ins(Shard(2), r))]  # fmt: skip

    @register_sharding(torch.ops.shardplan.moe_combine.default)
    def _combine(y, idx, w):  # type: ignore[no-untyped-def]
        return [([r], [r, r, r]), ([Shard(0)], [Shard(1), Shard(0), Shard(0)]),
                ([Shard(2)], [Shard(3), r, r])]  # fmt: skip

    @register_sharding(torch.ops.shardplan.moe_combine_wgrad.default)
    def _wgrad(gout, y, idx):  # type: ignore[no-untyped-def]
        return [([r], [r, r, r]), ([Shard(0)], [Shard(0), Shard(1), Shard(0)]),
                ([Partial()], [Shard(2), Shard(3), r])]  # fmt: skip


_register_dtensor_strategies()


def capacity(tokens: int, top_k: int, experts: int, capacity_factor: float | None) -> int:
    """Slots per expert and group: all ``tokens`` when dropless, else GShard's rounding up."""
    if capacity_factor is None:
        return tokens
    if capacity_factor <= 0:
        raise ArgumentError(f"capacity_factor must be positive or None, got {capacity_factor}")
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * top_k / experts)))


def experts_forward(
    module: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The ``"shardplan"`` experts implementation (HF's experts signature and weight layout)."""
    tokens, hidden = hidden_states.shape
    experts, top_k = module.num_experts, top_k_index.shape[-1]
    groups = math.gcd(tokens, int(getattr(module, "shardplan_groups", DEFAULT_GROUPS)))
    per_group = tokens // groups
    cf = getattr(module, "shardplan_capacity_factor", None)
    slots = capacity(per_group, top_k, experts, cf)
    x = hidden_states.reshape(groups, per_group, hidden)
    idx = top_k_index.reshape(groups, per_group, top_k)
    weights = top_k_weights.reshape(groups, per_group, top_k)
    xe = moe_dispatch(x, idx, None, experts, slots).reshape(experts, groups * slots, hidden)
    up = module.gate_up_proj if module.has_gate else module.up_proj
    h = torch.bmm(xe, up if module.is_transposed else up.transpose(1, 2))
    if getattr(module, "has_bias", False):
        h = h + (module.gate_up_proj_bias if module.has_gate else module.up_proj_bias)[:, None]
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    down = module.down_proj
    y = torch.bmm(h, down if module.is_transposed else down.transpose(1, 2))
    if getattr(module, "has_bias", False):
        y = y + module.down_proj_bias[:, None]
    y = y.reshape(experts, groups, slots, hidden)
    out = moe_combine(y, idx, weights.to(y.dtype))
    return out.reshape(tokens, hidden).to(hidden_states.dtype)


def _is_experts(module: nn.Module) -> bool:
    """An HF experts module built with ``use_experts_implementation`` (3-D expert weights)."""
    return hasattr(module, "_is_expert_parallel") and hasattr(module, "num_experts")


def use_dispatch(
    model: nn.Module, capacity_factor: float | None = None, groups: int = DEFAULT_GROUPS
) -> int:
    """Switch every HF experts module of ``model`` to the ``"shardplan"`` implementation.

    Returns how many experts modules were switched (0: not an HF MoE model). The switch stays
    on the model: ``follow_plan`` replays the captured calls, so the model must run the same
    implementation. With ``capacity_factor=None`` it computes exactly what HF's eager path does.
    """
    found = [m for m in model.modules() if _is_experts(m)]
    if not found:
        return 0
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, experts_forward)
    for module in found:
        unsupported = getattr(module, "has_post_expert_norm", False) or not getattr(
            module, "is_concatenated", True
        )
        if unsupported:
            raise NotImplementedError(
                f"{type(module).__name__}: interleaved or post-normed experts are not lowered yet"
            )
        module.shardplan_capacity_factor = capacity_factor
        module.shardplan_groups = groups
        module.config._experts_implementation = IMPLEMENTATION
    return len(found)


def ensure_traceable(model: nn.Module) -> None:
    """Before a capture: HF experts not yet on a traceable implementation get the
    ``"shardplan"`` dispatch (a user's earlier :func:`use_dispatch` choice is kept): dropless
    (exactly HF's numerics) for a model with data, ``LOAD_IMBALANCE`` for one on ``meta``."""
    for module in model.modules():
        if _is_experts(module) and module.config._experts_implementation != IMPLEMENTATION:
            on_meta = any(p.is_meta for p in module.parameters())
            use_dispatch(model, capacity_factor=LOAD_IMBALANCE if on_meta else None)
            return
