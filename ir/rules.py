"""Factor-based sharding rules (Shardy's OpShardingRule) and their compact string form.

A rule names each tensor dimension by one factor, or by a compound of factors (major first),
e.g. matmul ``ik,kj->ij`` and reshape ``(ij)k->i(jk)``. Sharding a factor on mesh axes splits
every tensor dimension that carries it; a *reduction* factor (absent from the results) makes
the results partial over those axes; a *need-replication* factor may not be split at all.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .errors import IRVerifyError

TensorFactors = tuple[tuple[str, ...], ...]
"""Per dimension, the factors (major to minor) it is made of; ``()`` is an unmapped size-1 dim."""
Summed = tuple[tuple[str, tuple[int, ...]], ...]
"""Factor -> indices of the results it is summed into (``ShardingRule.summed``)."""


@dataclass(frozen=True, slots=True)
class ShardingRule:
    """Einsum-like factor mapping of an op's operands and results.

    Invariants:
      - every factor has a size, and each dimension's size is the product of its factors;
      - reduction factors appear in operands only; need-replication wins over reduction;
      - a *summed* factor passes through some results and is absent from the results it is
        summed into; it is never need-replication.

    Text form: ``ik,kj->ij {i=16, j=256, k=64} reduction={k}``.
    """

    operands: tuple[TensorFactors, ...]
    results: tuple[TensorFactors, ...]
    sizes: tuple[tuple[str, int], ...]
    """Factor sizes, in order of first appearance (the canonical factor order)."""
    need_replication: frozenset[str] = frozenset()
    summed: Summed = ()
    """Factors that pass through some results and are summed into others, with the indices of
    those others: splitting one leaves just those results partial over its axes. Attention's
    backward over a query-sequence split (context parallelism) is the case: dQ stays split
    along the queries, dK and dV are sums over every query and come out partial (the
    reduce-scatter that mirrors the forward's K/V all-gather). Shardy's factor kinds are per
    op (pass-through or reduction for every result); this one is per result."""
    _hash: int = field(default=0, init=False, repr=False, compare=False)
    """Cached: rules key the planner's strategy and cost caches (once per op)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "need_replication", frozenset(self.need_replication))
        unknown = self.need_replication - set(self.factor_names)
        if unknown:
            raise IRVerifyError(
                f"rule {self.spec}: need_replication names unknown factors {unknown}"
            )
        object.__setattr__(
            self, "summed", tuple(sorted((f, tuple(sorted(i))) for f, i in self.summed))
        )
        self._check_summed()
        key = (self.operands, self.results, self.sizes, self.need_replication, self.summed)
        object.__setattr__(self, "_hash", hash(key))

    def _check_summed(self) -> None:
        for factor, indices in self.summed:
            if factor not in self.size_of or factor in self.need_replication:
                raise IRVerifyError(
                    f"rule {self.spec}: summed factor {factor!r} is unknown or need-replication "
                    "(a summed factor must be a factor of the rule that may be split)"
                )
            for k in indices:
                if not 0 <= k < len(self.results) or any(factor in d for d in self.results[k]):
                    raise IRVerifyError(
                        f"rule {self.spec}: factor {factor!r} cannot be summed into result {k} "
                        "(no such result, or the result carries the factor: list only results "
                        "that sum over it)"
                    )

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple:
        """Rebuilt through ``__init__``: string hashes differ between processes."""
        fields = (self.operands, self.results, self.sizes, self.need_replication, self.summed)
        return (ShardingRule, fields)

    # -- derived views --------------------------------------------------------------------
    @property
    def factor_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.sizes)

    @property
    def size_of(self) -> dict[str, int]:
        return dict(self.sizes)

    @property
    def result_factors(self) -> frozenset[str]:
        return frozenset(f for t in self.results for dim in t for f in dim)

    @property
    def reduction(self) -> frozenset[str]:
        """Factors that appear in operands but in no result: sharding them leaves partial sums."""
        return frozenset(self.factor_names) - self.result_factors - self.need_replication

    def partial_factors(self, result: int) -> frozenset[str]:
        """Factors whose split leaves result ``result`` partial: the reduction factors and the
        factors summed into it."""
        return self.reduction | {f for f, indices in self.summed if result in indices}

    @property
    def spec(self) -> str:
        return _tensors_text(self.operands) + "->" + _tensors_text(self.results)

    def compound_only_sizes(self) -> dict[str, int]:
        """Sizes that cannot be read off the shapes (factors seen only inside compounds)."""
        alone = {dim[0] for t in self.operands + self.results for dim in t if len(dim) == 1}
        return {name: size for name, size in self.sizes if name not in alone}

    def __str__(self) -> str:
        text = self.spec + " {" + ", ".join(f"{n}={s}" for n, s in self.sizes) + "}"
        if self.reduction:
            text += " reduction={" + ", ".join(sorted(self.reduction)) + "}"
        if self.need_replication:
            text += " need_replication={" + ", ".join(sorted(self.need_replication)) + "}"
        if self.summed:
            text += " summed={" + summed_text(self.summed) + "}"
        return text

    # -- construction ---------------------------------------------------------------------
    @staticmethod
    def from_spec(
        spec: str,
        operand_shapes: Sequence[Sequence[int]],
        result_shapes: Sequence[Sequence[int]],
        need_replication: Iterable[str] = (),
        sizes: Mapping[str, int] | None = None,
        summed: Summed = (),
    ) -> ShardingRule:
        """Build a rule from ``"ik,kj->ij"`` and the shapes, inferring factor sizes.

        Factors that only appear inside compounds need their size in ``sizes``.
        """
        operands, results = parse_spec(spec)
        # An empty side is ambiguous: no tensors, or one scalar ("ij->" sums to a scalar).
        if not operands and len(operand_shapes) == 1 and len(operand_shapes[0]) == 0:
            operands = [()]
        if not results and len(result_shapes) == 1 and len(result_shapes[0]) == 0:
            results = [()]
        if len(operands) != len(operand_shapes) or len(results) != len(result_shapes):
            raise IRVerifyError(
                f"rule {spec!r} has {len(operands)} operands and {len(results)} results, but the "
                f"op has {len(operand_shapes)} operands and {len(result_shapes)} results"
            )
        known = dict(sizes or {})
        order: list[str] = []
        pairs = list(zip(operands, operand_shapes, strict=True))
        pairs += list(zip(results, result_shapes, strict=True))
        for factors, shape in pairs:
            _bind_sizes(spec, factors, tuple(shape), known, order)
        for factors, shape in pairs:  # second sweep: compounds whose members are now known
            _bind_sizes(spec, factors, tuple(shape), known, order, final=True)
        return ShardingRule(
            tuple(operands), tuple(results), tuple((f, known[f]) for f in order),
            frozenset(need_replication), summed,
        )  # fmt: skip


