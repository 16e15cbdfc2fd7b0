"""``--input NAME=SHAPE[:DTYPE]``: example keyword inputs of a torch model from the shell.

    shardplan plan model.py --mesh dp=8 --input input_ids=8x128:int64 --input labels=8x128:int64

The factory then may return the model alone (or ``(model, example_args)``, the named inputs
added to them); each input is passed to ``forward`` by name, as ``sp.plan(model,
input_ids=...)`` does. Integer inputs are zeros (valid token ids), floating ones normal samples.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

_INPUT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=([0-9]+(?:[x,][0-9]+)*)(?::([A-Za-z0-9_]+))?$")


def parse_input(text: str) -> tuple[str, tuple[int, ...], str]:
    """``input_ids=8x128:int64`` -> ``("input_ids", (8, 128), "int64")`` (dtype float32 when
    left out; dims split by ``x`` or ``,``)."""
    match = _INPUT.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(
            f"bad input {text!r}: write NAME=SHAPE[:DTYPE], dims split by x, like "
            "input_ids=8x128:int64 or pixel_values=8,3,32,32"
        )
    name, shape, dtype = match.groups()
    return name, tuple(int(d) for d in re.split("[x,]", shape)), dtype or "float32"


def keyword_inputs(specs: list[tuple[str, tuple[int, ...], str]]) -> dict[str, Any]:
    """The named example tensors (torch is imported only when some are given)."""
    if not specs:
        return {}
    from .frontend.torch.inputs import example_tensor
    from .ir.errors import ArgumentError

    out: dict[str, Any] = {}
    for name, shape, dtype in specs:
        if name in out:
            raise ArgumentError(f"--input {name}= is given twice; give each input once")
        out[name] = example_tensor(shape, dtype)
    return out
