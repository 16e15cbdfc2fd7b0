"""A two-layer torch MLP planned by shardplan and trained on simulated ranks.

Run: ``python examples/torch_mlp.py``. Tests import ``make()``, which returns ``(model, inputs)``.
With a large batch the plan is data parallel; with a tiny batch and a wide hidden layer it is
Megatron column -> row tensor parallelism.
"""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """``fc2(gelu(fc1(x)))``: the smallest model with a column -> row parallel pair."""

    def __init__(self, dim: int, hidden: int, bias: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def make(
    batch: int = 64, dim: int = 32, hidden: int = 128, bias: bool = True, seed: int = 0
) -> tuple[nn.Module, tuple]:
    """The model and its example inputs (real tensors; shapes are all the planner reads)."""
    torch.manual_seed(seed)
    return MLP(dim, hidden, bias), (torch.randn(batch, dim),)


def main() -> None:
    import shardplan as sp
    from checks import torch_check

    model, inputs = make()
    plan = sp.plan(model, *inputs, mesh=sp.Mesh({"dp": 2, "tp": 2}, cluster="cpu-test"))
    print(plan)
    print("DTensor placements on the (dp, tp) device mesh:")
    for fqn, placements in plan.to_placements().items():
        print(f"  {fqn:12s} {placements}")
    torch_check(plan, model, inputs)


if __name__ == "__main__":
    main()
