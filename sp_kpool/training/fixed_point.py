"""The exact mode's fixed point: int64 sums that no order or grouping can change.

A value ``x`` is held as ``round(x * 2^e)`` in int64 with one exponent ``e`` per quantity
and call, chosen from a **global** bound ``B`` of the quantity's total magnitude as
``e = 61 - ceil(log2 B)`` (:func:`exponent`), so every partial sum stays below ``2^61``.
Integer addition is associative: the sum is bitwise the same for every world size, layout
and order. The bound is built from maxima (exact, order-free) of global quantities, so
``e`` is the same for every world size too. Quantisation error: at most ``2^-(e+1)`` per
term, i.e. about ``B * 2^-62`` per term relative to the bound.
"""

from __future__ import annotations

import math

import torch

__all__ = ["exponent", "to_fixed", "from_fixed", "global_max", "global_sum"]

_HEADROOM = 61


def exponent(bound: float) -> int:
    """``e`` with ``bound * 2^e < 2^61`` (``0`` for a zero or non-finite bound)."""
    if not (bound > 0 and math.isfinite(bound)):
        return 0
    return _HEADROOM - math.frexp(bound)[1]


def _ldexp(x: torch.Tensor, e: int) -> torch.Tensor:
    """``x * 2^e`` in float64 by exact power-of-two steps (no overflow of ``2^e`` itself)."""
    x = x.to(torch.float64)
    while e:
        step = max(-512, min(512, e))
        x = x * (2.0**step)
        e -= step
    return x


def to_fixed(x: torch.Tensor, e: int) -> torch.Tensor:
    """``round(x * 2^e)`` as int64."""
    return torch.round(_ldexp(x, e)).to(torch.int64)


def from_fixed(i: torch.Tensor, e: int, dtype: torch.dtype) -> torch.Tensor:
    """``i * 2^-e`` in ``dtype`` (int64 -> float64 -> ``dtype``; deterministic)."""
    return _ldexp(i.to(torch.float64), -e).to(dtype)


def global_max(values: list[float], seq, timeout: float) -> list[float]:
    """Element-wise maximum of ``values`` over the ranks of ``seq`` (exact, order-free)."""
    if seq.world_size == 1:
        return list(values)
    from ..comm import all_gather_rows

    t = torch.tensor([values], dtype=torch.float64)
    return all_gather_rows(t, seq, tag="fixed_point_max", timeout=timeout).amax(dim=0).tolist()


def global_sum(x: torch.Tensor, seq, timeout: float) -> torch.Tensor:
    """The int64 sum of ``x`` over the ranks of ``seq`` (exact)."""
    if seq.world_size == 1:
        return x
    from ..comm import all_gather_rows

    flat = x.reshape(1, -1)
    return all_gather_rows(flat, seq, tag="fixed_point_sum", timeout=timeout).sum(dim=0).view(x.shape)
