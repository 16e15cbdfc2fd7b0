"""The torchtitan search's closed form prices a pipeline as torchtitan runs one (no torch).

A hand-made ``StepProfile`` (a Llama-shaped step: per-layer forward/backward seconds, the
embedding, head and optimizer outside the layers) is priced on pipelined configurations and
checked against what torchtitan's schedules do: FSDP keeps a stage's parameters gathered for
the step with fp32 gradient accumulators, the gradients are reduced once after the last
backward, and the last stage runs the output and loss on every micro-batch.
"""

from __future__ import annotations

import numpy as np
import pytest
from shardplan.solver.titan_config import TitanConfig
from shardplan.solver.titan_search import StepProfile, price

LAYERS, LAYER_PARAMS, HIDDEN = 16, 200_000_000, 4096
ENDS = 2 * 128_000 * HIDDEN  # embedding + output
LIMIT = 80 * 2**30


def _profile(post: float = 0.2) -> StepProfile:
    """One step of a 16-layer model on one device: each layer 1 s forward, 2 s backward;
    ``post`` seconds of head and loss (one op), a little embedding and optimizer work."""

    def part(*seconds: float) -> tuple[np.ndarray, np.ndarray]:
        return np.array(seconds), np.ones(len(seconds))

    return StepProfile(
        layers=LAYERS,
        groups={"forward": part(1.0), "backward": part(2.0), "pre": part(0.01),
                "post": part(post), "update": part(0.05), "other": part(0.01, post, 0.05)},
        floor=0.0, layer_params=LAYER_PARAMS, params=LAYERS * LAYER_PARAMS + ENDS,
        saved={"none": 0, "selective": 0, "full": 0}, other_saved=0, batch=64, seq_len=4096,
        hidden=HIDDEN, kv_hidden=1024, activation_bytes=2,
    )  # fmt: skip


def _pipelined(**changes: object) -> TitanConfig:
    base = TitanConfig(pp=4, dp_shard=8, local_batch_size=8, seq_len=4096, microbatch_size=1)
    return base.replace(**changes)


def test_pipelined_fsdp_holds_the_stage_gathered_with_fp32_gradients() -> None:
    """Under PP torchtitan turns FSDP's reshard after forward off and pipelining keeps the
    parameters unsharded with no gradient sync between micro-batches: a device holds its
    stage's parameters whole (bf16) plus fp32 gradient accumulators of that size."""
    config = _pipelined()
    stage = LAYERS / config.pp * LAYER_PARAMS + ENDS / 2
    priced = price(_profile(), config, "h100-sxm", LIMIT)
    assert priced.memory_bytes >= stage * (2 + 4)
    unpipelined = price(_profile(), config.replace(pp=1, dp_shard=32), "h100-sxm", LIMIT)
    assert unpipelined.memory_bytes < stage * (2 + 4)  # FSDP alone gathers two layers


def test_pipelined_gradient_reduction_is_exposed_after_the_last_backward() -> None:
    """The stage's gradients are reduce-scattered once, after its last backward (the
    schedule's REDUCE_GRAD): nothing is left to hide them under on the first stage, however
    much compute the layers have, so more of it never hides them (it did: the closed form
    hid each layer's reduction under the whole batch's backward of the next)."""
    config = _pipelined()
    light, heavy = _profile(), _profile()
    heavy.groups["backward"] = (np.array([200.0]), np.ones(1))
    exposed = [price(p, config, "h100-sxm", LIMIT).parts["fsdp_exposed"] for p in (light, heavy)]
    assert exposed[1] > 0
    assert exposed[1] == pytest.approx(exposed[0])


def test_the_last_stage_paces_every_microbatch_with_the_head() -> None:
    """The output layer and loss run on the last stage for every micro-batch, so under 1F1B
    its ``post`` seconds (of the whole local batch) lengthen the step by all of them (the
    bottleneck stage runs m micro-batches of it), not by ``post / pp``."""
    config = _pipelined(dp_shard=1, dp_replicate=1, tp=8, local_batch_size=64)
    n = config.data_parallel * config.cp * config.tp
    steps = [price(_profile(post), config, "h100-sxm", LIMIT).step_time for post in (0.0, 8.0)]
    assert steps[1] - steps[0] == pytest.approx(8.0 / n, rel=0.01)  # (less the embedding)