def summed_text(summed: Summed) -> str:
    """``s=[1, 2]``: each summed factor with the results it is summed into."""
    return ", ".join(f"{f}=[{', '.join(map(str, idx))}]" for f, idx in summed)


def parse_spec(spec: str) -> tuple[list[TensorFactors], list[TensorFactors]]:
    """Parse ``"(ij)k,1k->i(jk)"`` into per-tensor, per-dim factor tuples."""
    if spec.count("->") != 1:
        raise IRVerifyError(f"rule spec {spec!r} must contain exactly one '->'")
    lhs, rhs = spec.replace(" ", "").split("->")
    return _parse_side(lhs, spec), _parse_side(rhs, spec)


def _parse_side(text: str, spec: str) -> list[TensorFactors]:
    if text == "":
        return []
    tensors: list[TensorFactors] = []
    for part in text.split(","):
        dims: list[tuple[str, ...]] = []
        i = 0
        while i < len(part):
            ch = part[i]
            if ch == "(":
                end = part.find(")", i)
                if end < 0:
                    raise IRVerifyError(f"rule spec {spec!r}: unclosed '('")
                dims.append(tuple(part[i + 1 : end]))
                i = end + 1
            elif ch == "1":
                dims.append(())
                i += 1
            elif ch.isalpha():
                dims.append((ch,))
                i += 1
            else:
                raise IRVerifyError(f"rule spec {spec!r}: unexpected character {ch!r}")
        tensors.append(tuple(dims))
    return tensors


def _bind_sizes(
    spec: str,
    factors: TensorFactors,
    shape: tuple[int, ...],
    known: dict[str, int],
    order: list[str],
    final: bool = False,
) -> None:
    if len(factors) != len(shape):
        raise IRVerifyError(
            f"rule {spec!r}: a tensor of rank {len(shape)} is given {len(factors)} dims"
        )
    for dim, size in zip(factors, shape, strict=True):
        for f in dim:
            if f not in order:
                order.append(f)
        if not dim:
            if size != 1:
                raise IRVerifyError(f"rule {spec!r}: unmapped dim '1' has size {size}, expected 1")
            continue
        missing = [f for f in dim if f not in known]
        if len(missing) == 1:
            rest = math.prod(known[f] for f in dim if f in known)
            if rest == 0 or size % rest:
                raise IRVerifyError(f"rule {spec!r}: dim of size {size} cannot hold factors {dim}")
            known[missing[0]] = size // rest
        elif missing and final:
            raise IRVerifyError(f"rule {spec!r}: give sizes for compound factors {missing}")
        elif not missing and math.prod(known[f] for f in dim) != size:
            sizes = {f: known[f] for f in dim}
            raise IRVerifyError(f"rule {spec!r}: dim of size {size} does not match factors {sizes}")


def _tensors_text(tensors: Sequence[TensorFactors]) -> str:
    parts = []
    for t in tensors:
        parts.append(
            "".join(dim[0] if len(dim) == 1 else f"({''.join(dim)})" if dim else "1" for dim in t)
        )
    return ",".join(parts)


FACTOR_LETTERS = (
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    "αβγδεζηθικλμνξοπρστυφχψωΓΔΘΛΞΠΣΦΨΩ"
    "абвгдежзийклмнопрстуфхцчшщэюяБГДЖЗИЛПФЦЧШЩЭЮЯ"
)
"""Factor names handed out by rule builders, in order (single letters, so specs stay
one character per factor; Greek and Cyrillic letters extend the Latin ones for ops with many
operands, e.g. a concat of dozens of tensors)."""
