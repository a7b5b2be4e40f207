"""FP8 scoring with DeepGEMM's per-logit arithmetic, fused with the exact Top-K (Triton); the
same kernel on BF16 queries and keys (the ``triton`` backend's scorer).

:func:`score_select` scores query rows against pools with the arithmetic of DeepGEMM's SM90
``fp8_mqa_logits`` (contract §6) and either stores the logits (``dense=True``: the bitwise
test vehicle) or never stores them and selects, per row, the ``k`` best visible pools by
the rule of :func:`sp_kpool.selectors.topk_pools` (higher score first, ties toward the
lower pool id, ``-0.0`` equal to ``+0.0``, NaN and ``-inf`` never selected), written in
ascending pool id with ``-1`` after.

**Per logit** (row ``i``, pool ``p``; ``a_h`` the FP8 tensor-core product of query head
``h`` and the pool over the 128 channels, as four chained ``k32`` steps of one ``tl.dot``;
``r_h = a_h`` if ``a_h > 0`` else ``0``, so NaN gives 0 as ``max.f32`` does; ``w_h`` the
folded FP32 head weight; ``s`` the pool's FP32 scale)::

    c_j   = fma(r_j, w_j, RN(r_{8+j} w_{8+j})), then c_j = fma(r_{8m+j}, w_{8m+j}, c_j),
            m = 2 .. H/8 - 1 in order                       (eight chains, j = 0..7)
    P_q   = RN(RN(c_{2q} + c_{2q+1}) * s)                    (q = 0..3)
    logit = RN(RN(P_0 + P_1) + RN(P_2 + P_3))

**BF16.** Given ``bfloat16`` queries and pools and no scales (``k_scale=None``), ``a_h`` is
the BF16 tensor-core product over the 128 channels (exact products, FP32 accumulation, in
the order of the instruction) and the formula runs without ``s``: ``P_q = RN(c_{2q} +
c_{2q+1})``, what a scale of 1.0 gives. The BF16 modes' score (contract §3) up to FP32
rounding, by a fixed order that depends on nothing but the row, the pool and the heads.

The heads of one chain step ``m`` of ``BQ`` rows are the ``N = 8 BQ`` columns of one
``tl.dot`` (``[BP, 128] x [128, N]``), so every step is one dot and no accumulator is split.
The kernel is compiled without FP contraction (``enable_fp_fusion=False``): every fused
multiply-add is an explicit ``tl.fma``. Whether these values equal DeepGEMM's bit for bit is
a property of the GPU's FP8 tensor-core instruction (the tests on a GPU check it, and that
the compiled kernel uses ``wgmma`` and no ``mma.sync``); on CPU (Triton's interpreter) the
same code checks the selection logic.

**Selection without stored logits.** One program owns ``BQ`` rows and streams their pools in
ascending id, in blocks of ``BP``. Per row it keeps a threshold key ``tau`` (the monotone
int32 key of :func:`sp_kpool.kernels.triton_topk_search.row_keys`) and appends every visible
cell whose key is ``> tau`` to a candidate buffer of ``cap`` entries (key and pool id). The
slot of a passing cell comes, by default, from one relaxed atomic per passing cell (the buffer
in no particular order; compaction needs no order); ``slots="scan"`` takes the row's count (in
registers) plus the cells passing before it in the block (a prefix count down the block's
pools) instead: no atomic, the buffer in ascending pool id. Every
``CHECK`` blocks (one barrier) a row holding more than ``cap - CHECK BP`` entries is
compacted: ``T`` = its ``k``-th largest buffered key; kept are the keys ``> T`` and, of the
keys ``== T``, the ones with the lowest pool ids, ``k`` in all: exactly the row's Top-K of
the pools seen so far; ``tau = T``. Exact because pools come in ascending id: a later cell
with key ``<= T`` ranks below ``k`` kept cells (equal keys lose to lower ids), and a dropped
cell ranks below ``k`` kept ones; ``tau`` only rises. After a compaction ``k`` entries
remain and ``cap >= k + CHECK BP``, so the buffer never overflows (no fallback is needed;
the launcher checks the bound). At the end a last compaction leaves the answer, sorted to
ascending pool id.

Imports Triton: import this module only where Triton is available.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_topk_search import row_keys

__all__ = ["score_select", "scores_probe", "supports", "capacity"]

#: Pools per block (the ``M`` of each dot; a multiple of 64 for wgmma).
BLOCK_P = 64

#: The last compiled kernel of each ``(H, block_q, block_p, dense, one_dot, query dtype)`` launched,
#: ``+ ("pairs",)`` for the two-block dense kernel (its ``asm`` holds the PTX the tests check for
#: ``wgmma`` and no ``mma.sync``).
compiled: dict = {}


#: Heads whose default launch is one ``[BP, 128] x [128, block_q H]`` dot per block (``one_dot``,
#: ``block_q`` = ``max(2, 128 / H)``; otherwise one dot per chain step of 4 rows). At H 128 on
#: an H200 (2026-12-04, W: 32768 rows x 32768 pools): dense mode 118.8 ms one dot per chain
#: step (255 registers, 142 spills), 31.3 ms one dot of 1 row, 30.7 ms of 2 rows; fused
#: (k 512) 166.1 / 60.9 / 48.5 ms; the three bit for bit equal.
ONE_DOT_HEADS = (32, 64, 128)

#: Blocks between two compaction checks (each check is one barrier).
CHECK = 8

#: How a passing cell gets its candidate slot by default (:func:`score_select`'s ``slots``). The
#: kernel alone on an H200 (2026-12-04, ``scripts/bench_fused.py``), "atomic" / "scan": W 26.7 /
#: 28.6 ms (H 32), 37.7 / 34.8 ms (H 64); 262144 tokens 88.7 / 94.7, 131.0 / 124.6 ms; 64 packed
#: documents 0.85 / 0.65, 1.16 / 0.74 ms. The default stays the one the whole-call GPU tests ran.
SLOTS = "atomic"


def capacity(k: int, block_p: int = BLOCK_P, check: int = CHECK) -> int:
    """Candidate entries per row: the power of two ``>= 2 k + check * block_p``. A check
    compacts a row holding more than ``cap - check * block_p`` to ``k``, so the ``check``
    blocks before the next one never overflow it."""
    return 1 << max(0, 2 * k + check * block_p - 1).bit_length()


def supports(heads: int, dim: int, k: int) -> list[str]:
    """Why :func:`score_select` cannot run this shape (empty: it can)."""
    why = []
    if heads not in (32, 64, 128):
        why.append(f"H = {heads} not in [32, 64, 128]")
    if dim != 128:
        why.append(f"D = {dim} != 128")
    if not 1 <= k <= 2048:
        why.append(f"k = {k} pools outside [1, 2048]")
    return why


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


def score_select(q8: torch.Tensor, w: torch.Tensor, k8: torch.Tensor, k_scale: torch.Tensor | None,
                 starts: torch.Tensor, ends: torch.Tensor, k: int, *, rows: tuple[int, int] | None = None,
                 pool_base: int = 0, dense: bool = False, fill: float | None = float("nan"),
                 out: torch.Tensor | None = None, block_q: int | None = None, block_p: int = BLOCK_P,
                 num_warps: int = 4, num_stages: int | None = None, one_dot: bool | None = None,
                 cap: int | None = None, check: int = CHECK, slots: str = SLOTS, pairs: bool = False):  # fmt: skip
    """Scores (``dense``) or selected pools of query rows against pools, DeepGEMM's arithmetic.

    Args:
        q8: ``[C, H, 128]`` ``float8_e4m3fn`` prepared queries; w: ``[C, H]`` float32 folded
            head weights; k8: ``[P, 128]`` ``float8_e4m3fn`` pools; k_scale: ``[P]`` float32.
            Or BF16: ``q8`` and ``k8`` ``bfloat16``, ``k_scale`` ``None`` (no pool scale).
        starts, ends: ``[C]`` int32, each row's visible pools ``[starts, ends)`` (of ``k8``).
        k: pools to select per row (``topk // kpool``, at most 2048).
        rows: the rows ``[a, b)`` to compute (default all ``C``).
        pool_base: added to the selected pool indices (global id of ``k8``'s row 0).
        dense: return the ``[b - a, P]`` float32 logits instead (cells outside each row's
            range are never written: they hold ``fill``, or anything with ``fill=None``).
        out: optional ``[b - a, k]`` int32 destination of the selection (written whole).
        block_q, block_p, num_warps, num_stages: launch shape (``block_q`` rows per program,
            default ``max(2, 128 / H)`` with ``one_dot``, else 4; ``block_p`` pools per block, a
            multiple of 64; ``num_stages`` default :data:`STAGES` of the input dtype).
        one_dot: one ``[block_p, 128] x [128, block_q H]`` dot per block (the default for the
            heads of :data:`ONE_DOT_HEADS`) or one ``[block_p, 128] x [128, 8 block_q]`` dot
            per chain step.
        cap, check: candidate entries per row (default :func:`capacity`) and blocks between
            two compaction checks (``cap >= k + check * block_p``).
        slots: how a passing cell gets its buffer slot (default :data:`SLOTS`): ``"scan"`` (a
            prefix count down the block's pools, the row counts in registers; the buffer in
            ascending pool id) or ``"atomic"`` (one relaxed atomic per passing cell). The same
            ids and counts either way.
        pairs: (``dense`` with ``one_dot``) two blocks of ``block_q`` rows per program, each
            pool block loaded once for both: the same logits bit for bit. On an H200
            (2026-12-04, W's 32768 rows x 32768 pools, stores included): FP8 H 32 9.18 against
            9.82 ms (1.10x / 1.18x DeepGEMM alone), H 64 16.41 against 17.63 ms (1.10x /
            1.18x); BF16 H 32 14.86 against 15.05 ms, H 64 30.0 against 27.8 ms, H 128 92 ms
            against 54 ms (255 registers, spills). Off by default: no default path scores FP8
            at H 32 / 64 with this kernel (DeepGEMM does), and BF16 gains nothing.

    Returns:
        ``dense``: logits ``[b - a, P]`` float32. Otherwise ``(pools, emitted)``: ``[b - a,
        k]`` int32 global pool ids ascending, ``-1`` after, and ``[b - a]`` int32, the cells
        each row appended to its candidate buffer (what the gate let through).
    """
    C, H, D = q8.shape
    one_dot, block_q = _shape("score_select", H, D, k, one_dot, block_q)
    default_stages = _stages(q8, k8, k_scale)  # (checks the dtypes, whether or not num_stages is given)
    num_stages = num_stages or default_stages
    q8, w, k8, k_scale, starts, ends = _unit_strides(q8, w, k8, k_scale, starts, ends)
    if slots not in ("scan", "atomic"):
        raise ValueError(f"slots: expected 'scan' or 'atomic', got {slots!r}")
    a, b = rows if rows is not None else (0, C)
    nr = b - a
    dev = q8.device
    P = k8.shape[0]
    cap = cap or capacity(k, block_p, check)
    grid = (max(1, triton.cdiv(nr, block_q)),)
    if pairs and not (dense and one_dot):
        raise ValueError(f"pairs: needs dense=True and one_dot, got dense={dense}, one_dot={one_dot}")
    if dense:
        shape = (C, max(P, 1))  # (the kernel writes row a + i at row a + i)
        logits = torch.empty(shape, dtype=torch.float32, device=dev) if fill is None else \
            torch.full(shape, fill, dtype=torch.float32, device=dev)  # fmt: skip
        if pairs:
            kernel = _dense_pairs_kernel[(max(1, triton.cdiv(nr, 2 * block_q)),)](
                q8, q8.stride(0), q8.stride(1), w, w.stride(0), k8, k8 if k_scale is None else k_scale, starts, ends,
                a, nr, logits, logits.stride(0), H=H, D=D, BQ=block_q, BP=block_p, SCALED=k_scale is not None,
                num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False,
            )  # fmt: skip
            compiled[(H, block_q, block_p, True, one_dot, q8.dtype, "pairs")] = kernel
            return logits[a:b]
        dummy = torch.empty(1, dtype=torch.int32, device=dev)
        _launch(grid, q8, w, k8, k_scale, starts, ends, a, nr, logits, dummy, dummy, dummy, dummy, dummy, k, pool_base,
                H, D, block_q, block_p, cap, 1, True, num_warps, num_stages, one_dot, check, True, True)  # fmt: skip
        return logits[a:b]
    if out is None:
        out = torch.empty((nr, k), dtype=torch.int32, device=dev)
    elif out.shape != (nr, k) or out.dtype != torch.int32 or out.stride(-1) != 1:
        raise ValueError(f"out: expected an int32 tensor of shape {(nr, k)} with unit column stride, got "
                         f"{out.dtype} {tuple(out.shape)}")  # fmt: skip
    n_buf = grid[0] * block_q  # candidate buffers (one per row of the launch grid)
    counts = torch.zeros(n_buf if slots == "atomic" else 1, dtype=torch.int32, device=dev)
    buf_k = torch.empty((n_buf, cap), dtype=torch.int32, device=dev)
    buf_i = torch.empty((n_buf, cap), dtype=torch.int32, device=dev)
    emitted = torch.empty(nr, dtype=torch.int32, device=dev)
    kp = 1 << max(0, k - 1).bit_length()
    _launch(grid, q8, w, k8, k_scale, starts, ends, a, nr, out, out, buf_k, buf_i, counts, emitted, k, pool_base, H, D,
            block_q, block_p, cap, kp, False, num_warps, num_stages, one_dot, check, slots == "scan", True)  # fmt: skip
    return out, emitted


def scores_probe(q8, w, k8, k_scale, starts, ends, **launch) -> torch.Tensor:
    """The dense mode **without its stores** (a benchmark probe: the scorer's own cost): per row the
    largest in-range logit (``[C]`` float32, ``-inf`` for an empty row; NaN logits may or may not
    propagate), one value stored per row. ``launch``: ``block_q``, ``block_p``, ``num_warps``,
    ``num_stages``, ``one_dot`` as :func:`score_select`."""
    C, H, D = q8.shape
    one_dot, block_q = _shape("scores_probe", H, D, 1, launch.get("one_dot"), launch.get("block_q"))
    default_stages = _stages(q8, k8, k_scale)  # (checks the dtypes)
    stages = launch.get("num_stages") or default_stages
    q8, w, k8, k_scale, starts, ends = _unit_strides(q8, w, k8, k_scale, starts, ends)
    block_p = launch.get("block_p", BLOCK_P)
    out = torch.empty((C, 1), dtype=torch.float32, device=q8.device)
    dummy = torch.empty(1, dtype=torch.int32, device=q8.device)
    _launch((max(1, triton.cdiv(C, block_q)),), q8, w, k8, k_scale, starts, ends, 0, C, out, dummy, dummy, dummy, dummy,
            dummy, 1, 0, H, D, block_q, block_p, capacity(1, block_p), 1, True, launch.get("num_warps", 4),
            stages, one_dot, CHECK, True, False)  # fmt: skip
    return out[:, 0]


#: Pipeline stages of the pool loads by input dtype. On an H200 (2026-12-04, W: 32768 rows x
#: 32768 pools, the dense mode): FP8 3 (the sweep of 7d34d18); BF16 at H 32 2 / 3 / 4 stages
#: 14.7 / 15.6 / 15.4 ms, at H 64 28.2 / 28.8 / 29.6 ms (8 warps, or 128-pool blocks: slower).
STAGES = {torch.float8_e4m3fn: 3, torch.bfloat16: 2}


def _stages(q8, k8, k_scale) -> int:
    """The default ``num_stages`` of the inputs' dtype, the dtypes checked (whether or not
    the caller gives ``num_stages``): FP8 queries and pools with float32 scales, or BF16
    queries and pools without."""
    fp8 = (q8.dtype == torch.float8_e4m3fn and k8.dtype == torch.float8_e4m3fn and k_scale is not None
           and k_scale.dtype == torch.float32)  # fmt: skip
    bf16 = q8.dtype == torch.bfloat16 and k8.dtype == torch.bfloat16 and k_scale is None
    if not (fp8 or bf16):
        raise ValueError(f"q8, k8, k_scale: expected float8_e4m3fn queries and pools with float32 scales, or bfloat16 "
                         f"ones and k_scale=None, got {q8.dtype}, {k8.dtype}, "
                         f"{None if k_scale is None else k_scale.dtype}")  # fmt: skip
    return STAGES[q8.dtype]


def _unit_strides(q8, w, k8, k_scale, starts, ends):
    """The kernel's operands laid out as it reads them (a copy only where they are not):
    ``q8 [C, H, D]`` and ``w [C, H]`` with unit stride along the last dim (any row and head
    strides), ``k8 [P, D]`` row-contiguous, ``k_scale``, ``starts``, ``ends`` contiguous."""
    q8 = q8 if q8.stride(-1) == 1 else q8.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    k8 = k8 if k8.is_contiguous() else k8.contiguous()
    k_scale = k_scale if k_scale is None else k_scale.contiguous()
    return q8, w, k8, k_scale, starts.contiguous(), ends.contiguous()


def _shape(caller: str, H: int, D: int, k: int, one_dot: bool | None, block_q: int | None) -> tuple[bool, int]:
    """``(one_dot, block_q)`` of a launch (the defaults where ``None``), checked."""
    why = supports(H, D, k)
    if why:
        raise ValueError(f"{caller}: {'; '.join(why)}")
    one_dot = H in ONE_DOT_HEADS if one_dot is None else one_dot
    block_q = block_q or (max(2, 128 // H) if one_dot else 4)
    if one_dot and block_q * H < 128:
        raise ValueError(f"one_dot: needs block_q * H >= 128, got H = {H}, block_q = {block_q}")
    if not one_dot and block_q < 4:  # N = 8 block_q < 32: Triton may pick mma.sync, not wgmma (measured at N 8)
        raise ValueError(f"block_q: expected at least 4 with one_dot=False, got {block_q}")
    return one_dot, block_q


def _launch(grid, q8, w, k8, k_scale, starts, ends, a, nr, logits, out, buf_k, buf_i, counts, emitted, k, pool_base, H,
            D, block_q, block_p, cap, kp, dense, num_warps, num_stages, one_dot, check, scan, store):  # fmt: skip
    if cap < k + check * block_p:
        raise ValueError(f"cap: expected at least k + check * block_p = {k + check * block_p}, got {cap}")
    kernel = _fused_kernel[grid](
        q8, q8.stride(0), q8.stride(1), w, w.stride(0), k8, k8 if k_scale is None else k_scale, starts, ends, a, nr,
        logits, logits.stride(0), out, out.stride(0), buf_k, buf_i, counts, emitted, k, pool_base,
        H=H, D=D, BQ=block_q, BP=block_p, CAP=cap, KP=kp, DENSE=dense, ONE_DOT=one_dot, CHECK=check, SCAN=scan,
        STORE=store, SCALED=k_scale is not None, num_warps=num_warps, num_stages=num_stages,
        enable_fp_fusion=False,
    )  # fmt: skip
    if store:  # (not the stores-free probe)
        compiled[(H, block_q, block_p, dense, one_dot, q8.dtype)] = kernel
