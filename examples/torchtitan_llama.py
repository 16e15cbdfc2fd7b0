"""torchtitan's Llama 3 training step as a CLI target: plan it, emit torchtitan's flags.

    shardplan plan examples/torchtitan_llama.py:make --mesh dp=4,tp=2 --emit torchtitan \\
        --flavor debugmodel

``make`` captures torchtitan's own ``Transformer`` (``llama3_args[flavor]``) on the ``meta``
device with its cross-entropy loss, so nothing is allocated (``8B`` and ``70B`` work too; use
``batch`` = the global batch, ``seq_len`` = ``training.seq_len``).
"""

from __future__ import annotations


def make(flavor: str = "debugmodel", batch: int = 8, seq_len: int = 64, dtype: str = "float32"):  # type: ignore[no-untyped-def]
    from shardplan.frontend.torch.torchtitan import capture_llama

    graph, _ = capture_llama(flavor, batch, seq_len, mixed_precision=dtype)
    return graph
