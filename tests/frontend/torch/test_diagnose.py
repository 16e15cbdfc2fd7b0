"""Trace failures name the op, the model line and the fix (``diagnose.py``)."""

from __future__ import annotations

import pytest
import shardplan as sp
import torch
from shardplan.ir import FrontendError

pytestmark = [pytest.mark.torch]


def _wav2vec2() -> torch.nn.Module:
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    torch.manual_seed(0)
    config = Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, vocab_size=32,
    )  # fmt: skip
    return Wav2Vec2ForCTC(config)


def test_trace_failure_data_dependent_names_op_line_and_fix() -> None:
    """Wav2Vec2ForCTC checks ``labels.max()`` in Python: the error says so and how to plan."""
    inputs = {"input_values": torch.randn(2, 800), "labels": torch.randint(1, 32, (2, 10))}
    with pytest.raises(FrontendError) as info:
        sp.plan(_wav2vec2(), inputs, mesh=sp.Mesh({"dp": 2}))
    message = str(info.value)
    assert "aten._local_scalar_dense" in message
    assert "Wav2Vec2ForCTC.forward" in message
    assert "labels.max()" in message
    assert "loss_fn=" in message
