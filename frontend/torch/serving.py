"""Trace one serving step of a HF decoder: a prefill of the prompt or one decode step.

The key/value cache is a static cache of ``context_len`` slots per layer (HF's ``StaticLayer``
layout ``[batch, kv_heads, context_len, head_dim]``), passed in as graph inputs
(``Role.KV_CACHE``) and written in place with ``index_copy_`` at the step's positions; the
written buffers are outputs aliased to those inputs, so the plan keeps the cache where it is
and memory counts it once. A decode step writes slot ``context_len - 1`` (the cache then holds
``context_len`` tokens) and attends over all of them; a prefill of ``seq`` tokens writes slots
``0..seq-1``. Nothing is allocated: parameters and caches are fake tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode  # public home of FakeTensorMode
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx

from ...ir import FrontendError
from .trace import (
    Placeholder,
    Traced,
    _tied_aliases,
    fake_like,
    first_tensor,
    module_annotations,
    split_inputs,
)

SERVING_MODES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class CacheShape:
    """The static KV cache of one serving step: one key and one value buffer per layer."""

    layers: tuple[str, ...]
    """Module path of each attention module, in ``layer_idx`` order (the cache's owners)."""
    batch: int
    kv_heads: int
    context_len: int
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.kv_heads, self.context_len, self.head_dim)

    def paths(self) -> list[str]:
        """Origin path of every buffer: ``<attention module>.key_cache`` / ``.value_cache``."""
        return [f"{layer}.{kind}_cache" for layer in self.layers for kind in ("key", "value")]


def attention_modules(model: nn.Module) -> list[tuple[str, int]]:
    """(path, layer_idx) of every module that owns a cache layer (HF attention modules carry
    ``layer_idx``), sorted by index."""
    found = [
        (path, m.layer_idx)
        for path, m in model.named_modules()
        if isinstance(getattr(m, "layer_idx", None), int) and "att" in type(m).__name__.lower()
    ]
    return sorted(found, key=lambda item: item[1])


def cache_shape(model: nn.Module, batch: int, context_len: int) -> CacheShape:
    """The cache ``model`` (a HF decoder) needs for ``batch`` sequences of ``context_len``."""
    config = getattr(model, "config", None)
    layers = attention_modules(model)
    if config is None or not layers:
        raise FrontendError(
            f"mode='decode'/'prefill' needs a HF decoder with a config and attention modules "
            f"that carry layer_idx; {type(model).__name__} has "
            f"{'no config' if config is None else 'no such attention module'}"
        )
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    dtype = next((p.dtype for p in model.parameters() if p.dtype.is_floating_point), torch.float32)
    return CacheShape(tuple(p for p, _ in layers), batch, kv_heads, context_len, head_dim, dtype)


def _cache_class() -> tuple[type, type]:
    from transformers.cache_utils import Cache, StaticLayer

    class SlotLayer(StaticLayer):  # type: ignore[misc, valid-type]
        """A ``StaticLayer`` over given buffers, written at given slots (``index_copy_``)."""

        def __init__(
            self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, seen: int
        ):
            super().__init__(max_cache_len=keys.shape[2])
            self.keys, self.values, self.slots, self.seen = keys, values, slots, seen
            self.dtype, self.device = keys.dtype, keys.device
            self.batch_size, self.num_heads = keys.shape[:2]
            self.k_head_dim, self.v_head_dim = keys.shape[-1], values.shape[-1]
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.keys.index_copy_(2, self.slots, key_states)
            self.values.index_copy_(2, self.slots, value_states)
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.seen

    return Cache, SlotLayer


def slot_cache(buffers: list[torch.Tensor], slots: torch.Tensor, seen: int) -> Any:
    """A HF ``Cache`` over ``buffers`` (key, value per layer) that writes at ``slots`` and
    holds ``seen`` tokens after the write."""
    cache_cls, layer_cls = _cache_class()
    layers = [layer_cls(buffers[i], buffers[i + 1], slots, seen) for i in range(0, len(buffers), 2)]
    return cache_cls(layers=layers)


def step_positions(mode: str, seq: int, context_len: int) -> range:
    """Cache slots (= token positions) a step writes: the prompt's, or the last slot."""
    if mode == "decode":
        if seq != 1:
            raise FrontendError(
                f"mode='decode' generates one token per sequence: pass input_ids of shape "
                f"[batch, 1], got {seq} tokens (use mode='prefill' for a prompt)"
            )
        return range(context_len - 1, context_len)
    if seq > context_len:
        raise FrontendError(
            f"the prompt has {seq} tokens but context_len={context_len}: the cache must hold "
            "the prompt (pass context_len >= the prompt length)"
        )
    return range(seq)


