"""Tensor types: static shape and dtype."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import ShardingError

# Bytes per element of every dtype the IR knows. Names follow the HLO short forms.
DTYPE_BYTES: dict[str, int] = {
    "f64": 8, "f32": 4, "tf32": 4, "bf16": 2, "f16": 2, "f8e4m3": 1, "f8e5m2": 1,
    "i64": 8, "i32": 4, "i16": 2, "i8": 1, "u64": 8, "u32": 4, "u16": 2, "u8": 1,
    "bool": 1, "c64": 8, "c128": 16,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class TensorType:
    """Static shape and dtype of a value, e.g. ``bf16[64,4096]``; ``f32[]`` is a scalar.

    Invariants: every dimension is >= 0; the dtype is a key of ``DTYPE_BYTES``.
    """

    shape: tuple[int, ...]
    dtype: str = "f32"
    _hash: int = field(default=0, init=False, repr=False, compare=False)
    """Cached: types key the planner's price and cost caches."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.dtype not in DTYPE_BYTES:
            raise ShardingError(
                f"unknown dtype {self.dtype!r}; known dtypes: {', '.join(sorted(DTYPE_BYTES))}"
            )
        if any(d < 0 for d in self.shape):
            raise ShardingError(f"negative dimension in shape {self.shape}")
        object.__setattr__(self, "_hash", hash((self.shape, self.dtype)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple:
        """Rebuilt through ``__init__``: string hashes differ between processes."""
        return (TensorType, (self.shape, self.dtype))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(str(d) for d in self.shape)}]"
