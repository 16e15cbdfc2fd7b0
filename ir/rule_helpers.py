"""The vocabulary of rule builders: the ``Types``/``Attrs`` they take, factor letters, a
``ShardingRule`` assembled from per-dim factors, numpy broadcasting and the safe replicated rule."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from .errors import IRVerifyError
from .rules import FACTOR_LETTERS, ShardingRule
from .types import TensorType

Types = Sequence[TensorType]
Attrs = Mapping[str, object]
RuleBuilder = Callable[[Types, Types, Attrs], ShardingRule]


def _letters(n: int) -> list[str]:
    if n > len(FACTOR_LETTERS):
        raise IRVerifyError(
            f"an op with {n} factors exceeds the {len(FACTOR_LETTERS)} rule letters"
        )
    return list(FACTOR_LETTERS[:n])


def _letter_stream():
    """Factor letters in order; a clear error (not StopIteration) if an op needs more."""
    yield from FACTOR_LETTERS
    raise IRVerifyError(
        f"an op needs more than {len(FACTOR_LETTERS)} factors; split it (e.g. concat in groups)"
    )


def _make(
    operands: list[list[tuple[str, ...]]],
    results: list[list[tuple[str, ...]]],
    sizes: dict[str, int],
    need_replication: set[str] | frozenset[str] = frozenset(),
    summed: tuple[tuple[str, tuple[int, ...]], ...] = (),
) -> ShardingRule:
    order: list[str] = []
    for t in operands + results:
        for dim in t:
            order.extend(f for f in dim if f not in order)
    return ShardingRule(
        tuple(tuple(t) for t in operands),
        tuple(tuple(t) for t in results),
        tuple((f, sizes[f]) for f in order),
        frozenset(need_replication) & frozenset(order),
        summed,
    )


def replicated_rule(ins: Types, outs: Types) -> ShardingRule:
    """Safe rule: every dimension its own need-replication factor."""
    letters = iter(_letters(sum(t.rank for t in list(ins) + list(outs))))
    sizes: dict[str, int] = {}
    tensors = []
    for t in list(ins) + list(outs):
        dims = []
        for size in t.shape:
            f = next(letters)
            sizes[f] = size
            dims.append((f,))
        tensors.append(dims)
    return _make(tensors[: len(ins)], tensors[len(ins) :], sizes, set(sizes))


def _broadcast_map(t: TensorType, result: TensorType, letters: list[str]) -> list[tuple[str, ...]]:
    """Right-aligned (numpy) broadcasting of ``t`` against the result's factor letters."""
    offset = result.rank - t.rank
    if offset < 0:
        raise IRVerifyError(f"operand {t} has higher rank than the elementwise result {result}")
    dims: list[tuple[str, ...]] = []
    for i, size in enumerate(t.shape):
        full = result.shape[offset + i]
        if size == full:
            dims.append((letters[offset + i],))
        elif size == 1:
            dims.append(())
        else:
            raise IRVerifyError(f"operand {t} does not broadcast to {result}")
    return dims
