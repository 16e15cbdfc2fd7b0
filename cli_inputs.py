"""The command line's argument types: ``--mesh``, ``--memory-limit``, ``--pin``, ``--time-limit``
and ``--input NAME=SHAPE[:DTYPE]``, example keyword inputs of a torch model from the shell.

    shardplan plan model.py --mesh dp=8 --input input_ids=8x128:int64 --input labels=8x128:int64

The factory then may return the model alone (or ``(model, example_args)``, the named inputs
added to them); each input is passed to ``forward`` by name, as ``sp.plan(model,
input_ids=...)`` does. Integer inputs are zeros (valid token ids), floating ones normal samples.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from .ir import Pin, Sharding, ShardplanError, checks

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


# -- argument types (argparse turns their ArgumentTypeError into exit code 2) -------------------
def parse_mesh(text: str) -> dict[str, int]:
    """``dp=2,tp=4`` -> ``{"dp": 2, "tp": 4}`` (major axis first)."""
    axes: dict[str, int] = {}
    for item in text.split(","):
        name, sep, size = item.strip().partition("=")
        name = name.strip()
        if not sep or not name.isidentifier() or not size.strip().isdigit():
            raise argparse.ArgumentTypeError(
                f"bad mesh {text!r}: write named axes with sizes, major first, like dp=2,tp=4"
            )
        if name in axes:
            raise argparse.ArgumentTypeError(f"bad mesh {text!r}: axis {name!r} appears twice")
        if int(size) < 1:
            raise argparse.ArgumentTypeError(f"bad mesh {text!r}: axis {name!r} has size 0")
        axes[name] = int(size)
    return axes


def parse_size(text: str) -> int:
    """Bytes from ``40GB`` (10^9), ``512MiB`` (2^20), ``24e9`` or ``1.5TB`` (``ir.checks``)."""
    try:
        size = checks.parse_size(text)
    except ShardplanError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: give a size > 0, like 40GB")
    return size


def parse_pin(text: str) -> tuple[str, Pin]:
    """``KEY=DIMS[:pN]``: one dim per comma, ``_`` replicated, ``dp+tp`` two axes, ``:p0``
    Shardy's user priority: ``w1=_,tp:p1`` pins ``w1`` to ``[{}, {"tp"}]`` at priority 1."""
    key, eq, spec = text.rpartition("=")
    spec, colon, level = spec.partition(":")
    bad = (
        not eq or not key or not spec or (colon and not (level[:1] == "p" and level[1:].isdigit()))
    )
    if bad:
        raise argparse.ArgumentTypeError(
            f"bad pin {text!r}: write KEY=DIMS[:pN], one dim per comma, '_' for a replicated "
            "dim, '+' between axes, like w1=_,tp or x=dp+tp,_:p0"
        )
    dims = [() if d in ("", "_") else tuple(d.split("+")) for d in spec.split(",")]
    try:
        sharding = Sharding(tuple(dims))
    except ShardplanError as exc:
        raise argparse.ArgumentTypeError(f"bad pin {text!r}: {exc}") from None
    return key, Pin(sharding, int(level[1:]) if colon else None, f"--pin {text}")


def parse_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"bad time limit {text!r}: give seconds > 0, like 30")
    return value
