"""Sharding rules of the mixture-of-experts ops (GShard-style capacity dispatch).

Tokens come in ``G`` groups of ``S`` tokens; each token picks ``K`` of ``E`` experts (router
top-k) and lands in one of ``C`` capacity slots of each expert it picked (slots fill in token
order; a token past an expert's capacity is dropped, GShard's semantics). The letters:

  ``g`` token group, ``s`` token in its group, ``k`` choice (top-k), ``h`` hidden,
  ``e`` expert, ``c`` capacity slot.

* ``moe_dispatch(x[g,s,h], idx[g,s,k] (, w[g,s,k])) -> xe[e,g,c,h]``: slot positions are a
  running count over all of a group's (token, choice) pairs, so ``s``, ``k`` and ``c`` need
  replication; the kernel addresses experts by their global index, so ``e`` does too (a device
  cannot fill only its own experts' slots). With ``w`` the slots are weighted (the backward of
  combine). Groups ``g`` and hidden ``h`` split freely.
* ``moe_combine(y[e,g,c,h], idx, w) -> out[g,s,h]``: the weighted sum of each token's slots;
  ``g`` and ``h`` split, the rest need replication for the same reasons.
* ``moe_combine_wgrad(gout[g,s,h], y[e,g,c,h], idx) -> gw[g,s,k]``: the gradient of the
  combine weights, a dot over ``h`` (a reduction: split ``h`` gives a partial sum).

These are the layouts the torch kernels run at (``frontend/torch/moe.py`` registers the same
ones with DTensor), so a plan never asks for one the emitted step cannot compute.

Expert parallelism is then ordinary factor algebra: the expert matmuls are batched over ``e``
(``[e, g*c, h] @ [e, h, f]``), so splitting ``e`` over an axis that also splits ``g`` on the
dispatch output turns the reshard ``xe[e, g{ep}, c, h] -> xe[e{ep}, g, c, h]`` into one
all-to-all (and back for the combine). Attributes: ``experts``, ``capacity``,
``capacity_factor`` (None: dropless, every token fits), ``top_k``.
"""

from __future__ import annotations

from .registry import register_rule
from .rule_helpers import Attrs, Types
from .rules import ShardingRule


def dispatch(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    operands = "gsh,gsk" + (",gsk" if len(ins) > 2 else "")
    shapes = [t.shape for t in ins]
    return ShardingRule.from_spec(f"{operands}->egch", shapes, [outs[0].shape], "skce")


def combine(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    return ShardingRule.from_spec(
        "egch,gsk,gsk->gsh", [t.shape for t in ins], [outs[0].shape], "ecks"
    )


def combine_wgrad(ins: Types, outs: Types, attrs: Attrs) -> ShardingRule:
    return ShardingRule.from_spec(
        "gsh,egch,gsk->gsk", [t.shape for t in ins], [outs[0].shape], "ecks"
    )


register_rule("moe_dispatch", dispatch, flops="none")
register_rule("moe_combine", combine)
register_rule("moe_combine_wgrad", combine_wgrad)
