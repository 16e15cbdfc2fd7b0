"""Functional optimizer updates traced into the training-step graph.

Written with plain tensor ops (no ``torch.optim``) so ``make_fx`` records them as aten ops and the
planner sees the optimizer: its states are inputs and its updates are outputs aliased to them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...ir.errors import ArgumentError


@dataclass(frozen=True, slots=True)
class OptimizerSpec:
    """Hyper-parameters of the traced update (they do not change the graph's shape)."""

    name: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    momentum: float = 0.875
    """``sgd-momentum`` only (DeepLearningExamples' ResNet-50 recipe value)."""

    @property
    def state_names(self) -> tuple[str, ...]:
        """Per-parameter fp32 state tensors, in the order the step takes them."""
        match self.name:
            case "adamw":
                return ("exp_avg", "exp_avg_sq")
            case "sgd":
                return ()
            case "sgd-momentum":
                return ("momentum_buffer",)  # torch.optim.SGD's state name
            case _:
                raise ArgumentError(
                    f"unknown optimizer {self.name!r}; use 'adamw', 'sgd' or 'sgd-momentum'"
                )


def init_states(spec: OptimizerSpec, param: torch.Tensor) -> list[torch.Tensor]:
    """Fresh states shaped like ``param`` (fp32, as torch.optim.AdamW keeps them)."""
    return [torch.zeros(param.shape, dtype=torch.float32) for _ in spec.state_names]


def update(
    spec: OptimizerSpec, param: torch.Tensor, grad: torch.Tensor, states: list[torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One step for one parameter: ``(new_param, new_states)``."""
    if spec.name == "sgd":
        return param - grad * spec.lr, []
    if spec.name == "sgd-momentum":  # torch.optim.SGD after its first step (weight decay,
        (buf,) = states  # momentum buffer in fp32, then the step)
        d_p = grad.float() + param.float() * spec.weight_decay
        buf = buf * spec.momentum + d_p
        return param - (buf * spec.lr).to(param.dtype), [buf]
    # AdamW (Loshchilov & Hutter), first step: bias corrections with t = 1.
    beta1, beta2 = spec.betas
    exp_avg, exp_avg_sq = states
    grad32 = grad.float()
    exp_avg = exp_avg * beta1 + grad32 * (1 - beta1)
    exp_avg_sq = exp_avg_sq * beta2 + grad32 * grad32 * (1 - beta2)
    step = (exp_avg / (1 - beta1)) / ((exp_avg_sq / (1 - beta2)).sqrt() + spec.eps)
    new_param = param * (1 - spec.lr * spec.weight_decay) - (step * spec.lr).to(param.dtype)
    return new_param, [exp_avg, exp_avg_sq]