def trace_serving(
    model: nn.Module, example_inputs: tuple, mode: str, context_len: int | None
) -> tuple[Traced, CacheShape]:
    """Trace one prefill/decode step of ``model``; see the module docstring."""
    args, kwargs = split_inputs(example_inputs)
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise FrontendError(
            f"mode={mode!r} takes the token ids as one [batch, tokens] tensor "
            "(sp.plan(model, input_ids, mode=..., context_len=...))"
        )
    batch, seq = ids.shape
    if context_len is None:
        if mode == "decode":
            raise FrontendError("mode='decode' needs context_len= (tokens held in the cache)")
        context_len = seq
    positions = step_positions(mode, seq, int(context_len))
    shape = cache_shape(model, batch, int(context_len))
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    fake = FakeTensorMode(allow_non_fake_inputs=False)
    fake_params = [fake_like(fake, p) for p in params.values()]
    fake_buffers = [fake_like(fake, b) for b in buffers.values()]
    fake_ids = fake_like(fake, ids)
    with fake:
        caches = [torch.empty(shape.shape, dtype=shape.dtype, device="cpu") for _ in shape.paths()]
    boundaries = {n for n, m in model.named_modules() if any(True for _ in m.parameters(False))}
    names = list(params)

    def step(p, b, x, kv):  # type: ignore[no-untyped-def]
        tensors = {**dict(zip(names, p, strict=True)), **dict(zip(buffers, b, strict=True))}
        pos = torch.arange(positions.start, positions.stop, device=x.device)
        cache = slot_cache(list(kv), pos, positions.stop)
        with torch.no_grad(), module_annotations(model, boundaries):
            out = functional_call(
                model, tensors, (), {"input_ids": x, "past_key_values": cache,
                "position_ids": pos.unsqueeze(0), "use_cache": True}, strict=False,
            )  # fmt: skip
        logits = getattr(out, "logits", None)
        logits = logits if isinstance(logits, torch.Tensor) else first_tensor(out)
        return (logits, *kv)

    try:
        with fx_traceback.preserve_node_meta():
            gm = make_fx(step, tracing_mode="fake", record_stack_traces=True)(
                fake_params, fake_buffers, fake_ids, caches
            )
    except FrontendError:
        raise
    except Exception as exc:
        raise FrontendError(
            f"could not trace a {mode} step of {type(model).__name__} with a static KV cache "
            f"({type(exc).__name__}: {exc}); mode='decode'/'prefill' supports HF decoder LMs"
        ) from exc
    placeholders = [Placeholder("param", n) for n in names]
    placeholders += [Placeholder("buffer", n) for n in buffers]
    placeholders += [Placeholder("input", "input_ids")]
    placeholders += [Placeholder("kv_cache", path) for path in shape.paths()]
    outputs = [("output", "logits")] + [("kv_cache", path) for path in shape.paths()]
    traced = Traced(gm, placeholders, outputs, names, _tied_aliases(model), sorted(boundaries))
    return traced, shape


def resized_inputs(example_inputs: tuple, batch: int | None) -> tuple[tuple, tuple[int, int]]:
    """The example inputs with the token ids resized to ``batch`` sequences (a ``meta``
    tensor: nothing is allocated), and the example's (batch, tokens)."""
    args, kwargs = split_inputs(example_inputs)
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise FrontendError(
            "a prefill/decode plan takes the token ids as one [batch, tokens] tensor "
            "(sp.plan(model, input_ids, mode=..., context_len=...))"
        )
    shape = (int(ids.shape[0]), int(ids.shape[1]))
    if batch is None or batch == shape[0]:
        return tuple(example_inputs), shape
    new = torch.empty((batch, shape[1]), dtype=ids.dtype, device="meta")
    if "input_ids" in kwargs:
        return ({**kwargs, "input_ids": new},), shape
    return (new, *args[1:]), shape


def distribute_cache(plan: Any, device_mesh: Any, buffers: list[torch.Tensor]) -> list[Any]:
    """The KV cache buffers (key, value per layer, ``CacheShape.paths()`` order) as DTensors
    in the plan's layouts, for a plan applied with ``plan.apply``; pass them to
    ``slot_cache`` for the step. Each rank writes its own slots: the plan never splits the
    slot dimension (``index_copy``'s rule), so the write is local."""
    from torch.distributed.tensor import distribute_tensor

    from .emit import context_of, placements_of

    context = context_of(plan)
    shape = context.serving
    if shape is None:
        raise FrontendError("distribute_cache takes a plan of mode='decode' or 'prefill'")
    paths = shape.paths()
    if len(buffers) != len(paths):
        raise FrontendError(
            f"the plan's cache has {len(paths)} buffers (key and value per layer), got "
            f"{len(buffers)}"
        )
    out = []
    for path, buffer in zip(paths, buffers, strict=True):
        layout = placements_of(plan.shardings[context.cache_values[path]], plan.mesh)
        out.append(distribute_tensor(buffer, device_mesh, list(layout), src_data_rank=None))
    return out
