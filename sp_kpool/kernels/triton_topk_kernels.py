"""The kernels of the exact Top-K selector (Triton): ``select_kernel`` (steps 0-4 below)
and ``short_kernel`` (rows that all see at most ``k`` columns: step 0 only, one program per
row), launched by :func:`sp_kpool.kernels.triton_topk.topk_ascending`; the search and count
helpers are in :mod:`sp_kpool.kernels.triton_topk_search`.

Per row (a persistent grid: program ``p`` takes rows ``p, p + P, ...`` and reuses a small
scratch area in global memory, which stays in L2):

0. A row whose range ``[start, end)`` holds at most ``k`` columns selects every visible one
   (no ranking; the rows of short documents): one masked tile, in column order. The other
   rows take steps 1-4.

1. Keys: the FP32 bits mapped to a monotone int32; cells outside ``[start, end)`` or at
   ``-inf`` or NaN get ``INT32_MIN`` (invisible). One pass over the row stores the maxima
   of groups of ``G`` aligned adjacent columns (``G`` = 4 for ``k > 512`` up to 32768
   columns, else 8 up to 65536 columns, then 16, 32, ...). Whole groups are read with
   vector loads (the launcher runs rows whose last group would end past the tensor's
   storage from a padded copy); the tiles inside ``[start, end)`` run in a loop of their
   own without masks or branches that converts only the group maxima to keys (the first
   and the last tile, masked, after it). Nothing is counted here.
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
its arithmetic. Their bracket arithmetic is 32-bit (offset binary: 64-bit steps cost about
a fifth of all instructions), their loops end with the search (``while``, not a fixed
length), and the scratch is read with unmasked vector loads (scalar masked loads of the
group maxima read 4x their L2 sectors). Launches of up to 8 warps cap registers at 80 per
thread (3 programs per SM instead of 1), and index tensors are rebuilt per row so that the
compiler cannot keep them live across the row loop. Prefix counts use a scan over group
sums plus a scan inside each group: one long scan over a tile is slow in Triton (a barrier
per register chunk).

Imports Triton: import this module only where Triton is available.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_topk_search import candidate_keys, count_ge4, kth_largest, load_keys, narrow4, positions, row_keys, split5


@triton.jit
def _select_all(srow, orow, a, e, pbase, kofs, k):
    """Step 0 of a row whose range ``[a, e)`` holds at most ``KP`` columns: every visible
    cell (``-inf`` and NaN are invisible), no ranking, one masked tile, written in column
    order as ``pbase + column``; returns how many."""
    m0 = kofs < e - a
    v0 = tl.load(srow + a + kofs, mask=m0, other=float("-inf"))
    ok0 = (m0 & (v0 > float("-inf"))).to(tl.int32)  # -inf and NaN are invisible
    pos = tl.cumsum(ok0, axis=0)
    # at most k written (a range longer than k breaks the caller's guarantee: the row is then
    # wrong, but nothing is written outside it)
    tl.store(orow + pos - 1, (pbase + a + kofs).to(tl.int32), mask=(ok0 == 1) & (pos <= k))
    return tl.minimum(tl.sum(ok0), k)


@triton.jit
def short_kernel(S, stride_s, starts_ptr, ends_ptr, base_ptr, Out, stride_o, k, KP: tl.constexpr):
    """Rows that all see at most ``k`` cells (``topk_ascending(short_rows="all")``): step 0
    only, one row per program (no scratch, no persistent loop), ``-1`` after."""
    row = tl.program_id(0)
    a = tl.load(starts_ptr + row)
    e = tl.load(ends_ptr + row)
    pbase = tl.load(base_ptr + row)
    tl.device_assert(e - a <= k, "short_rows='all' with a row that holds more than k columns")
    kofs = tl.arange(0, KP)
    orow = Out + tl.cast(row, tl.int64) * stride_o
    nsel = _select_all(S + tl.cast(row, tl.int64) * stride_s, orow, a, e, pbase, kofs, k)
    tl.store(orow + kofs, tl.full((KP,), -1, tl.int32), mask=(kofs >= nsel) & (kofs < k))


@triton.jit
def select_kernel(S, stride_s, starts_ptr, ends_ptr, base_ptr, Out, stride_o, Gmax, Cand, R, k, nprog,
                  TILE: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, CAPG: tl.constexpr, KP: tl.constexpr,
                  WAYS: tl.constexpr, SB: tl.constexpr, GL: tl.constexpr, CW: tl.constexpr, VSTEPS: tl.constexpr = 0,
                  F2A: tl.constexpr = 0.0, F2B: tl.constexpr = 0.0, F4A: tl.constexpr = 0.0, F4B: tl.constexpr = 0.0,
                  SHORT: tl.constexpr = 1):
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
        nsel = tl.full((), 0, tl.int32)
        if (e - a <= k) & (SHORT == 1):
            # 0. a row that sees at most k cells selects every visible one: no ranking (the
            # rows of short documents); one masked tile of KP >= k columns, in column order
            nsel = _select_all(srow, orow, a, e, pbase, kofs, k)
        else:
            # 1. maxima of the groups of G columns (INT32_MIN: no visible cell). Tiles i of
            # [a0 + i TILE, a0 + (i + 1) TILE): those inside [a, e) (i in [i0, i1), most of
            # them) in a loop without masks or branches (faster than one loop with a branch
            # per tile, and fewer spills); the first tile if it starts before a, and
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
            if e > a:
                tl.debug_barrier()
                ngroups = tl.cdiv(e - a0, G)
                gi = gb[:, None] * GL + gl[None, :]  # group ids as [NG / GL, GL]
                # unmasked (vector loads); the scratch past the row's groups holds stale values
                gm = tl.where(gi < ngroups, tl.load(gbase + gi), MINK)
                # 2. L: at least k group maxima are >= L, so the k-th key T is >= L and every
                # key of the answer lies in a group whose maximum is >= L (the search stops as
                # soon as at most CAPG groups qualify). Fewer than k visible groups: L admits
                # every visible cell (whose count may be at most k: then all are selected).
                # from MINK + 1: fewer than k visible groups return it (every visible cell);
                # n_low = count(gm >= low), top: the row's largest key (phase 4's too)
                low, n_low, _n, top = kth_largest(gm, k, tl.full((), MINK + 1, tl.int32), CAPG, WAYS, VSTEPS, None, F2A, F2B)
                # 3. those groups' ids, in column order
                f = (gm >= low).to(tl.int32)
                tl.store(cbase + positions(f) - 1, gi, mask=f == 1)
                nc = n_low  # candidate groups
                tl.debug_barrier()
                if nc <= CAPG:
                    # 4. their keys in registers: T, then the keys above T and the first keys
                    # equal to T (ties toward the lower column), in column order
                    key, cols = candidate_keys(cbase, 0, cg, nc, srow, a0, tg, a, e, G, False)
                    # the candidates hold the row's largest key: phase 2's top
                    # (F4B > 0: its first step splits the values at F4A and F4B)
                    t, n_ge, n_gt, _t = kth_largest(key, k, low, k, WAYS, (F4B > 0) * 1, top, F4A, F4B, False)
                    sel = key >= t
                    if n_ge > k:  # ties at T
                        eq = (key == t).to(tl.int32)
                        sel = (key > t) | ((eq == 1) & (positions(eq) <= k - n_gt))
                    tl.store(orow + positions(sel.to(tl.int32)) - 1, (pbase + cols).to(tl.int32), mask=sel)
                    nsel = tl.minimum(n_ge, k)  # n_ge <= k: every visible cell
                else:
                    # 4'. more than CAPG groups (long runs of equal scores): the same search,
                    # streaming the groups in blocks of SB >= CAPG (from L2)
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
