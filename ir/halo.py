"""Which spatial dims of a convolution may be split with a halo, and how many rows it needs.

GSPMD's windowed split: a device holds a slab of input rows and computes the output rows that
read them, fetching the few rows its window reaches past the slab from its neighbours. Two
forms of XLA's ``ConvGeneralDilated`` allow it, both with no lhs dilation (a transposed
convolution's inserted zeros would break the row alignment) and both aligned, so every slab
starts at a multiple of the row step:

* *forward*: output row ``o`` reads input rows ``o * stride - pad_lo + j * dilation``
  (``j`` < kernel) and the input is exactly ``stride`` times the output (same padding). The
  output rows split with the input rows. Torch's convolution and its fused backward, and
  XLA's forward and input-gradient convolutions (stride 1), have this form;
* *window*: the rhs is as long as the output of the forward pass (XLA's weight gradient:
  lhs = the input, rhs = the output gradient, result = the kernel): result row ``k`` sums
  ``lhs[j * rhs_dilation + k * stride - pad_lo] * rhs[j]`` over every rhs row ``j``, and the
  input is exactly ``rhs_dilation`` times the rhs. The rhs rows split with the input rows
  and are summed over (the result is a pending sum); the halo is the forward one with the
  roles of stride and dilation swapped.

A window that reaches further back than its kernel (``pad_lo`` past the window) is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from .rule_helpers import Attrs


def halo_rows(kernel: int, dilation: int, stride: int, pad_lo: int) -> tuple[int, int]:
    """Input rows a slab of output rows needs from the shard before and after its own: output
    row ``o`` reads input rows ``o * stride - pad_lo + j * dilation`` (``j < kernel``), so a
    slab whose input shard starts at ``o0 * stride`` reaches ``pad_lo`` rows back and
    ``(kernel - 1) * dilation - pad_lo - (stride - 1)`` rows past its end (``(k - 1) * d`` in
    all for stride 1: GSPMD's halo). A negative count is rows of the slab left unread."""
    return pad_lo, (kernel - 1) * dilation - pad_lo - (stride - 1)


@dataclass(frozen=True, slots=True)
class Halo:
    """One spatial dim of a convolution split with a halo.

    Invariants: ``0 <= lo``; ``hi >= -(step - 1)`` (at most the slab's last partial step
    unread); ``step >= 1``.
    """

    form: str
    """``"forward"`` (the output rows split with the input's) or ``"window"`` (the rhs rows
    split with the input's and summed over)."""
    step: int
    """Input rows per split row (the stride, or the rhs dilation of the window form)."""
    lo: int
    """Rows needed from the previous shard."""
    hi: int
    """Rows needed from the next shard (negative: rows of the slab nobody reads)."""


def nth(attrs: Attrs, key: str, i: int) -> int:
    """Spatial dim ``i``'s entry of a per-dim attribute (1 when absent)."""
    values = tuple(attrs.get(key, ()))  # type: ignore[call-overload]
    return int(values[i]) if i < len(values) else 1


def pad_lo(attrs: Attrs, i: int) -> int:
    pads = tuple(attrs.get("padding", ()))  # type: ignore[call-overload]
    if i >= len(pads):
        return 0
    pad = pads[i]
    return int(pad[0] if isinstance(pad, (tuple, list)) else pad)


def halo_split(sizes: tuple[int, int, int], attrs: Attrs, i: int, window: bool) -> Halo | None:
    """The halo split of spatial dim ``i`` of a convolution whose lhs, rhs and out are
    ``sizes`` rows long along it; None when the dim may not split with a halo. ``window``:
    the window form may be taken (XLA's convolution; torch's weight gradient is fused into
    its backward op, which has the forward's geometry)."""
    lhs, rhs, out = sizes
    if attrs.get("transposed") or nth(attrs, "lhs_dilation", i) != 1:
        return None
    stride, dilation, pad = (
        nth(attrs, "strides", i),
        nth(attrs, "rhs_dilation", i),
        pad_lo(attrs, i),
    )
    if lhs == out * stride and pad <= (rhs - 1) * dilation:
        lo, hi = halo_rows(rhs, dilation, stride, pad)
        return Halo("forward", stride, lo, hi)
    if window and lhs == rhs * dilation and rhs > 1 and pad <= (out - 1) * stride:
        lo, hi = halo_rows(out, stride, dilation, pad)
        return Halo("window", dilation, lo, hi)
    return None
