"""Exact, deterministic Top-K selection and expansion on the GPU (Triton).

:func:`topk_ascending` selects, in every row of an FP32 score matrix, the ``k`` best
visible columns by the rule of :func:`sp_kpool.selection.topk_pools` (higher score first,
ties toward the lower column, ``-0.0`` equal to ``+0.0``) and writes them in **ascending
column order**, ``-1`` after. No host synchronisation, no per-row fix-up pass.

Per row (a persistent grid: program ``p`` takes rows ``p, p + P, ...`` and reuses a small
scratch area in global memory, which stays in L2):

1. Keys: the FP32 bits mapped to a monotone int32; cells outside ``[start, end)`` or at
   ``-inf`` or NaN get ``INT32_MIN`` (invisible). One pass over the row stores the maxima
   of groups of ``G`` aligned adjacent columns (``G`` = 8 up to 65536 columns, then 16, 32,
   ...; ``min_group=4``: 4 up to 32768). Whole groups are read with vector loads (the
   launcher runs rows whose last group would end past the tensor's storage from a padded
   copy); the tiles inside ``[start, end)`` run in a loop of their own without masks or
   branches that converts only the group maxima to keys (the first and the last tile,
   masked, after it). Nothing is counted here.
2. ``L``: a value with at least ``k`` and at most ``capg`` (default: the power of two
   ``>= k``) group maxima ``>= L``, by a search over the maxima in registers that stops
   early (its bracket starts at the smallest visible maximum, and its first steps split
   the bracket's FP32 value range rather than its keys: ``vsteps``, the first at the
   fractions ``split2``). At least ``k`` keys
   are ``>= L``, so the ``k``-th best key ``T`` is ``>= L``, and every cell of the answer
   lies in a group with maximum ``>= L``. With fewer than
   ``k`` visible groups, ``L`` admits every visible cell (there may be ``k`` or fewer:
   step 3 then selects them all). Those groups' ids are compacted in column order.
3. Their cells (read again) hold the answer: ``T`` by the same search (from ``L`` to the
   row maximum, known from step 2; its first step splits the values at the fractions
   ``split4``: on DeepGEMM logits ``T`` sits in the bottom 2% of that range), stopped as
   soon as exactly ``k`` keys are at or above it; then the keys above ``T`` and the first keys
   equal to ``T`` in column order, written in column order. Up to ``capg`` groups the
   cells sit in registers; more groups (long runs of exactly equal scores) are streamed
   in blocks of at least 256 groups for every step of the search and for the output.

The searches count two thresholds per block reduction by default (``ways=3``): on an H200
a row's time is bound by the number of dependent block reductions (barriers) as much as by
its arithmetic. Their bracket arithmetic is 32-bit (offset binary) and their loops end
with the search (``while``), and the scratch is read with unmasked vector loads: the
seventh session's Nsight Compute profile found 64-bit steps (about a fifth of all
instructions), fixed-length loops and scalar masked loads of the group maxima (4x their
L2 sectors). Launches of up to 8 warps cap registers at 80 per thread (3 programs per SM
instead of 1), and index tensors are rebuilt per row so that the compiler cannot keep them
live across the row loop. Prefix counts use a scan over group sums plus a scan inside each
group: one long scan over a tile is slow in Triton (a barrier per register chunk).

:func:`expand_pools` turns selected pools into token ids, adds the tail and writes either
column layout.

Imports Triton: import this module only where Triton is available.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["topk_ascending", "expand_pools", "chunk_row_ranges", "supports", "MAX_K"]

#: Register cap (``maxnreg``) of launches of up to 8 warps: 3 programs of 8 warps per SM
#: instead of 1 (the compiler's choice, ~190 registers); the fastest of the caps timed on an
#: H200 by ``scripts/bench_select.py`` (benchmarks/results/2026-11-29-h200-s4/).
_DEFAULT_MAXNREG = 80

#: Largest ``k`` handled by :func:`topk_ascending` (checked on an H200 up to 2048; larger ``k``
#: selects with the other CUDA paths of :func:`sp_kpool.selection.select_pools`).
MAX_K = 2048
_MAX_GROUPS = 8192

#: Default of ``topk_ascending(vsteps=)``: phase 2's first steps split in value.
_DEFAULT_VSTEPS = 3

#: Defaults of ``topk_ascending(split2=, split4=)``: where the first step of phase 2's /
#: phase 4's search splits the values (``()``: evenly / in key).
_DEFAULT_SPLIT2 = (0.45, 0.6)
_DEFAULT_SPLIT4 = (0.006, 0.022)


#: Largest block of candidate cells (candidate groups x columns per group): the largest run
#: on an H200 (k 2048, groups of 16, 70000 columns). Larger blocks spill registers (Triton caps any block at
#: 2**20 elements); such shapes select with the other paths of ``select_pools``.
_MAX_BLOCK = 32768


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _sizes(W: int, k: int, tile: int, capg: int | None, min_group: int = 8):
    """``(tile, group, ng, capg)`` of a launch for rows of width ``W``.

    ``group``: the smallest power of two ``>= min_group`` that makes at most 8192 groups.
    ``capg`` (default): ``pow2(k) * 8 / group`` for groups of fewer than 8 columns, else
    ``pow2(k)``, so that the candidate block (``capg * group`` cells) is ``8 * pow2(k)``
    cells either way; with groups of 4 columns, phase 2 may stop with up to twice ``k``
    candidate groups, which takes far fewer search steps (on an H200: much faster on rows
    with many near-ties, slower on random scores and on DeepGEMM logits, whose phases 1
    and 3 handle twice the groups)."""
    tile = min(_pow2(tile), _pow2(max(W + 8, 16)))
    group = max(_pow2(min_group), min(tile // 8, _pow2(-(-max(W, 1) // _MAX_GROUPS))))
    # groups are aligned to multiples of `group` columns: a row [a, e) within W columns
    # touches at most cdiv(W, group) of them; phase 2 holds them as [ng / gl, gl]
    ng = max(_pow2(-(-max(W, 1) // group)), group, 8)
    default_capg = _pow2(k) * max(1, 8 // group)
    return tile, group, ng, _pow2(capg or default_capg)


def _default_warps(W: int, k: int, min_group: int = 8) -> int:
    """Warps per program: 16 candidate cells per thread, 4 to 16 warps."""
    _, group, _, capg = _sizes(W, k, 4096, None, min_group)
    return min(16, max(4, capg * group // 512))


@functools.lru_cache(maxsize=256)
def supports(width: int, k: int) -> bool:
    """Whether :func:`topk_ascending` handles rows of ``width`` columns and this ``k`` (at
    the default launch): ``1 <= k <= MAX_K`` and ``capg`` (the power of two ``>= k``)
    candidate groups of ``G`` columns within a block of 32768 cells, and at most 8192 groups
    per row (``k`` 512: up to 524288 columns; ``k`` 2048: up to 131072). Checked on an H200
    up to 70000 columns."""
    if not 1 <= k <= MAX_K:
        return False
    _, group, ng, capg = _sizes(width, k, 512 * _default_warps(width, k), None)
    return capg * group <= _MAX_BLOCK and ng <= _MAX_GROUPS


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
    ``+0.0`` here; in the search loop :func:`row_keys` cost 16 more instructions, sm_90)."""
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
def kth_interp(vals, k, floor, stop):
    """The search of :func:`kth_largest` (same result and meaning), by safeguarded
    interpolation: ``x`` with ``count(vals >= x) >= k``, the count at most ``stop`` where
    the values allow, searched among ``x >= floor`` (``vals`` below ``floor`` are ignored;
    the caller guarantees ``count(vals >= floor) >= k`` or accepts the smallest value
    ``>= floor``). Returns ``(x, count(vals >= x), count(vals > x))``, the last exact only
    where the first count is ``> stop``.

    The bracket ``[lo, hi)`` starts at the smallest and the largest value ``>= floor`` (one
    reduction). Each step counts at two points in one reduction: where a straight line
    through ``(lo, count(>= lo))`` and ``(hi, count(>= hi))`` puts the counts ``stop`` and
    ``k``, each widened by one standard deviation of the count (``sqrt(n f (1 - f))`` for
    ``n`` values in the bracket) and half a value. A step that does not shrink the bracket
    to a third, or an interpolated bracket wider than two thirds, is followed by (or
    replaced with) a split in thirds, so the bracket shrinks at least threefold every two
    steps. Random scores take about 2 steps to reach a window
    ``[k, 2k]`` of 8192 groups and about 6 to the exact ``k``-th of the candidate cells,
    against about 6 and 7 for splits in thirds (a simulation over normal and ReLU-sum
    scores). On an H200 it was not faster than :func:`kth_largest` (each step costs more;
    ``benchmarks/results/2026-11-30-h200-s7``)."""
    v = tl.reshape(vals, (vals.numel,), can_reorder=True)  # one reduction over all values
    ok = v >= floor
    top, low, n_lo = tl.reduce((v, tl.where(ok, v, 2147483647), ok.to(tl.int32)), 0, _max_min_sum)
    lo = low.to(tl.int64)
    cnt_lo = n_lo
    hi = top.to(tl.int64) + 1
    cnt_hi = tl.full((), 0, tl.int32)
    split = tl.full((), 0, tl.int32)
    while (hi - lo > 1) & (cnt_lo > stop):
        w = hi - lo
        n = (cnt_lo - cnt_hi).to(tl.float32)  # >= 1: cnt_lo > stop >= k > cnt_hi
        r = tl.fdiv(1.0, n, ieee_rounding=False)
        d_hi = (cnt_lo - k).to(tl.float32)  # the count may drop by at most this ...
        d_lo = (cnt_lo - stop).to(tl.float32)  # ... and must drop by at least this
        f = d_hi * r
        sd = tl.sqrt(n * f * (1.0 - f))
        wf = w.to(tl.float32) * r
        m1 = lo + (wf * tl.maximum(d_lo - sd - 0.5, 0.0)).to(tl.int64)
        m2 = lo + (wf * tl.minimum(d_hi + sd + 0.5, n)).to(tl.int64) + 1
        m1 = tl.minimum(tl.maximum(m1, lo + 1), hi - 1)  # lo < m1 <= m2 < hi
        m2 = tl.minimum(tl.maximum(m2, m1), hi - 1)
        thirds = (split == 1) | ((m2 - m1) * 3 > w * 2)
        m1 = tl.where(thirds, lo + tl.maximum(w // 3, 1), m1)
        m2 = tl.where(thirds, lo + tl.maximum((w * 2) // 3, 1), m2)
        c1, c2 = count_ge2(vals, m1, m2)
        lo, cnt_lo, hi, cnt_hi = narrow2(k, lo, cnt_lo, hi, cnt_hi, m1, c1, m2, c2)
        split = ((split == 0) & ((hi - lo) * 3 > w)).to(tl.int32)
    return lo.to(tl.int32), cnt_lo, cnt_hi


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


@triton.jit
def select_kernel(S, stride_s, starts_ptr, ends_ptr, base_ptr, Out, stride_o, Gmax, Cand, R, k, nprog,
                  TILE: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, CAPG: tl.constexpr, KP: tl.constexpr,
                  PHASES: tl.constexpr, WAYS: tl.constexpr, SB: tl.constexpr, GL: tl.constexpr, CW: tl.constexpr,
                  INTERP: tl.constexpr, VSTEPS: tl.constexpr = 0, F2A: tl.constexpr = 0.0,
                  F2B: tl.constexpr = 0.0, F4A: tl.constexpr = 0.0, F4B: tl.constexpr = 0.0):
    # PHASES < 4 stops after that phase (timing of the phases only; the output is wrong)
    MINK: tl.constexpr = -2147483648
    NB: tl.constexpr = TILE // G
    pid = tl.program_id(0)
    gbase = Gmax + pid.to(tl.int64) * NG
    cbase = Cand + pid.to(tl.int64) * CW  # CW >= max(NG, CAPG): unmasked candidate-id loads stay in the row
    for row in range(pid, R, nprog):
        a = tl.load(starts_ptr + row)
        # z1 and z are 0 (starts are >= 0) but unknown to the compiler: index tensors built
        # from z are computed per row instead of being hoisted out of the loop, where they
        # would hold ~100 registers per thread for the whole kernel (fewer programs per SM);
        # z1 hides the alignment of phase 1's stores
        z1 = tl.where(a < 0, a, 0)
        z = z1 * 16
        tb = tl.arange(0, NB) + z
        q4 = tl.arange(0, G // 4) + z
        t4 = tl.arange(0, 4) + z
        tg = tl.arange(0, G) + z
        gb = tl.arange(0, NG // GL) + z
        gl = tl.arange(0, GL) + z
        cg = tl.arange(0, CAPG) + z
        sg = tl.arange(0, SB) + z
        kofs = tl.arange(0, KP) + z
        e = tl.load(ends_ptr + row)
        pbase = tl.load(base_ptr + row)
        a0 = (a // G) * G  # groups of G columns aligned to multiples of G (vector loads)
        srow = S + tl.cast(row, tl.int64) * stride_s
        orow = Out + tl.cast(row, tl.int64) * stride_o
        tl.debug_barrier()  # the previous row is done with the scratch
        # 1. maxima of the groups of G columns (INT32_MIN: no visible cell). Tiles i of
        # [a0 + i TILE, a0 + (i + 1) TILE): those inside [a, e) (i in [i0, i1), most of
        # them) in a loop without masks or branches (on an H200 faster than one loop with
        # a branch per tile, and fewer spills); the first tile if it starts before a, and
        # the last if it ends past e, with masks
        i0 = (a > a0).to(tl.int32)
        i1 = tl.maximum((e - a0) // TILE, i0)
        for t0 in range(a0 + i0 * TILE, a0 + i1 * TILE, TILE):
            # maxima of floats, one key per group
            # as [NB, G / 4, 4]: each thread holds whole groups (two 16-byte loads per group
            # of 8), so the maxima need no shuffles, and stored at an offset whose alignment
            # the compiler cannot see (z1), they need no layout conversion either (as [NB,
            # G], a conversion through shared memory with two barriers per tile)
            g0 = t0 + tb * G
            v = tl.load(srow + g0[:, None, None] + (q4[None, :, None] * 4 + t4[None, None, :]))
            # tl.max combines with maxnum (propagate_nan NONE): a NaN cell is skipped, a
            # group of NaN only gives NaN, which row_keys makes invisible
            m = tl.max(tl.max(v, axis=2), axis=1)
            gidx = (t0 - a0) // G + tb  # < NG: the tile lies inside the row
            tl.store(gbase + gidx + z1, row_keys(m, m == m))
        for i in range(0, i0 + 1):  # the first tile (i = 0, if it starts before a), the last (i = i1)
            t0 = a0 + tl.where(i < i0, 0, i1) * TILE
            if t0 < e:
                g0 = t0 + tb * G
                key, _c = load_keys(srow, g0, tg, g0 < e, a, e)
                gidx = (t0 - a0) // G + tb
                tl.store(gbase + gidx, tl.max(key, axis=1), mask=gidx < NG)
        nsel = tl.full((), 0, tl.int32)
        if (e > a) & (PHASES >= 2):
            tl.debug_barrier()
            ngroups = tl.cdiv(e - a0, G)
            gi = gb[:, None] * GL + gl[None, :]  # group ids as [NG / GL, GL]
            # unmasked (vector loads); the scratch past the row's groups holds stale values
            gm = tl.where(gi < ngroups, tl.load(gbase + gi), MINK)
            # 2. L: at least k group maxima are >= L, so the k-th key T is >= L and every
            # key of the answer lies in a group whose maximum is >= L (the search stops as
            # soon as at most CAPG groups qualify). Fewer than k visible groups: L admits
            # every visible cell (whose count may be at most k: then all are selected).
            if INTERP:
                low, n_low, _n = kth_interp(gm, k, MINK + 1, CAPG)
                low = tl.where(n_low >= k, low, MINK + 1)
                top = low  # not used
            else:
                # from MINK + 1: fewer than k visible groups return it (every visible cell);
                # n_low = count(gm >= low), top: the row's largest key (phase 4's too)
                low, n_low, _n, top = kth_largest(gm, k, tl.full((), MINK + 1, tl.int32), CAPG, WAYS, VSTEPS, None,
                                                  F2A, F2B)  # fmt: skip
            if PHASES >= 3:
                # 3. those groups' ids, in column order
                f = (gm >= low).to(tl.int32)
                tl.store(cbase + positions(f) - 1, gi, mask=f == 1)
                if INTERP:
                    nc = tl.sum(f)
                else:
                    nc = n_low
                if PHASES >= 4:
                    tl.debug_barrier()
                    if nc <= CAPG:
                        # 4. their keys in registers: T, then the keys above T and the first
                        # keys equal to T (ties toward the lower column), in column order
                        key, cols = candidate_keys(cbase, 0, cg, nc, srow, a0, tg, a, e, G, False)
                        if INTERP:
                            t, n_ge, n_gt = kth_interp(key, k, low, k)
                        else:
                            # the candidates hold the row's largest key: phase 2's top
                            # (F4B > 0: its first step splits the values at F4A and F4B)
                            t, n_ge, n_gt, _t = kth_largest(key, k, low, k, WAYS, (F4B > 0) * 1, top, F4A, F4B,
                                                            False)  # fmt: skip
                        sel = key >= t
                        if n_ge > k:  # ties at T
                            eq = (key == t).to(tl.int32)
                            sel = (key > t) | ((eq == 1) & (positions(eq) <= k - n_gt))
                        tl.store(orow + positions(sel.to(tl.int32)) - 1, (pbase + cols).to(tl.int32), mask=sel)
                        nsel = tl.minimum(n_ge, k)  # n_ge <= k: every visible cell
                    else:
                        # 4'. more than CAPG groups (long runs of equal scores): the same
                        # search, streaming the groups in blocks of SB >= CAPG (from L2)
                        lo = low.to(tl.int64)
                        hi = tl.max(gm).to(tl.int64) + 1
                        cnt_lo = k + 1  # count(key >= low) > k is all the loop needs
                        cnt_hi = tl.full((), 0, tl.int32)
                        while (hi - lo > 1) & (cnt_lo > k):
                            m1, m2, m3, m4 = split5(lo, hi)
                            c1 = tl.full((), 0, tl.int32)
                            c2 = tl.full((), 0, tl.int32)
                            c3 = tl.full((), 0, tl.int32)
                            c4 = tl.full((), 0, tl.int32)
                            for c0 in range(0, nc, SB):
                                key, cols = candidate_keys(cbase, c0, sg, nc, srow, a0, tg, a, e, G, True)
                                d1, d2, d3, d4 = count_ge4(key, m1, m2, m3, m4)
                                c1 += d1
                                c2 += d2
                                c3 += d3
                                c4 += d4
                            lo, cnt_lo, hi, cnt_hi = narrow4(k, lo, cnt_lo, hi, cnt_hi, m1, c1, m2, c2, m3, c3, m4, c4)
                        t = lo.to(tl.int32)
                        need = k - cnt_hi  # keys equal to T to take (count(key > T) = cnt_hi)
                        n_out = tl.full((), 0, tl.int32)
                        n_eq = tl.full((), 0, tl.int32)
                        for c0 in range(0, nc, SB):
                            key, cols = candidate_keys(cbase, c0, sg, nc, srow, a0, tg, a, e, G, True)
                            eq = (key == t).to(tl.int32)
                            sel = (key > t) | ((eq == 1) & (n_eq + positions(eq) <= need))
                            si = sel.to(tl.int32)
                            tl.store(orow + n_out + positions(si) - 1, (pbase + cols).to(tl.int32), mask=sel)
                            n_out += tl.sum(si)
                            n_eq += tl.sum(eq)
                        nsel = tl.full((), 0, tl.int32) + k
        tl.store(orow + kofs, tl.full((KP,), -1, tl.int32), mask=(kofs >= nsel) & (kofs < k))


@triton.jit
def expand_kernel(P, stride_p, rows_ptr, tail_ptr, hi_ptr, Out, stride_o, k, topk, width,
                  K: tl.constexpr, KS: tl.constexpr, KP: tl.constexpr, TB: tl.constexpr, COMPACT: tl.constexpr):
    # one row per program; every column of the row is written once (no -1 fill beforehand):
    # columns [0, k K) as [k, K] (the tokens of pool slot i, else tail or -1), then the
    # columns [k K, width) (tail or -1). A visible pool p of the row starts at token
    # (t + 1 - tail) - (pool_hi - p) K: no table lookup (a gather per pool took a third
    # of the kernel's time on an H200)
    row = tl.program_id(0)
    pi = tl.arange(0, KP)
    p = tl.load(P + row.to(tl.int64) * stride_p + pi, mask=pi < k, other=-1)
    valid = p >= 0
    slots = tl.arange(0, KS)
    orow = Out + tl.cast(row, tl.int64) * stride_o
    t = tl.load(rows_ptr + row).to(tl.int32)
    tlen = tl.load(tail_ptr + row).to(tl.int32)
    phi = tl.load(hi_ptr + row).to(tl.int32)
    first = (t + 1 - tlen) - (phi - p) * K
    if COMPACT:  # the valid pools come first: the tail right after their tokens
        tail0 = tl.sum(valid.to(tl.int32), axis=0) * K
    else:
        tail0 = topk
    cols = pi[:, None] * K + slots[None, :]
    j = cols - tail0  # tail slot of each column
    val = tl.where(valid[:, None], first[:, None] + slots[None, :], tl.where((j >= 0) & (j < tlen), t - tlen + 1 + j, -1))
    tl.store(orow + cols, val, mask=(pi[:, None] < k) & (slots[None, :] < K))
    c = k * K + tl.arange(0, TB)
    j2 = c - tail0
    tl.store(orow + c, tl.where((j2 >= 0) & (j2 < tlen), t - tlen + 1 + j2, -1), mask=c < width)


#: What the last :func:`topk_ascending` launch used (registers, spills, programs per SM,
#: constants), for the benchmarks.
last_launch: dict = {}
_occupancy: dict = {}


def _resident(kernel, num_warps: int, smem_per_sm: int = 233472) -> int:
    """Programs of ``kernel`` one SM holds at once, by registers, warps and shared memory
    (``smem_per_sm`` bytes; each program also reserves 1 KiB)."""
    try:
        kernel._init_handles()
        regs = max(int(kernel.n_regs), 1)
        smem = int(getattr(kernel.metadata, "shared", 0) or 0)
    except Exception:  # noqa: BLE001 - the interpreter or an older Triton: no register count
        return 1
    threads = 32 * num_warps
    by_regs = 65536 // (-(-regs // 8) * 8 * threads)  # registers are allocated per warp in 256s
    by_smem = smem_per_sm // (smem + 1024)
    return max(1, min(by_regs, by_smem, 2048 // threads, 32))


def topk_ascending(
    scores: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    base: torch.Tensor,
    k: int,
    *,
    tile: int | None = None,
    num_warps: int | None = None,
    programs: int | None = None,
    capg: int | None = None,
    ways: int = 3,
    maxnreg: int | None = None,
    phases: int = 4,
    search: str = "split",
    min_group: int = 8,
    vsteps: int | None = None,
    split2: tuple[float, float] | None = None,
    split4: tuple[float, float] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The exact Top-K of each row, in ascending column order.

    Args:
        scores: ``[R, W]`` float32 (unit column stride); cells outside ``[starts[r],
            ends[r])`` are ignored, ``-inf`` cells are invisible.
        starts, ends: ``[R]`` integer, the columns ``[start, end)`` of each row to consider
            (clipped to ``[0, W)``).
        base: ``[R]`` int64, global pool id of column 0 of each row.
        k: pools to select (``1 <= k <= MAX_K``).
        tile, num_warps, programs: launch configuration (columns per step, warps per
            program, programs of the persistent grid). Defaults: ``num_warps`` so that the
            candidate block is 16 cells per thread (4 to 16), ``tile`` 512 columns per warp,
            and as many programs as the GPU holds at once (from the compiled kernel's
            register count), at most one per row.
        capg: capacity in candidate groups held in registers (a power of two >= k; default
            the power of two ``>= k``); rows with more candidate groups stream them in blocks
            of at least 256 groups (tests use a small ``capg`` to reach that path).
        ways: thresholds counted per block reduction of the split searches, plus one (2, 3
            or 5); the streamed path always uses 5.
        search: ``"split"`` (default): the searches of phases 2 and 4 split the bracket
            in ``ways`` (:func:`kth_largest`); ``"interp"``: they interpolate
            (:func:`kth_interp`: fewer steps, more arithmetic per step; not faster on an
            H200).
        min_group: smallest group of columns (4 or 8, default 8; wider rows get wider
            groups, up to 8192 per row). With 4 and the default ``capg``, phase 2 may stop
            with up to ``2 pow2(k)`` candidate groups.
        maxnreg: register cap per thread passed to the compiler (more programs per SM,
            some spilling); default 80 for up to 8 warps, else the compiler's choice; ``0``:
            the compiler's choice.
        phases: ``< 4`` stops after that phase, for timing the phases (wrong output).
        vsteps: steps of phase 2's split search that split the bracket in value rather than
            in key (:func:`kth_largest`'s ``VSTEPS``; default ``_DEFAULT_VSTEPS``, 0: none;
            not used with ``ways=5`` or ``search="interp"``). The answer does not depend
            on it.
        split2, split4: ``(a, b)`` with ``0 < a < b < 1``, or ``()``: the first step of
            phase 2's / phase 4's search splits the bracket's FP32 value range at these
            fractions (``ways=2``: at ``a``) instead of evenly (phase 2, with ``vsteps``) or
            in key (phase 4); defaults ``_DEFAULT_SPLIT2`` and ``_DEFAULT_SPLIT4``. The
            answer does not depend on them.
        out: optional ``[R, k]`` int32 destination with unit column stride (e.g. rows of
            a larger output), every element overwritten; returned.

    Returns:
        ``[R, k]`` int32 global pool ids ``base[r] + column``, ascending, ``-1`` after the
        ``min(k, visible)`` selected ones. The same ids as
        :func:`sp_kpool.selection.topk_pools`, for any input (ties included).
    """
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores: expected a 2-D float32 tensor, got {tuple(scores.shape)} {scores.dtype}")
    if not 1 <= k <= MAX_K:
        raise ValueError(f"k: expected 1 <= k <= {MAX_K}, got {k}")
    if ways not in (2, 3, 5):
        raise ValueError(f"ways: expected 2, 3 or 5, got {ways}")
    if search not in ("interp", "split"):
        raise ValueError(f"search: expected 'interp' or 'split', got {search!r}")
    if min_group not in (4, 8):
        raise ValueError(f"min_group: expected 4 or 8, got {min_group}")
    vsteps = _DEFAULT_VSTEPS if vsteps is None else vsteps
    if isinstance(vsteps, bool) or not isinstance(vsteps, int) or vsteps < 0:
        raise ValueError(f"vsteps: expected an int >= 0, got {vsteps!r}")
    split2 = _check_split("split2", _DEFAULT_SPLIT2 if split2 is None else split2)
    split4 = _check_split("split4", _DEFAULT_SPLIT4 if split4 is None else split4)
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    R, W = scores.shape
    dev = scores.device
    if out is None:
        out = torch.empty((R, k), dtype=torch.int32, device=dev)
    elif (out.shape != (R, k) or out.dtype != torch.int32 or out.device != dev
          or (k > 1 and out.stride(1) != 1)):  # fmt: skip
        raise ValueError(f"out: expected an int32 tensor of shape {(R, k)} with unit column stride on {dev}, got "
                         f"{out.dtype} {tuple(out.shape)} strides {tuple(out.stride())} on {out.device}")  # fmt: skip
    if R == 0:
        return out
    capg_req = capg
    warps = num_warps or _default_warps(W, k, min_group)
    tile, group, ng, capg = _sizes(W, k, tile or 512 * warps, capg, min_group)
    if capg < k:
        raise ValueError(f"capg: expected at least k = {k}, got {capg_req}")
    if capg * group > _MAX_BLOCK:
        raise ValueError(
            f"scores: rows of {W} columns with k = {k} need {capg} x {group} candidate cells, "
            f"more than {_MAX_BLOCK} (see supports())"
        )
    if ng > _MAX_GROUPS:  # the searches count in 16-bit fields; phase 2 holds the maxima in registers
        raise ValueError(
            f"scores: rows of {W} columns make {ng} groups of {group} columns (tile {tile}), more than "
            f"{_MAX_GROUPS} (see supports())"
        )
    # streamed candidate blocks: at least 256 groups (small k would make tiny blocks), within the block limit
    sb = max(capg, min(256, _MAX_BLOCK // group))
    consts = dict(TILE=tile, G=group, NG=ng, CAPG=capg, KP=_pow2(k), PHASES=phases, WAYS=ways, SB=sb,
                  GL=max(group, 8), CW=max(ng, capg), INTERP=search == "interp", num_warps=warps)  # fmt: skip
    if vsteps and ways in (2, 3) and search == "split":
        consts["VSTEPS"] = vsteps
        if split2:
            consts["F2A"], consts["F2B"] = split2
    if split4 and ways in (2, 3) and search == "split":
        consts["F4A"], consts["F4B"] = split4
    maxnreg = _DEFAULT_MAXNREG if maxnreg is None and warps <= 8 else maxnreg
    if maxnreg:
        consts["maxnreg"] = maxnreg
    # columns outside [0, W) do not exist: phase 1 reads and stores whole tiles up to the end
    # without masks, and its tile arithmetic (a start's tile + tiles) stays within int32
    starts = starts.to(device=dev, dtype=torch.int32).clamp(min=0, max=W).contiguous()
    ends = ends.to(device=dev, dtype=torch.int32).clamp(max=W).contiguous()
    base = base.to(device=dev, dtype=torch.int64).contiguous()
    cut = _rows_in_storage(scores, -(-W // group) * group)
    if cut > 0:
        _launch(scores[:cut], starts[:cut], ends[:cut], base[:cut], out[:cut], consts, programs)
    if cut < R:  # rows whose last group would be read past the storage: from a padded copy
        rest = torch.nn.functional.pad(scores[cut:], (0, -W % group), value=-float("inf"))
        _launch(rest, starts[cut:], ends[cut:], base[cut:], out[cut:], consts, programs)
    return out


def _check_split(name: str, split) -> tuple:
    """``split`` as a tuple of two floats ``0 < a < b < 1``, or ``()`` (not used)."""
    if split is None or split == () or split is False:
        return ()
    try:
        a, b = (float(x) for x in split)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected two fractions (a, b) with 0 < a < b < 1, or (), got {split!r}") from None
    if not 0 < a < b < 1:
        raise ValueError(f"{name}: expected two fractions (a, b) with 0 < a < b < 1, or (), got {split!r}")
    return a, b


def _rows_in_storage(scores: torch.Tensor, span: int) -> int:
    """How many leading rows of ``scores`` can be read for ``span`` columns (whole groups,
    up to ``group - 1`` past the row's width) within the tensor's storage."""
    R = scores.shape[0]
    avail = scores.untyped_storage().nbytes() // scores.element_size() - scores.storage_offset()
    if span > avail:
        return 0
    stride = scores.stride(0)
    if stride == 0:  # every row is the same memory
        return R
    return min(R, (avail - span) // stride + 1)


def _launch(scores, starts, ends, base, out, consts, programs):
    R, k = out.shape
    dev = scores.device
    args = [scores, scores.stride(0), starts, ends, base, out, out.stride(0)]
    if dev.type == "cuda":
        key = (dev.index, tuple(sorted(consts.items())))
        if key not in _occupancy:  # compile once per configuration (warmup costs host time)
            compiled = select_kernel.warmup(*args, out, out, R, k, 1, grid=(1,), **consts)
            props = torch.cuda.get_device_properties(dev)
            # loads the binary: register counts known after
            per_sm = _resident(compiled, consts["num_warps"], getattr(props, "shared_memory_per_multiprocessor", 233472))
            _occupancy[key] = dict(regs=getattr(compiled, "n_regs", None), spills=getattr(compiled, "n_spills", None),
                                   shared=getattr(compiled.metadata, "shared", None), per_sm=per_sm,
                                   sms=props.multi_processor_count)  # fmt: skip
        occ = _occupancy[key]
        last_launch.update(occ)
        if programs is None:
            programs = occ["sms"] * occ["per_sm"]
    progs = max(1, min(R, programs or 4))
    last_launch.update(programs=progs, VSTEPS=consts.get("VSTEPS", 0),
                       split2=(consts.get("F2A"), consts.get("F2B")) if "F2B" in consts else (),
                       split4=(consts.get("F4A"), consts.get("F4B")) if "F4B" in consts else (),
                       **{n: consts[n] for n in ("TILE", "G", "NG", "CAPG", "SB", "WAYS", "INTERP", "num_warps")})  # fmt: skip
    gmax = torch.empty((progs, consts["NG"]), dtype=torch.int32, device=dev)
    cand = torch.empty((progs, consts["CW"]), dtype=torch.int32, device=dev)
    select_kernel[(progs,)](*args, gmax, cand, R, k, progs, **consts)


def expand_pools(
    pools: torch.Tensor,
    rows: torch.Tensor,
    tail_len: torch.Tensor,
    pool_hi: torch.Tensor,
    out: torch.Tensor,
    *,
    topk: int,
    kpool: int,
    tail: str,
) -> torch.Tensor:
    """Token ids and tail into ``out`` (``[R, width]`` int32, unit column stride; every
    column is overwritten, nothing needs filling beforehand).

    ``pools``: ``[R, k]`` int32/int64 global pool ids, valid ones first, ``-1`` after (any
    order among the valid ones is kept), each a **visible** pool of its row (in
    ``[pool_lo, pool_hi)`` of :class:`sp_kpool.selection.RowMeta`, as every selector returns
    them); ``rows``, ``tail_len``, ``pool_hi``: ``[R]`` int64 (global token id, tail length
    and end of the visible pool range of each row). Pool ``p`` of row ``t`` starts at token
    ``t + 1 - tail_len - (pool_hi - p) * kpool`` (the pools before a row tile its document
    up to its tail). Writes the layout of :func:`sp_kpool.selection.assemble` and returns
    ``out``.
    """
    R, k = pools.shape
    if R == 0:
        return out
    if out.dim() != 2 or out.shape[0] != R or out.dtype != torch.int32 or (out.shape[1] > 1 and out.stride(1) != 1):
        raise ValueError(f"out: expected a [{R}, width] int32 tensor with unit column stride, got "
                         f"{out.dtype} {tuple(out.shape)} strides {tuple(out.stride())}")  # fmt: skip
    width = out.shape[1]
    pools = pools.contiguous()
    expand_kernel[(R,)](
        pools, pools.stride(0), rows.contiguous(), tail_len.contiguous(), pool_hi.contiguous(),
        out, out.stride(0), k, topk, width,
        K=kpool, KS=_pow2(kpool), KP=_pow2(k), TB=_pow2(max(1, width - k * kpool)), COMPACT=tail == "compact",
        num_warps=4,
    )  # fmt: skip
    return out


# integer arguments not specialised (divisibility, == 1): they change with the rank and the
# call, and a new specialisation is a compile on the host's path
@triton.jit(do_not_specialize=["n_docs", "lo_row", "hi_row", "first", "C", "total"])
def ranges_kernel(cu_ptr, offs_ptr, bounds_ptr, out_ptr, n_docs, lo_row, hi_row, first, C, total,
                  K: tl.constexpr, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inb = i < total
    g = first + i  # global row
    mine = inb & (g >= lo_row) & (g < hi_row)
    # document of g: the last d in [0, n_docs) with cu[d] <= g (binary search)
    d_lo = tl.zeros((BLOCK,), tl.int32)
    d_hi = tl.zeros((BLOCK,), tl.int32) + (n_docs - 1)
    for _ in tl.static_range(STEPS):
        mid = (d_lo + d_hi + 1) // 2
        c = tl.load(cu_ptr + mid, mask=mine, other=0)
        up = c <= g
        d_lo = tl.where(up, mid, d_lo)
        d_hi = tl.where(up, d_hi, mid - 1)
    cu_d = tl.load(cu_ptr + d_lo, mask=mine, other=0)
    p_lo = tl.load(offs_ptr + d_lo, mask=mine, other=0)
    p_hi = p_lo + (g - cu_d + 1) // K
    ch = i // C
    c_lo = tl.load(bounds_ptr + 2 * ch, mask=mine, other=0)
    c_hi = tl.load(bounds_ptr + 2 * ch + 1, mask=mine, other=0)
    r_s = tl.maximum(p_lo - c_lo, 0)
    r_e = tl.maximum(tl.minimum(p_hi, c_hi) - c_lo, r_s)
    tl.store(out_ptr + i, tl.where(mine, r_s, 0).to(tl.int32), mask=inb)
    tl.store(out_ptr + total + i, tl.where(mine, r_e, 0).to(tl.int32), mask=inb)


def chunk_row_ranges(cu: torch.Tensor, offs: torch.Tensor, bounds: torch.Tensor, lo_row: int, hi_row: int,
                     first: int, C: int, kpool: int) -> torch.Tensor:  # fmt: skip
    """``[2, n_chunks * C]`` int32: ``[start, end)`` of every row of the chunk grid (global
    row ``first + i``) relative to its chunk's pool range ``bounds[i // C]`` (``[n_chunks,
    2]`` int64), ``0, 0`` for rows outside ``[lo_row, hi_row)`` (real rows only). ``cu``:
    ``real_cu_seq_lens`` (int64, ``[docs + 1]``), ``offs``: ``doc_pool_offset``. Equal to
    :func:`sp_kpool.backends.base.row_ranges_torch` (one launch instead of about thirty
    small kernels on the host's path to the first scoring call). The binary search over
    the documents takes ``bit_length(docs)`` steps, rounded up to a multiple of 4 (few
    compiled variants)."""
    total = bounds.shape[0] * C
    out = torch.empty((2, total), dtype=torch.int32, device=bounds.device)
    n_docs = cu.numel() - 1
    if total:
        block = 1024
        ranges_kernel[(triton.cdiv(total, block),)](
            cu, offs, bounds, out, n_docs, lo_row, hi_row, first, C, total,
            K=kpool, STEPS=-(-max(1, n_docs.bit_length()) // 4) * 4, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out
