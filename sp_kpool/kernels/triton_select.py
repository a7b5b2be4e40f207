"""Exact, deterministic Top-K selection and expansion on the GPU (Triton).

:func:`topk_ascending` selects, in every row of an FP32 score matrix, the ``k`` best
visible columns by the rule of :func:`sp_kpool.selection.topk_pools` (higher score first,
ties toward the lower column, ``-0.0`` equal to ``+0.0``) and writes them in **ascending
column order**, ``-1`` after. No host synchronisation, no per-row fix-up pass.

Per row (a persistent grid: program ``p`` takes rows ``p, p + P, ...`` and reuses a small
scratch area in global memory, which stays in L2):

1. Keys: the FP32 bits mapped to a monotone int32; cells outside ``[start, end)`` or at
   ``-inf`` or NaN get ``INT32_MIN`` (invisible). One pass over the row stores the maxima
   of groups of ``G`` aligned adjacent columns (``G`` = 8 up to 65528 columns, then 16, 32,
   ...) and counts the visible cells.
2. ``L``: a value with at least ``k`` and at most ``capg`` group maxima ``>= L`` (bisection
   over the maxima in registers, stopped early). At least ``k`` keys are ``>= L``, so the
   ``k``-th best key ``T`` is ``>= L``, and every cell of the answer lies in a group with
   maximum ``>= L``. Those groups' ids are compacted in column order.
3. Those groups' cells (read again, mostly from L2) hold the answer: ``T`` by bisection
   (stopped as soon as exactly ``k`` keys are at or above it), then the keys above ``T`` and the first keys equal to ``T`` in column order,
   written in column order.
   If more than ``capg`` groups qualify (long runs of exactly equal scores), the exact
   ``T`` comes from bisection over the whole row, and a last pass writes the answer.

Prefix counts use a scan over group sums plus a scan inside each group: one long scan
over a tile is slow in Triton (a barrier per register chunk).

Rows with at most ``k`` visible cells select all of them. :func:`expand_pools` turns
selected pools into token ids, adds the tail and writes either column layout.

Imports Triton: import this module only where Triton is available.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["topk_ascending", "expand_pools", "supports", "MAX_K"]

#: Largest ``k`` handled by :func:`topk_ascending` (checked on an H200 up to 2048; larger ``k``
#: selects with the other CUDA paths of :func:`sp_kpool.selection.select_pools`).
MAX_K = 2048
_MAX_GROUPS = 8192


#: Largest block of candidate cells (candidate groups x columns per group): the largest run
#: on an H200 (k 2048, groups of 8). Larger blocks spill registers (Triton caps any block at
#: 2**20 elements); such shapes select with the other paths of ``select_pools``.
_MAX_BLOCK = 32768


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _sizes(W: int, k: int, tile: int, capg: int | None):
    """``(tile, group, ng, capg)`` of a launch for rows of width ``W``."""
    tile = min(tile, _pow2(max(W + 8, 16)))
    span = -(-(max(W, 1) + 8) // tile) * tile  # columns a row's tiles may cover
    group = max(8, min(tile // 8, _pow2(-(-span // _MAX_GROUPS))))
    ng = max(_pow2(span // group), group)
    return tile, group, ng, _pow2(capg or 2 * k)


def supports(width: int, k: int) -> bool:
    """Whether :func:`topk_ascending` handles rows of ``width`` columns and this ``k`` (at
    the default launch): ``1 <= k <= MAX_K`` and ``2k`` candidate groups of ``G`` columns
    within a block of 32768 cells (``k`` 512: up to 262136 columns; ``k`` 2048: up to 65528)."""
    if not 1 <= k <= MAX_K:
        return False
    _, group, _, capg = _sizes(width, k, 8192, None)
    return capg * group <= _MAX_BLOCK


@triton.jit
def row_keys(s, ok):
    i = s.to(tl.int32, bitcast=True)
    key = tl.where(i >= 0, i, i ^ 0x7FFFFFFF)  # monotone in the float value
    key = tl.where(i == -2147483648, 0, key)  # -0.0 ties +0.0
    ok = ok & (s > float("-inf"))
    return tl.where(ok, key, -2147483648)


@triton.jit
def load_keys(srow, cols, a, e):
    inb = (cols >= a) & (cols < e)
    s = tl.load(srow + cols, mask=inb, other=float("-inf"))
    return row_keys(s, inb)


@triton.jit
def kth_largest(vals, k, lo, stop):
    """Bisection for ``x >= lo`` with ``count(vals >= x) >= k``, stopping as soon as that
    count is ``<= stop`` (``stop = k``: the exact ``k``-th largest value, or a value with
    exactly ``k`` values at or above it). The caller guarantees ``count(vals >= lo) >= k``
    or accepts ``lo``."""
    lo = lo.to(tl.int64)
    hi = tl.max(vals).to(tl.int64) + 1
    cnt_lo = tl.sum((vals >= lo.to(tl.int32)).to(tl.int32))
    for _ in range(32):
        if (hi - lo > 1) & (cnt_lo > stop):
            mid = lo + (hi - lo) // 2
            cnt = tl.sum((vals >= mid.to(tl.int32)).to(tl.int32))
            up = cnt >= k
            lo = tl.where(up, mid, lo)
            cnt_lo = tl.where(up, cnt, cnt_lo)
            hi = tl.where(up, hi, mid)
    return lo.to(tl.int32)


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
                  PHASES: tl.constexpr):
    # PHASES < 4 stops after that phase (timing of the phases only; the output is wrong)
    MINK: tl.constexpr = -2147483648
    NB: tl.constexpr = TILE // G
    pid = tl.program_id(0)
    gbase = Gmax + pid.to(tl.int64) * NG
    cbase = Cand + pid.to(tl.int64) * CAPG
    tb = tl.arange(0, NB)
    tg = tl.arange(0, G)
    gb = tl.arange(0, NG // G)
    cg = tl.arange(0, CAPG)
    kofs = tl.arange(0, KP)
    for row in range(pid, R, nprog):
        a = tl.load(starts_ptr + row)
        e = tl.load(ends_ptr + row)
        pbase = tl.load(base_ptr + row)
        a0 = (a // G) * G  # groups of G columns aligned to multiples of G (vector loads)
        srow = S + tl.cast(row, tl.int64) * stride_s
        orow = Out + tl.cast(row, tl.int64) * stride_o
        tl.debug_barrier()  # the previous row is done with the scratch
        # 1. maxima of the groups of G columns, and the visible count
        nvis = tl.full((), 0, tl.int32)
        for t0 in range(a0, e, TILE):
            key = load_keys(srow, t0 + tb[:, None] * G + tg[None, :], a, e)
            nvis += tl.sum((key > MINK).to(tl.int32))
            tl.store(gbase + (t0 - a0) // G + tb, tl.max(key, axis=1))
        ngroups = tl.cdiv(e - a0, G)
        use_groups = tl.full((), 0, tl.int32)
        thr = tl.full((), MINK, tl.int32)  # stream mode: keys > thr, then the first `need` equal to thr
        need = tl.full((), 0, tl.int32)
        low = tl.full((), MINK + 1, tl.int32)
        nc = tl.full((), 0, tl.int32)
        if (nvis > k) & (PHASES >= 2):
            tl.debug_barrier()
            gi = gb[:, None] * G + tg[None, :]  # group ids as [NG / G, G]
            gm = tl.load(gbase + gi, mask=gi < ngroups, other=MINK)
            # 2. L = k-th largest group maximum: >= k keys are >= L, and every key of the
            # answer lies in a group whose maximum is >= L
            # (any lower bound with at most CAPG groups at or above it will do)
            low = tl.maximum(kth_largest(gm, k, tl.full((), MINK, tl.int32), CAPG), MINK + 1)
            # 3. those groups, in column order
            if PHASES >= 3:
                f = (gm >= low).to(tl.int32)
                pos = positions(f) - 1
                tl.store(cbase + pos, gi, mask=(f == 1) & (pos < CAPG))
                nc = tl.sum(f)
            if (nc <= CAPG) | (PHASES < 4):
                use_groups = tl.full((), 1, tl.int32)
            else:
                # many equal group maxima: the exact k-th key by bisection over the row
                lo = low.to(tl.int64)  # count(key >= low) >= k
                hi = tl.full((), 2147483648, tl.int64)
                for _ in range(32):
                    mid = lo + (hi - lo) // 2
                    cnt = tl.full((), 0, tl.int32)
                    for t0 in range(a0, e, TILE):
                        key = load_keys(srow, t0 + tb[:, None] * G + tg[None, :], a, e)
                        cnt += tl.sum((key >= mid.to(tl.int32)).to(tl.int32))
                    lo = tl.where(cnt >= k, mid, lo)
                    hi = tl.where(cnt >= k, hi, mid)
                thr = lo.to(tl.int32)
                above = 0
                for t0 in range(a0, e, TILE):
                    key = load_keys(srow, t0 + tb[:, None] * G + tg[None, :], a, e)
                    above += tl.sum((key > thr).to(tl.int32))
                need = k - above
        nsel = tl.minimum(nvis, k)
        if PHASES >= 4:
            if use_groups == 1:
                # 4. the exact k-th key T among the keys of those groups; then the keys above
                # T and the first keys equal to T, in column order (ties toward lower column)
                tl.debug_barrier()
                gid = tl.load(cbase + cg, mask=cg < nc, other=0)
                cols = a0 + gid[:, None] * G + tg[None, :]
                key = load_keys(srow, cols, a, e)
                key = tl.where((cg < nc)[:, None], key, MINK)
                t = kth_largest(key, k, low, k)
                above = tl.sum((key > t).to(tl.int32))
                eq = (key == t).to(tl.int32)
                sel = (key > t) | ((eq == 1) & (positions(eq) <= k - above))
                pos = positions(sel.to(tl.int32)) - 1
                tl.store(orow + pos, (pbase + cols).to(tl.int32), mask=sel)
            else:
                n_out = 0
                n_eq = 0
                for t0 in range(a0, e, TILE):
                    cols = t0 + tb[:, None] * G + tg[None, :]
                    key = load_keys(srow, cols, a, e)
                    eq = (key == thr).to(tl.int32)
                    sel = (key > thr) | ((eq == 1) & (n_eq + positions(eq) <= need))
                    si = sel.to(tl.int32)
                    pos = n_out + positions(si) - 1
                    tl.store(orow + pos, (pbase + cols).to(tl.int32), mask=sel)
                    n_out += tl.sum(si)
                    n_eq += tl.sum(eq)
        tl.store(orow + kofs, tl.full((KP,), -1, tl.int32), mask=(kofs >= nsel) & (kofs < k))


@triton.jit
def expand_kernel(P, stride_p, pts_ptr, rows_ptr, tail_ptr, Out, stride_o, k, topk,
                  K: tl.constexpr, KS: tl.constexpr, KP: tl.constexpr, KT: tl.constexpr, COMPACT: tl.constexpr):
    row = tl.program_id(0)
    pi = tl.arange(0, KP)
    p = tl.load(P + row.to(tl.int64) * stride_p + pi, mask=pi < k, other=-1)
    valid = p >= 0
    first = tl.load(pts_ptr + tl.where(valid, p, 0), mask=valid, other=0).to(tl.int32)
    slots = tl.arange(0, KS)
    orow = Out + tl.cast(row, tl.int64) * stride_o
    tok = first[:, None] + slots[None, :]
    cols = pi[:, None] * K + slots[None, :]
    tl.store(orow + cols, tok, mask=valid[:, None] & (slots[None, :] < K))
    if K > 1:
        t = tl.load(rows_ptr + row)
        tlen = tl.load(tail_ptr + row)
        ti = tl.arange(0, KT)
        ok = ti < tlen
        ids = (t - tlen + 1 + ti).to(tl.int32)
        if COMPACT:
            n_hist = tl.sum(valid.to(tl.int32), axis=0) * K
            tl.store(orow + n_hist + ti, ids, mask=ok)
        else:
            tl.store(orow + topk + ti, ids, mask=ok)



def _programs(device: torch.device, rows: int) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(rows, 2 * sms))
    return max(1, min(rows, 4))


def topk_ascending(
    scores: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    base: torch.Tensor,
    k: int,
    *,
    tile: int = 8192,
    num_warps: int = 16,
    programs: int | None = None,
    capg: int | None = None,
    phases: int = 4,
) -> torch.Tensor:
    """The exact Top-K of each row, in ascending column order.

    Args:
        scores: ``[R, W]`` float32 (unit column stride); cells outside ``[starts[r],
            ends[r])`` are ignored, ``-inf`` cells are invisible.
        starts, ends: ``[R]`` integer, the columns of each row to consider.
        base: ``[R]`` int64, global pool id of column 0 of each row.
        k: pools to select (``1 <= k <= MAX_K``).
        tile, num_warps, programs: launch configuration (columns per step, warps per
            program, programs of the persistent grid; default 2 per SM: the fastest of
            the configurations timed on an H200 by ``scripts/bench_select.py``).
        capg: capacity in candidate groups (a power of two >= k; default ``2k``); rows
            with more take the slow exact path (tests use a small one).
        phases: ``< 4`` stops after that phase, for timing the phases (wrong output).

    Returns:
        ``[R, k]`` int32 global pool ids ``base[r] + column``, ascending, ``-1`` after the
        ``min(k, visible)`` selected ones. The same ids as
        :func:`sp_kpool.selection.topk_pools`, for any input (ties included).
    """
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores: expected a 2-D float32 tensor, got {tuple(scores.shape)} {scores.dtype}")
    if not 1 <= k <= MAX_K:
        raise ValueError(f"k: expected 1 <= k <= {MAX_K}, got {k}")
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    R, W = scores.shape
    dev = scores.device
    out = torch.empty((R, k), dtype=torch.int32, device=dev)
    if R == 0:
        return out
    tile, group, ng, capg = _sizes(W, k, tile, capg)
    if capg < k:
        raise ValueError(f"capg: expected at least k = {k}, got {capg}")
    if capg * group > _MAX_BLOCK:
        raise ValueError(
            f"scores: rows of {W} columns with k = {k} need {capg} x {group} candidate cells, "
            f"more than {_MAX_BLOCK} (see supports())"
        )
    progs = programs or _programs(dev, R)
    gmax = torch.empty((progs, ng), dtype=torch.int32, device=dev)
    cand = torch.empty((progs, capg), dtype=torch.int32, device=dev)
    select_kernel[(progs,)](
        scores, scores.stride(0), starts.to(device=dev, dtype=torch.int32).contiguous(),
        ends.to(device=dev, dtype=torch.int32).contiguous(), base.to(device=dev, dtype=torch.int64).contiguous(),
        out, out.stride(0), gmax, cand, R, k, progs,
        TILE=tile, G=group, NG=ng, CAPG=capg, KP=_pow2(k), PHASES=phases, num_warps=num_warps,
    )  # fmt: skip
    return out


def expand_pools(
    pools: torch.Tensor,
    pool_tok_start: torch.Tensor,
    rows: torch.Tensor,
    tail_len: torch.Tensor,
    out: torch.Tensor,
    *,
    topk: int,
    kpool: int,
    tail: str,
) -> torch.Tensor:
    """Token ids and tail into ``out`` (``[R, width]`` int32, **filled with -1** by the caller).

    ``pools``: ``[R, k]`` int32/int64 global pool ids, valid ones first, ``-1`` after (any
    order among the valid ones is kept); ``pool_tok_start``: ``[P]`` int64; ``rows``,
    ``tail_len``: ``[R]`` int64 (global token id and tail length of each row). Writes the
    layout of :func:`sp_kpool.selection.assemble` and returns ``out``.
    """
    R, k = pools.shape
    if R == 0:
        return out
    pools = pools.contiguous()
    expand_kernel[(R,)](
        pools, pools.stride(0), pool_tok_start.contiguous(), rows.contiguous(), tail_len.contiguous(),
        out, out.stride(0), k, topk,
        K=kpool, KS=_pow2(kpool), KP=_pow2(k), KT=_pow2(max(1, kpool - 1)), COMPACT=tail == "compact",
        num_warps=4,
    )  # fmt: skip
    return out
