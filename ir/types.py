"""Tensor types: static shape and dtype."""

from __future__ import annotations

import math
from dataclasses import dataclass

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

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.dtype not in DTYPE_BYTES:
            raise ShardingError(
                f"unknown dtype {self.dtype!r}; known dtypes: {', '.join(sorted(DTYPE_BYTES))}"
            )
        if any(d < 0 for d in self.shape):
            raise ShardingError(f"negative dimension in shape {self.shape}")

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
