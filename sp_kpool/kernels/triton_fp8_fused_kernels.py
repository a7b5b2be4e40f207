"""The device code of :mod:`sp_kpool.kernels.triton_fp8_fused` (Triton): ``_fused_kernel``
(the scorer with DeepGEMM's per-logit arithmetic, storing the logits or selecting the exact
Top-K without storing them), ``_dense_pairs_kernel`` (the dense mode with two row blocks per
program) and their ``@triton.jit`` helpers (the chains, the pool blocks, the compaction). The
formula, the selection and the launcher (:func:`~sp_kpool.kernels.triton_fp8_fused.score_select`)
are documented there.

Imports Triton: import this module only where Triton is available.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_topk_search import row_keys


@triton.jit
def _halves(x, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, D: tl.constexpr, M: tl.constexpr):
    """``x [A, B, C, D, M]`` -> the even and odd ``m`` halves, each ``[A, B, C, D, M / 2]``."""
    return tl.split(tl.reshape(x, [A, B, C, D, M // 2, 2]))


@triton.jit
def _eight(x, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, D: tl.constexpr):
    """``x [A, B, C, D, 8]`` -> its eight slices ``x[..., i]``, ``i = 0 .. 7`` in order."""
    e, o = _halves(x, A, B, C, D, 8)
    e0, e1 = _halves(e, A, B, C, D, 4)  # i in {0, 4}, {2, 6}
    o0, o1 = _halves(o, A, B, C, D, 4)  # i in {1, 5}, {3, 7}
    x0, x4 = tl.split(e0)
    x2, x6 = tl.split(e1)
    x1, x5 = tl.split(o0)
    x3, x7 = tl.split(o1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _chain(x, w, BP: tl.constexpr, BQ: tl.constexpr, NM: tl.constexpr):
    """The eight head chains of :data:`DAG` from ``x [BP, BQ, 4, 2, NM]`` (accumulators of
    heads ``8 m + 2 q + b`` at ``[:, :, q, b, m]``) and ``w [1, BQ, 4, 2, NM]``: ``c[:, :, q, b]``
    = ``fma(r_{m=0} w_0, RN(r_1 w_1))``, then ``fma(r_m, w_m, c)`` for ``m = 2 .. NM - 1``."""
    r = tl.where(x > 0, x, 0.0)
    if NM == 4:  # m = 2 a + b': the first split takes b'
        e, o = _halves(r, BP, BQ, 4, 2, 4)
        we, wo = _halves(w, 1, BQ, 4, 2, 4)
        r0, r2 = tl.split(e)
        r1, r3 = tl.split(o)
        w0, w2 = tl.split(we)
        w1, w3 = tl.split(wo)
        c = tl.fma(r0, w0, r1 * w1)
        c = tl.fma(r2, w2, c)
        c = tl.fma(r3, w3, c)
    elif NM == 8:
        r0, r1, r2, r3, r4, r5, r6, r7 = _eight(r, BP, BQ, 4, 2)
        w0, w1, w2, w3, w4, w5, w6, w7 = _eight(w, 1, BQ, 4, 2)
        c = tl.fma(r0, w0, r1 * w1)
        c = tl.fma(r2, w2, c)
        c = tl.fma(r3, w3, c)
        c = tl.fma(r4, w4, c)
        c = tl.fma(r5, w5, c)
        c = tl.fma(r6, w6, c)
        c = tl.fma(r7, w7, c)
    else:  # NM == 16: the even and the odd m, eight each
        e, o = _halves(r, BP, BQ, 4, 2, 16)
        we, wo = _halves(w, 1, BQ, 4, 2, 16)
        r0, r2, r4, r6, r8, r10, r12, r14 = _eight(e, BP, BQ, 4, 2)
        r1, r3, r5, r7, r9, r11, r13, r15 = _eight(o, BP, BQ, 4, 2)
        w0, w2, w4, w6, w8, w10, w12, w14 = _eight(we, 1, BQ, 4, 2)
        w1, w3, w5, w7, w9, w11, w13, w15 = _eight(wo, 1, BQ, 4, 2)
        c = tl.fma(r0, w0, r1 * w1)
        c = tl.fma(r2, w2, c)
        c = tl.fma(r3, w3, c)
        c = tl.fma(r4, w4, c)
        c = tl.fma(r5, w5, c)
        c = tl.fma(r6, w6, c)
        c = tl.fma(r7, w7, c)
        c = tl.fma(r8, w8, c)
        c = tl.fma(r9, w9, c)
        c = tl.fma(r10, w10, c)
        c = tl.fma(r11, w11, c)
        c = tl.fma(r12, w12, c)
        c = tl.fma(r13, w13, c)
        c = tl.fma(r14, w14, c)
        c = tl.fma(r15, w15, c)
    return c  # [BP, BQ, 4, 2]


@triton.jit
def _one_dot_operands(Q, sq_r, sq_h, W, sw_r, first, end, H: tl.constexpr, D: tl.constexpr, BQ: tl.constexpr):
    """``qt [D, BQ H]`` and ``wt [1, BQ, 4, 2, H / 8]`` of the rows ``first .. first + BQ - 1``
    (zero from ``end`` on) for one ``[BP, 128] x [128, BQ H]`` dot per block, the weights laid
    as :func:`_chain` reads them. Column ``n`` of the dot holds head ``h = 8 m + 2 q + b`` of row
    ``i``: ``n = H i + h`` for ``BQ < 4``; for ``BQ >= 4``, ``n = b + 2 i + 2 BQ (q + 4 m)``,
    which puts the rows on the two lane bits of the wgmma accumulator's columns (bits 1-2) and
    every head of a row in one thread's registers, so the butterfly of :func:`_finish` needs
    no exchange between threads (with ``n = H i + h`` those bits hold ``q``: a layout
    conversion through shared memory per block). The same logits bit for bit (each column is
    its own dot product); on an H200 (2026-12-04, W, stores included) H 32: BF16 14.10-14.19
    against 14.38-14.43 ms, FP8 8.91-8.98 against 9.15-9.17 ms."""
    n = tl.arange(0, BQ * H)
    d = tl.arange(0, D)
    if BQ >= 4:  # n = b + 2 i + 2 BQ (q + 4 m)
        ni = (n // 2) % BQ
        nh = (n // (8 * BQ)) * 8 + ((n // (2 * BQ)) % 4) * 2 + n % 2
    else:
        ni = n // H
        nh = n % H
    nrow = first + ni
    nok = nrow < end
    qt = tl.load(Q + nrow.to(tl.int64)[None, :] * sq_r + nh[None, :] * sq_h + d[:, None], mask=nok[None, :],
                 other=0.0)  # fmt: skip
    n2 = n // H  # the weights in row order (loaded once per program)
    wt = tl.load(W + (first + n2).to(tl.int64) * sw_r + n % H, mask=first + n2 < end, other=0.0)
    return qt, tl.permute(tl.reshape(wt, [1, BQ, H // 8, 4, 2]), [0, 1, 3, 4, 2])


@triton.jit
def _one_dot_chains(kv, qt, wt, BP: tl.constexpr, BQ: tl.constexpr, H: tl.constexpr):
    """The eight head chains ``[BP, BQ * 8]`` of a pool block ``kv [BP, D]`` and the rows of
    ``qt``, ``wt`` (:func:`_one_dot_operands`): one dot, then :func:`_chain`."""
    acc = tl.dot(kv, qt)  # [BP, BQ H]
    if BQ >= 4:  # the columns of _one_dot_operands: [.., m, q, i, b]
        acc = tl.permute(tl.reshape(acc, [BP, H // 8, 4, BQ, 2]), [0, 3, 2, 4, 1])  # [BP, BQ, 4, 2, NM]
    else:
        acc = tl.permute(tl.reshape(acc, [BP, BQ, H // 8, 4, 2]), [0, 1, 3, 4, 2])  # [BP, BQ, 4, 2, NM]
    return tl.reshape(_chain(acc, wt, BP, BQ, H // 8), [BP, BQ * 8])


@triton.jit
def _pool_block(KV, KS, p, lo, hi, d, D: tl.constexpr, SCALED: tl.constexpr):
    """The pools ``p [BP]`` of a block: ``kv [BP, D]`` and their FP32 scales (``SCALED``; else
    0.0), zero outside ``[lo, hi)``."""
    pm = (p >= lo) & (p < hi)
    kv = tl.load(KV + p.to(tl.int64)[:, None] * D + d[None, :], mask=pm[:, None], other=0.0)
    if SCALED:
        scale = tl.load(KS + p, mask=pm, other=0.0)
    else:
        scale = 0.0
    return kv, scale


@triton.jit
def _finish(c, scale, BP: tl.constexpr, BQ: tl.constexpr, SCALED: tl.constexpr):
    """The logits ``[BP, BQ]`` from the chains ``c [BP, BQ * 8]`` (``j = 2 q + b``): the pairs
    of chains, the pool scale (``SCALED``; none is what a scale of 1.0 gives, bit for bit),
    the butterfly ``(P0 + P1) + (P2 + P3)``."""
    c0, c1 = tl.split(tl.reshape(c, [BP, BQ, 4, 2]))
    if SCALED:
        part = (c0 + c1) * scale[:, None, None]
    else:
        part = c0 + c1
    pa, pb = tl.split(tl.reshape(part, [BP, BQ, 2, 2]))
    x, y = tl.split(pa + pb)
    return x + y


@triton.jit
def _kth_key(keys, k):
    """The ``k``-th largest of ``keys`` (int32, at least ``k`` of them above ``INT32_MIN``)
    and how many are strictly above it: bisection on the key value."""
    lo = tl.full((), -2147483648, tl.int64)  # count(keys >= lo) >= k
    hi = tl.max(keys).to(tl.int64) + 1  # count(keys >= hi) < k
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        if tl.sum((keys.to(tl.int64) >= mid).to(tl.int32)) >= k:
            lo = mid
        else:
            hi = mid
    t = lo.to(tl.int32)
    return t, tl.sum((keys > t).to(tl.int32))


@triton.jit
def _compact(bk, bi, n, k, CAP: tl.constexpr):
    """Keep the Top-K of the ``n`` buffered (key, pool id) entries at ``bk``/``bi`` (in any
    order; ids distinct): the keys above the ``k``-th largest ``T`` and, of the keys equal to
    it, those with the lowest ids; returns ``(kept, T)``, ``kept = min(n, k)``."""
    j = tl.arange(0, CAP)
    ok = j < n
    keys = tl.load(bk + j, mask=ok, other=-2147483648)
    ids = tl.load(bi + j, mask=ok, other=2147483647)
    t, n_gt = _kth_key(keys, k)
    eq = ok & (keys == t)
    need = k - n_gt  # keys equal to T to keep: the `need` lowest ids among them
    lo = tl.full((), -1, tl.int32)  # count(eq & ids <= lo) < need
    hi = tl.max(tl.where(eq, ids, -1))  # count(eq & ids <= hi) >= need
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        if tl.sum((eq & (ids <= mid)).to(tl.int32)) >= need:
            hi = mid
        else:
            lo = mid
    keep = (ok & (keys > t)) | (eq & (ids <= hi))
    pos = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.debug_barrier()  # every entry is read before any is moved
    tl.store(bk + pos, keys, mask=keep)
    tl.store(bi + pos, ids, mask=keep)
    tl.debug_barrier()
    return tl.sum(keep.to(tl.int32)), t


@triton.jit
def _fused_kernel(Q, sq_r, sq_h, W, sw_r, KV, KS, Starts, Ends, row0, nrows, Logits, sl_r, Out, so_r, BufK, BufI,
                  Cnt, Emitted, k, pool_base, H: tl.constexpr, D: tl.constexpr, BQ: tl.constexpr, BP: tl.constexpr,
                  CAP: tl.constexpr, KP: tl.constexpr, DENSE: tl.constexpr, ONE_DOT: tl.constexpr,
                  CHECK: tl.constexpr, SCAN: tl.constexpr, STORE: tl.constexpr, SCALED: tl.constexpr):  # fmt: skip
    MINK: tl.constexpr = -2147483648
    N: tl.constexpr = BQ * 8
    pid = tl.program_id(0)
    iq = tl.arange(0, BQ)
    rows = row0 + pid * BQ + iq  # the program's rows (of the chunk)
    rok = rows < row0 + nrows
    ks = tl.load(Starts + rows, mask=rok, other=2147483647)
    ke = tl.load(Ends + rows, mask=rok, other=0)
    lo = tl.min(ks)  # masked rows: [INT32_MAX, 0), empty
    hi = tl.max(ke)
    d = tl.arange(0, D)
    if ONE_DOT:  # one [BP, 128] x [128, BQ H] dot per block, columns as _one_dot_operands lays them
        qt, wt = _one_dot_operands(Q, sq_r, sq_h, W, sw_r, row0 + pid * BQ, row0 + nrows, H, D, BQ)
    else:  # one dot per chain step m, column n = 8 i + j: head 8 m + j of row i
        n = tl.arange(0, N)
        nrow = row0 + pid * BQ + n // 8
        nok = nrow < row0 + nrows
        nj = n % 8
        qcol = Q + nrow.to(tl.int64) * sq_r + nj * sq_h  # [N] pointers to channel 0 of head j (m = 0)
        wcol = W + nrow.to(tl.int64) * sw_r + nj
    slot = (pid * BQ + iq).to(tl.int64) * CAP  # each row's candidate buffer
    crow = Cnt + pid * BQ + iq  # each row's candidate count (atomic; SCAN: `cnt`, in registers)
    cnt = tl.zeros((BQ,), tl.int32)
    if DENSE and not STORE:  # the scorer without stores: a running max per cell, one value per row stored
        probe = tl.full((BP, BQ), float("-inf"), tl.float32)
    tau = tl.full((BQ,), MINK, tl.int32)
    dropped = tl.zeros((BQ,), tl.int32)
    bp = tl.arange(0, BP)
    p_start = (lo // BP) * BP
    if hi <= lo:
        p_start = hi
    for s0 in range(p_start, hi, CHECK * BP):  # super-blocks: the inner loop has no barrier (pipelined)
        for p0 in range(s0, tl.minimum(s0 + CHECK * BP, hi), BP):
            p = p0 + bp
            kv, scale = _pool_block(KV, KS, p, lo, hi, d, D, SCALED)
            if ONE_DOT:
                c = _one_dot_chains(kv, qt, wt, BP, BQ, H)
            else:
                q0 = tl.load(qcol[None, :] + d[:, None], mask=nok[None, :], other=0.0)
                q1 = tl.load(qcol[None, :] + 8 * sq_h + d[:, None], mask=nok[None, :], other=0.0)
                a0 = tl.dot(kv, q0)
                a1 = tl.dot(kv, q1)
                w0 = tl.load(wcol, mask=nok, other=0.0)
                w1 = tl.load(wcol + 8, mask=nok, other=0.0)
                r0 = tl.where(a0 > 0, a0, 0.0)
                r1 = tl.where(a1 > 0, a1, 0.0)
                c = tl.fma(r0, w0[None, :], r1 * w1[None, :])
                for m in tl.static_range(2, H // 8):
                    qm = tl.load(qcol[None, :] + (8 * m) * sq_h + d[:, None], mask=nok[None, :], other=0.0)
                    am = tl.dot(kv, qm)
                    wm = tl.load(wcol + 8 * m, mask=nok, other=0.0)
                    c = tl.fma(tl.where(am > 0, am, 0.0), wm[None, :], c)
            logit = _finish(c, scale, BP, BQ, SCALED)  # [BP, BQ]
            vis = (p[:, None] >= ks[None, :]) & (p[:, None] < ke[None, :])
            if DENSE:
                if STORE:
                    dst = Logits + rows.to(tl.int64)[None, :] * sl_r + p[:, None]
                    tl.store(dst, logit, mask=vis)
                else:
                    probe = tl.maximum(probe, tl.where(vis, logit, float("-inf")))
            else:
                key = row_keys(logit, vis)
                take = key > tau[None, :]
                if SCAN:  # slots by an exclusive prefix count down the block's pools (ascending id)
                    t32 = take.to(tl.int32)
                    pos = cnt[None, :] + tl.cumsum(t32, axis=0) - t32
                    cnt += tl.sum(t32, axis=0)
                else:  # a slot per passing cell: one relaxed atomic each (no scan, no barrier per block)
                    pos = tl.atomic_add(crow[None, :] + tl.zeros((BP, BQ), tl.int32), 1, mask=take, sem="relaxed")
                tl.store(BufK + slot[None, :] + pos, key, mask=take)
                tl.store(BufI + slot[None, :] + pos, p[:, None] + tl.zeros((BP, BQ), tl.int32), mask=take)
        if not DENSE:  # every CHECK blocks: compact the buffers the next CHECK blocks could overflow
            tl.debug_barrier()
            if not SCAN:
                cnt = tl.load(crow, volatile=True)
            for i in tl.static_range(BQ):
                ci = tl.sum(tl.where(iq == i, cnt, 0))
                if ci > CAP - CHECK * BP:  # the next CHECK blocks could overflow it
                    si = (pid * BQ + i).to(tl.int64) * CAP
                    kept, t = _compact(BufK + si, BufI + si, ci, k, CAP)
                    if SCAN:
                        cnt = tl.where(iq == i, kept, cnt)
                    else:
                        tl.store(Cnt + pid * BQ + i, kept)
                    dropped = tl.where(iq == i, dropped + ci - kept, dropped)
                    tau = tl.where(iq == i, t, tau)
            tl.debug_barrier()
    if DENSE and not STORE:
        tl.store(Logits + rows.to(tl.int64) * sl_r, tl.max(probe, axis=0), mask=rok)
    if not DENSE:
        tl.debug_barrier()
        kofs = tl.arange(0, KP)
        if not SCAN:
            cnt = tl.load(crow, volatile=True)
        for i in tl.static_range(BQ):
            row = row0 + pid * BQ + i
            if row < row0 + nrows:
                ci = tl.sum(tl.where(iq == i, cnt, 0))
                si = (pid * BQ + i).to(tl.int64) * CAP
                n_sel = ci
                if ci > k:
                    n_sel, _t = _compact(BufK + si, BufI + si, ci, k, CAP)
                ids = tl.load(BufI + si + kofs, mask=kofs < n_sel, other=2147483647)
                ids = tl.sort(ids)  # ascending pool id; the unused slots (INT32_MAX) last
                val = tl.where(kofs < n_sel, ids + pool_base, -1)
                tl.store(Out + (row - row0).to(tl.int64) * so_r + kofs, val, mask=kofs < k)
                tl.store(Emitted + (row - row0), ci + tl.sum(tl.where(iq == i, dropped, 0)))


@triton.jit
def _dense_pairs_kernel(Q, sq_r, sq_h, W, sw_r, KV, KS, Starts, Ends, row0, nrows, Logits, sl_r, H: tl.constexpr,
                        D: tl.constexpr, BQ: tl.constexpr, BP: tl.constexpr, SCALED: tl.constexpr):  # fmt: skip
    # the dense mode with two blocks of BQ rows per program: each pool block is loaded once
    # for two dots (rows a = first .., b = first + BQ ..); every logit as _fused_kernel's
    first = row0 + tl.program_id(0) * (2 * BQ)
    end = row0 + nrows
    ra = first + tl.arange(0, BQ)
    rb = ra + BQ
    ksa = tl.load(Starts + ra, mask=ra < end, other=2147483647)
    kea = tl.load(Ends + ra, mask=ra < end, other=0)
    ksb = tl.load(Starts + rb, mask=rb < end, other=2147483647)
    keb = tl.load(Ends + rb, mask=rb < end, other=0)
    lo = tl.minimum(tl.min(ksa), tl.min(ksb))  # masked rows: [INT32_MAX, 0), empty
    hi = tl.maximum(tl.max(kea), tl.max(keb))
    qa, wa = _one_dot_operands(Q, sq_r, sq_h, W, sw_r, first, end, H, D, BQ)
    qb, wb = _one_dot_operands(Q, sq_r, sq_h, W, sw_r, first + BQ, end, H, D, BQ)
    d = tl.arange(0, D)
    bp = tl.arange(0, BP)
    p_start = (lo // BP) * BP
    if hi <= lo:
        p_start = hi
    for p0 in range(p_start, hi, BP):
        p = p0 + bp
        kv, scale = _pool_block(KV, KS, p, lo, hi, d, D, SCALED)
        la = _finish(_one_dot_chains(kv, qa, wa, BP, BQ, H), scale, BP, BQ, SCALED)
        va = (p[:, None] >= ksa[None, :]) & (p[:, None] < kea[None, :])
        tl.store(Logits + ra.to(tl.int64)[None, :] * sl_r + p[:, None], la, mask=va)
        lb = _finish(_one_dot_chains(kv, qb, wb, BP, BQ, H), scale, BP, BQ, SCALED)
        vb = (p[:, None] >= ksb[None, :]) & (p[:, None] < keb[None, :])
        tl.store(Logits + rb.to(tl.int64)[None, :] * sl_r + p[:, None], lb, mask=vb)
