"""Trace three layers of a deep stack and stamp out the rest (``passes/stamp_layers.py``).

``make_fx`` costs about 0.35 s per Llama-3-8B layer, so tracing a 32-layer model takes longer
than planning it. A ``ModuleList`` of layers that are alike in every respect the trace can see
(class, parameter and buffer names, shapes and dtypes, and plain attributes, all recursively,
``layer_idx`` aside) lowers to the same ops per layer; tracing layers 0..2 and stamping gives
the graph a full trace gives (tests compare the two). Where stamping cannot prove the stack
plain (``stamp_layers`` returns None), the whole model is traced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from ...passes.repeated_layers import layer_key
from ...passes.stamp_layers import StampedGraph, layer_path

T = TypeVar("T")

MIN_LAYERS = 6
"""Stacks shorter than this are traced whole (stamping saves little)."""

TRACED_LAYERS = 3
INDEX_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "idx"})
"""Plain attributes that number the layer and may differ between otherwise equal layers."""


@dataclass(frozen=True, slots=True)
class LayerStack:
    path: str
    """FQN of the ``ModuleList`` (``model.layers``)."""
    parent: nn.Module
    attribute: str
    size: int


def find_stack(model: nn.Module) -> LayerStack | None:
    """The longest ``ModuleList`` of alike layers whose path the layer detector recognises."""
    best: LayerStack | None = None
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < MIN_LAYERS:
            continue
        key = layer_key(f"{path}.0")
        if key is None or key[0] != path:
            continue
        first = _structure(module[0])
        if any(_structure(layer) != first for layer in list(module)[1:]):
            continue
        parent_path, _, attribute = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        if best is None or len(module) > best.size:
            best = LayerStack(path, parent, attribute, len(module))
    return best


def _structure(module: nn.Module) -> tuple:
    """What a trace of the module can depend on, apart from its layer number."""
    parts = []
    for name, sub in module.named_modules():
        attrs = tuple(
            sorted(
                (k, v)
                for k, v in vars(sub).items()
                if not k.startswith("_") and k not in INDEX_ATTRIBUTES and _plain(v)
            )
        )
        params = tuple(
            (n, tuple(p.shape), p.dtype, p.requires_grad)
            for n, p in sub.named_parameters(recurse=False)
        )
        buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in sub.named_buffers(recurse=False))
        parts.append((name, type(sub).__qualname__, attrs, params, buffers))
    return tuple(parts)


def _plain(value: object) -> bool:
    if isinstance(value, (bool, int, float, str, type(None), torch.dtype)):
        return True
    return isinstance(value, tuple) and all(_plain(v) for v in value)


@contextlib.contextmanager
def truncated(stack: LayerStack) -> Iterator[None]:
    """The stack cut to its first ``TRACED_LAYERS`` layers while tracing."""
    full = getattr(stack.parent, stack.attribute)
    setattr(stack.parent, stack.attribute, nn.ModuleList(list(full)[:TRACED_LAYERS]))
    try:
        yield
    finally:
        setattr(stack.parent, stack.attribute, full)


def rename_keyed(table: dict[str, object], stamped: StampedGraph, translate) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """Copy entries keyed by a template-layer FQN/module path to every copy and move the
    traced last layer's to its new index; ``translate(entry, names)`` maps value names."""
    out: dict[str, object] = {}
    stack, last = stamped.stack, stamped.count - 1
    for key, entry in table.items():
        layer = layer_key(key)
        if layer is None or layer[0] != stack or layer[1] not in (1, 2):
            out[key] = entry
        elif layer[1] == 2:
            out[layer_path(key, stack, 2, last)] = translate(entry, stamped.names[last])
        else:
            out[key] = entry
            for j in range(2, last):
                out[layer_path(key, stack, 1, j)] = translate(entry, stamped.names[j])
    return out


def rename_pins(pins: dict[str, T], stamped: StampedGraph) -> dict[str, T]:
    """Pins keyed by value name (or FQN) in a stamped graph: a template-layer value's pin is
    copied to each copy of it, a traced last layer's moves with it; FQN keys are grown like
    the other FQN-keyed tables (``rename_keyed``)."""
    last = stamped.count - 1
    out: dict[str, T] = {}
    for key, pin in rename_keyed(pins, stamped, lambda entry, names: entry).items():
        if key in stamped.names.get(last, {}):
            out[stamped.names[last][key]] = pin
            continue
        out[key] = pin
        for j in range(2, last):
            if key in stamped.names.get(j, {}):
                out[stamped.names[j][key]] = pin
    return out
