"""A JAX serving step: a prefill or decode function over an explicit KV-cache pytree.

``sp.plan(step, params, cache, tokens, mesh=..., mode="decode", context_len=16)`` plans a
function the user wrote: JAX has no model class to trace a cache into, so the step takes the
cache as an argument and returns it updated (``lax.dynamic_update_slice`` at the step's slots).
The argument named ``cache`` / ``kv_cache`` (or any path given ``Role.KV_CACHE`` in
``roles=``) is the cache; the returned element with its tree structure, shapes and dtypes is
the updated cache, aliased to it, so the plan keeps each buffer where it is, memory counts it
once (``solver/memory_terms.py``, ``cache_write``) and ``plan.jit`` donates it (XLA writes it in
place). The step's tokens are its rank-2 integer batch input ``[batch, tokens]``: one token
per sequence for a decode step, the prompt for a prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...ir import FrontendError, Graph, Role

SERVING_MODES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class ServingStep:
    """What a serving plan needs to know about a captured JAX step."""

    mode: str
    batch: int
    tokens: int
    """Tokens per sequence the step processes (1 for decode, the prompt for prefill)."""
    context_len: int
    cache_inputs: tuple[str, ...]
    """IR input names of the cache leaves, in argument order."""


def _token_input(graph: Graph) -> tuple[int, int]:
    for v in graph.inputs:
        if v.role is Role.INPUT and v.type.rank == 2 and v.type.dtype.startswith(("i", "u")):
            return v.type.shape[0], v.type.shape[1]
    raise FrontendError(
        "a JAX serving step takes its token ids as an integer [batch, tokens] argument; "
        f"{graph.name} has none (its inputs: "
        f"{', '.join(f'{v.origin.path} {v.type}' for v in graph.inputs[:6])}...)"
    )


def check_serving_step(graph: Graph, mode: str, context_len: int | None) -> ServingStep:
    """Check that ``graph`` is a serving step of ``mode`` with an in-place cache; raise a
    ``FrontendError`` saying what to change otherwise."""
    if mode not in SERVING_MODES:
        raise FrontendError(f"a JAX serving step is mode='decode' or 'prefill', not {mode!r}")
    caches = [i for i, v in enumerate(graph.inputs) if v.role is Role.KV_CACHE]
    if not caches:
        raise FrontendError(
            f"mode={mode!r} needs the KV cache as an argument: name it `cache` (or "
            "`kv_cache`), or pass roles={path: Role.KV_CACHE} for its leaves"
        )
    aliased = set(graph.output_aliases.values())
    missing = [graph.inputs[i].origin.path for i in caches if i not in aliased]
    if missing:
        raise FrontendError(
            f"the step does not return its updated KV cache ({', '.join(missing[:4])} have no "
            "output of the same structure, shapes and dtypes): return the cache pytree "
            "as a top-level output element so it is updated in place (donated)"
        )
    batch, tokens = _token_input(graph)
    if mode == "decode" and tokens != 1:
        raise FrontendError(
            f"mode='decode' generates one token per sequence: the tokens are [batch, 1], got "
            f"[{batch}, {tokens}] (use mode='prefill' for a prompt)"
        )
    if context_len is None:
        if mode == "decode":
            raise FrontendError("mode='decode' needs context_len= (tokens held in the cache)")
        context_len = tokens
    if tokens > context_len:
        raise FrontendError(
            f"the prompt has {tokens} tokens but context_len={context_len}: the cache must "
            "hold the prompt"
        )
    for i in caches:
        v = graph.inputs[i]
        if context_len not in v.type.shape:
            raise FrontendError(
                f"no dim of the cache leaf {v.origin.path} {v.type} holds "
                f"context_len={context_len} slots: pass the cache's length as context_len"
            )
    names = tuple(graph.inputs[i].name for i in caches)
    return ServingStep(mode, batch, tokens, int(context_len), names)


def donated_arguments(graph: Graph, arg_inputs: list[str], in_tree: object) -> tuple[int, ...]:
    """Positional arguments whose every leaf is a KV cache the step returns updated: ``jit``
    donates them, so XLA writes the cache in its own buffer (nothing else is donated: a
    training step's caller may still read its parameters)."""
    aliased = {graph.inputs[k].name for k in graph.output_aliases.values()}
    cache = {v.name for v in graph.inputs if v.role is Role.KV_CACHE} & aliased
    counts = [c.num_leaves for c in in_tree.children()]  # type: ignore[attr-defined]
    out, offset = [], 0
    for i, n in enumerate(counts):
        names = arg_inputs[offset : offset + n]
        if names and all(name in cache for name in names):
            out.append(i)
        offset += n
    return tuple(out)
