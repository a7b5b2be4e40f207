"""The search and count helpers of the Top-K selector (:mod:`sp_kpool.kernels.triton_topk`):
Triton ``@triton.jit`` functions, inlined into its kernel.

- keys: :func:`row_keys` (FP32 bits to a monotone int32, invisible cells ``INT32_MIN``),
  :func:`load_keys`, :func:`candidate_keys`; :func:`key_value` and :func:`value_key`
  between keys and FP32 values; :func:`to_offset` / :func:`from_offset` (offset binary);
- counts: :func:`count_ge2`, :func:`count_ge4` (two / four thresholds in one reduction),
  :func:`positions` (prefix counts);
- the search: :func:`kth_largest` (split searches in 2, 3 or 5), :func:`split5`,
  :func:`narrow`, :func:`narrow2`, :func:`narrow4`.

Imports Triton: import this module only where Triton is available.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["row_keys", "load_keys", "candidate_keys", "count_ge4", "count_ge2", "to_offset", "from_offset",
           "key_value", "value_key", "kth_largest", "split5", "narrow", "narrow2", "narrow4", "positions"]  # fmt: skip


@triton.jit
def row_keys(s, ok):
    i = s.to(tl.int32, bitcast=True)
    key = tl.where(i >= 0, i, i ^ 0x7FFFFFFF)  # monotone in the float value
    key = tl.where(i == -2147483648, 0, key)  # -0.0 ties +0.0
    ok = ok & (s > float("-inf"))
    return tl.where(ok, key, -2147483648)


@triton.jit
def load_keys(srow, g0, tg, gok, a, e):
    """Keys of the groups starting at columns ``g0`` (``[NB]``, multiples of ``G``) with
    ``gok``; whole groups are read (vector loads: the mask is constant along a group, so
    the caller must own the columns up to the end of the last group) and cells outside
    ``[a, e)`` are masked afterwards."""
    cols = g0[:, None] + tg[None, :]
    s = tl.load(srow + cols, mask=gok[:, None], other=float("-inf"))
    return row_keys(s, (cols >= a) & (cols < e)), cols


@triton.jit
def candidate_keys(cbase, c0, idx, nc, srow, a0, tg, a, e, G: tl.constexpr, MASKED: tl.constexpr):
    """Keys and columns of the candidate groups ``c0 + idx`` (their ids are at ``cbase``;
    ``nc`` of them exist), ``INT32_MIN`` past the last. ``MASKED=False``: the ids are read
    without a mask (vector loads; the caller owns ``cbase[c0 + idx]`` for every ``idx``)."""
    ok = c0 + idx < nc
    if MASKED:
        gid = tl.load(cbase + c0 + idx, mask=ok, other=0)
    else:
        gid = tl.where(ok, tl.load(cbase + c0 + idx), 0)
    key, cols = load_keys(srow, a0 + gid * G, tg, ok, a, e)
    return tl.where(ok[:, None], key, -2147483648), cols


@triton.jit
def count_ge4(vals, m1, m2, m3, m4):
    """``count(vals >= m_j)`` for four thresholds in one reduction (16-bit fields of an
    int64 sum; the caller's blocks hold at most 32768 values)."""
    c = ((vals >= m1.to(tl.int32)).to(tl.int64) | ((vals >= m2.to(tl.int32)).to(tl.int64) << 16)
         | ((vals >= m3.to(tl.int32)).to(tl.int64) << 32) | ((vals >= m4.to(tl.int32)).to(tl.int64) << 48))
    t = tl.sum(c)
    return ((t & 0xFFFF).to(tl.int32), ((t >> 16) & 0xFFFF).to(tl.int32), ((t >> 32) & 0xFFFF).to(tl.int32),
            ((t >> 48) & 0xFFFF).to(tl.int32))  # fmt: skip


@triton.jit
def count_ge2(vals, m1, m2):
    """``count(vals >= m_j)`` for two thresholds in one int32 reduction (16-bit fields)."""
    c = (vals >= m1.to(tl.int32)).to(tl.int32) | ((vals >= m2.to(tl.int32)).to(tl.int32) << 16)
    t = tl.sum(c)
    return t & 0xFFFF, (t >> 16) & 0xFFFF


@triton.jit
def to_offset(x):
    """int32 key -> uint32 of the same order (offset binary)."""
    return x.to(tl.uint32, bitcast=True) ^ 0x80000000


@triton.jit
def from_offset(u):
    return (u ^ 0x80000000).to(tl.int32, bitcast=True)


@triton.jit
def key_value(key):
    """The FP32 value whose :func:`row_keys` key is ``key`` (int32; its inverse, ``-0.0``
    for the key ``-1``, a NaN for keys outside the keys of finite and infinite values)."""
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def value_key(x):
    """The int32 key of the FP32 value ``x``: :func:`row_keys`' order without its ``-0.0``
    and visibility selects, which a split point needs neither of (``-0.0`` keys below
    ``+0.0`` here; in the search loop :func:`row_keys` costs 16 more instructions on sm_90)."""
    i = x.to(tl.int32, bitcast=True)
    return tl.where(i >= 0, i, i ^ 0x7FFFFFFF)


@triton.jit
def kth_largest(vals, k, lo, stop, WAYS: tl.constexpr = 2, VSTEPS: tl.constexpr = 0, top=None,
                FA: tl.constexpr = 0.0, FB: tl.constexpr = 0.0, START_MIN: tl.constexpr = True):
    """Search for ``x >= lo`` with ``count(vals >= x) >= k``, stopping as soon as that
    count is ``<= stop`` (``stop = k``: the exact ``k``-th largest value, or a value with
    exactly ``k`` values at or above it). Returns ``(x, count(vals >= x), count(vals > x),
    max(vals))``; the third is exact only where the second is ``> stop`` (then ``x`` is the
    ``k``-th largest value). The caller guarantees ``count(vals >= lo) >= k`` or accepts
    ``lo``; ``vals`` (int32) are below ``INT32_MAX``, ``lo`` is an int32 scalar. ``top``:
    ``max(vals)`` if the caller knows it (one block reduction less; not used where the
    bracket starts at the smallest value, ``VSTEPS > 0`` with ``START_MIN``).

    ``WAYS = 2``: bisection. ``WAYS = 3`` / ``5``: each step splits ``[lo, hi)`` at two /
    four points counted in one reduction: fewer block reductions (barriers), more
    arithmetic.

    ``VSTEPS > 0`` (``WAYS`` 2 or 3): the first ``VSTEPS`` steps split ``[lo, hi)`` in
    FP32 value rather than in key (a key range spans many binades, values are spread more
    evenly over their range), evenly, or the first step at the fractions ``FA`` and ``FB``
    of the value range where ``FB > 0`` (``WAYS = 2``: ``FA``): about 8 instead of 12
    steps to the 512th of 4096 group maxima of random and ReLU-sum scores (a simulation).
    With ``START_MIN`` the bracket also starts at the smallest value ``>= lo`` instead of
    ``lo`` (the same count; one reduction gives it with the largest value and the count).
    Any split point keeps the search correct (a point outside the bracket narrows
    nothing); they are clamped into ``(lo, hi)`` so that every step narrows it, whatever
    the values (infinities, denormals). The result meets the same conditions (any ``x``
    with ``count >= k`` and ``count <= stop`` where the values allow) but, with ``stop >
    k``, may be another such ``x``."""
    cnt_hi = tl.full((), 0, tl.int32)
    if (VSTEPS > 0) & START_MIN:
        v = tl.reshape(vals, (vals.numel,), can_reorder=True)  # one reduction over all values
        ok = v >= lo
        top, low, cnt_lo = tl.reduce((v, tl.where(ok, v, 2147483647), ok.to(tl.int32)), 0, _max_min_sum)
        lo = tl.where(cnt_lo >= k, low, lo)  # count(vals >= low) = count(vals >= lo)
    else:
        cnt_lo = tl.sum((vals >= lo).to(tl.int32))
        if top is None:
            top = tl.max(vals)
    if WAYS == 5:
        lo = lo.to(tl.int64)
        hi = top.to(tl.int64) + 1
        while (hi - lo > 1) & (cnt_lo > stop):
            m1, m2, m3, m4 = split5(lo, hi)
            c1, c2, c3, c4 = count_ge4(vals, m1, m2, m3, m4)
            lo, cnt_lo, hi, cnt_hi = narrow4(k, lo, cnt_lo, hi, cnt_hi, m1, c1, m2, c2, m3, c3, m4, c4)
        lo = lo.to(tl.int32)
    else:
        # 32-bit arithmetic in offset binary (``key ^ INT32_MIN`` as uint32: the same order,
        # no overflow while lo < hi <= max + 1): half the instructions of 64-bit steps.
        # lo <= hi on entry (the callers' lo is at most the largest value + 1: the kernel's
        # phase-4 floor is a candidate group's maximum, or INT32_MIN + 1 with no visible
        # value), so hi - lo never wraps
        lo = to_offset(lo)
        hi = to_offset(top) + 1  # keys are < INT32_MAX (NaN is invisible)
        step = 0
        while (hi - lo > 1) & (cnt_lo > stop):
            d = (hi - lo) // WAYS
            m1 = lo + tl.maximum(d, 1)  # lo < m1 <= m2 < hi
            m2 = lo + tl.maximum(d * (WAYS - 1), 1)
            if VSTEPS > 0:
                if step < VSTEPS:  # split the values' range instead of the keys'
                    f_lo = key_value(from_offset(lo))
                    span = key_value(from_offset(hi - 1)) - f_lo
                    fa = 1.0 / WAYS
                    fb = (WAYS - 1.0) / WAYS
                    if FB > 0:  # the first step at FA and FB
                        fa = tl.where(step == 0, FA, fa)
                        fb = tl.where(step == 0, FB, fb)
                    u1 = to_offset(value_key(f_lo + span * fa))
                    u2 = to_offset(value_key(f_lo + span * fb))
                    m1 = tl.minimum(tl.maximum(u1, lo + 1), hi - 1)
                    m2 = tl.minimum(tl.maximum(u2, m1), hi - 1)
                step += 1
            if WAYS == 2:
                c1 = tl.sum((vals >= from_offset(m1)).to(tl.int32))
                lo, cnt_lo, hi, cnt_hi = narrow(k, lo, cnt_lo, hi, cnt_hi, m1, c1)
            else:
                c1, c2 = count_ge2(vals, from_offset(m1), from_offset(m2))
                lo, cnt_lo, hi, cnt_hi = narrow2(k, lo, cnt_lo, hi, cnt_hi, m1, c1, m2, c2)
        lo = from_offset(lo)
    return lo, cnt_lo, cnt_hi, top


@triton.jit
def _max_min_sum(a_max, a_min, a_n, b_max, b_min, b_n):
    return tl.maximum(a_max, b_max), tl.minimum(a_min, b_min), a_n + b_n


@triton.jit
def split5(lo, hi):
    """Four points ``lo < m1 <= m2 <= m3 <= m4 < hi`` (``hi - lo >= 2``) splitting ``[lo, hi)`` in five."""
    w = hi - lo
    return (lo + tl.maximum(w // 5, 1), lo + tl.maximum((w * 2) // 5, 1), lo + tl.maximum((w * 3) // 5, 1),
            lo + tl.maximum((w * 4) // 5, 1))  # fmt: skip


@triton.jit
def narrow(k, lo, cnt_lo, hi, cnt_hi, m, c):
    """``[lo, hi)`` (with ``count(vals >= lo) >= k > count(vals >= hi)``) narrowed by the
    count ``c`` at a point ``m``; applied for several points in any order, ``lo`` ends at
    the highest point with count ``>= k`` and ``hi`` at the lowest with count ``< k``."""
    up = (c >= k) & (m > lo)
    dn = (c < k) & (m < hi)
    return tl.where(up, m, lo), tl.where(up, c, cnt_lo), tl.where(dn, m, hi), tl.where(dn, c, cnt_hi)


@triton.jit
def narrow2(k, lo, cnt_lo, hi, cnt_hi, m1, c1, m2, c2):
    lo, cnt_lo, hi, cnt_hi = narrow(k, lo, cnt_lo, hi, cnt_hi, m1, c1)
    return narrow(k, lo, cnt_lo, hi, cnt_hi, m2, c2)


@triton.jit
def narrow4(k, lo, cnt_lo, hi, cnt_hi, m1, c1, m2, c2, m3, c3, m4, c4):
    lo, cnt_lo, hi, cnt_hi = narrow2(k, lo, cnt_lo, hi, cnt_hi, m1, c1, m2, c2)
    return narrow2(k, lo, cnt_lo, hi, cnt_hi, m3, c3, m4, c4)


@triton.jit
def positions(f):
    """Inclusive prefix counts of ``f`` (``[NB, G]`` int32 0/1) in row-major order, as a
    scan over the ``NB`` group sums plus a scan inside each group (cheap in Triton, unlike
    one long scan)."""
    gs = tl.sum(f, axis=1)
    return (tl.cumsum(gs, axis=0) - gs)[:, None] + tl.cumsum(f, axis=1)
