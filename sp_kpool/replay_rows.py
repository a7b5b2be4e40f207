"""Capture rows of :mod:`sp_kpool.replay`: reading the per-document captures, validating
their rows and selecting each row's pools (``docs/contract.md`` §12; the rules are listed
in :mod:`sp_kpool.replay`'s docstring).

:func:`select_rows` is the lean path every replayed row takes: at most one sort of the
captured values (the pools: of the capture itself; the tokens: of the rows whose history is
not laid out in whole consecutive pools, none in a ``kpool_topk``-shaped capture, which is
collapsed to pools without a sort) plus a few passes in int32. It only says *which* rows
are bad; :func:`_first_problem` then names the first problem of the first bad row (one row,
any cost), so the error texts do not depend on the fast path.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .sharding import ShardedSequence

# per-entry validation codes, in the order a row's problems are reported
_OK, _NEGATIVE, _NOT_CAUSAL, _DUPLICATE, _PARTIAL_POOL, _TOO_MANY = range(6)
_BIG = torch.iinfo(torch.int64).max
_BIG32 = torch.iinfo(torch.int32).max
_NARROW = 1 << 15
#: up to this K, tail duplicates are counted per tail value (K - 1 passes), past it sorted
_TAIL_PASSES = 8
#: scratch bytes per captured entry of a chunk in :func:`select_rows` (the int32 values, the
#: sort's int32 values and int64 indices, a few bool and int32 masks); the caller bounds a
#: chunk's entries so that ``entries * SCRATCH_BYTES_PER_ENTRY`` stays under its budget
SCRATCH_BYTES_PER_ENTRY = 32


class ReplayError(ValueError):
    """A capture that cannot be replayed (the message names the document, row, column and value)."""


# --------------------------------------------------------------------------- capture access


def _as_capture(d: int, a: Any) -> torch.Tensor:
    """Document ``d``'s capture as a 2-D integer tensor (NumPy arrays are wrapped, not copied)."""
    if type(a).__module__ == "numpy" and hasattr(a, "dtype"):
        if a.dtype.kind not in "iu":
            raise TypeError(f"captured[{d}]: expected an integer array, got dtype {a.dtype}")
        wide = a.dtype.kind == "u" and a.dtype.itemsize > 1  # torch has few ops on uint16..uint64
        a = torch.from_numpy(a.astype("int64" if wide else a.dtype.newbyteorder("="), copy=False))
    if not isinstance(a, torch.Tensor):
        raise TypeError(f"captured[{d}]: expected a 2-D integer tensor or NumPy array [T_doc, width], "
                        f"got {type(a).__name__}")  # fmt: skip
    if a.dtype.is_floating_point or a.dtype.is_complex or a.dtype == torch.bool:
        raise TypeError(f"captured[{d}]: expected an integer dtype, got {a.dtype}")
    if a.dim() != 2:
        raise ValueError(f"captured[{d}]: expected a 2-D array [T_doc, width], got shape {list(a.shape)}")
    if a.dtype in (torch.uint16, torch.uint32, torch.uint64):
        a = a.to(torch.int64)
    return a


def _captures(captured: Any, seq: ShardedSequence) -> list[torch.Tensor]:
    """The per-document captures, checked against the real documents of ``seq``."""
    if isinstance(captured, torch.Tensor) or not isinstance(captured, (list, tuple)):
        raise TypeError(f"captured: expected a list of [T_doc, width] integer arrays, one per real document, "
                        f"got {type(captured).__name__}")  # fmt: skip
    cu = seq.real_cu_seq_lens.tolist()
    n_docs = len(cu) - 1
    if len(captured) != n_docs:
        raise ValueError(f"captured: expected {n_docs} arrays (one per real document of seq), got {len(captured)}")
    out = []
    for d, a in enumerate(captured):
        t = _as_capture(d, a)
        length = cu[d + 1] - cu[d]
        if t.shape[0] > length:
            raise ValueError(f"captured[{d}]: expected at most {length} rows (the document's length), "
                             f"got {t.shape[0]}")  # fmt: skip
        out.append(t)
    return out


def narrow_dtype(captures: Sequence[torch.Tensor]) -> torch.dtype:
    """The dtype :func:`captured_rows` reads pool-id captures into: ``int16`` when every
    capture is 8- or 16-bit signed or 8-bit unsigned (no copy widens them: the passes and the
    sort run on half the bytes), else ``int32``."""
    narrow = (torch.int8, torch.uint8, torch.int16)
    return torch.int16 if captures and all(c.dtype in narrow for c in captures) else torch.int32


def captured_rows(captures: Sequence[torch.Tensor], cu: torch.Tensor, rows: torch.Tensor, device,
                  width: int | None = None, dtype: torch.dtype = torch.int32) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The captured rows of real rows ``rows`` (ascending int64 CPU; ``cu`` the real documents'
    boundaries): ``(values [R, W], covered [R] bool)`` on ``device``, ``W`` the widest
    capture (or ``width``), ``-1`` past a document's width and in rows the capture does not
    cover. ``dtype``: ``int32``, or ``int16`` where every capture fits it
    (:func:`narrow_dtype`)."""
    if width is None:
        width = max((int(c.shape[1]) for c in captures), default=0)
    R = rows.numel()
    vals = torch.empty((R, width), dtype=dtype, device=device)  # every entry written below
    covered = torch.zeros(R, dtype=torch.bool)
    if R == 0:
        return vals, covered.to(device)

    def put(dst: torch.Tensor, x: torch.Tensor) -> None:  # int64 values saturate (and then fail validation)
        if x.dtype == torch.int64:
            x = x.to(device).clamp(-2, _BIG32 - 1)
        dst[:, : x.shape[1]].copy_(x)  # int32 and narrower: converted by the copy
        dst[:, x.shape[1] :].fill_(-1)

    doc = torch.searchsorted(cu, rows, right=True) - 1
    d_lo, d_hi = int(doc[0]), int(doc[-1]) + 1
    bounds = torch.searchsorted(doc, torch.arange(d_lo, d_hi + 1), right=False).tolist()
    for d in range(d_lo, d_hi):
        a, b = bounds[d - d_lo], bounds[d - d_lo + 1]
        if a == b:
            continue
        cap = captures[d]
        j = rows[a:b] - cu[d]
        n = int(cap.shape[0])
        if int(j[-1]) < n:  # every row covered
            j0 = int(j[0])
            if int(j[-1]) - j0 + 1 == b - a:  # consecutive rows: read them in place
                put(vals[a:b], cap[j0 : j0 + b - a])
            else:
                put(vals[a:b], cap.index_select(0, j.to(cap.device)))
            covered[a:b] = True
            continue
        vals[a:b].fill_(-1)
        sel = torch.nonzero(j < n).flatten()
        if sel.numel():
            rows_sel = torch.full((sel.numel(), width), -1, dtype=dtype, device=device)
            put(rows_sel, cap.index_select(0, j[sel].to(cap.device)))
            vals[a + sel.to(device)] = rows_sel
            covered[a + sel] = True
    return vals, covered.to(device)


def _sorted_live(v: torch.Tensor, limit: torch.Tensor):
    """``v`` with invalid entries (``< 0`` or ``>= limit``) as a large value, sorted per row:
    ``(sorted [r, W] int32, perm [r, W] int64, live-and-sorted mask)``."""
    live = (v >= 0) & (v < limit[:, None])
    s, perm = torch.sort(torch.where(live, v, _BIG32), dim=1, stable=True)
    return s, perm, s != _BIG32


def _sort_unused_last(v: torch.Tensor) -> torch.return_types.sort:
    """``v [r, W]`` int32 sorted per row with ``-1`` (and any negative value) after every
    id ``>= 0``: one sort of the unsigned view, no key pass. ``.values`` is int32."""
    s = torch.sort(v.view(torch.uint32), dim=1)
    return torch.return_types.sort((s.values.view(torch.int32), s.indices))


def _compact(cols: torch.Tensor, width: int) -> torch.Tensor:
    """The ids ``>= 0`` of each row of ``cols [r, C]`` int32 in column order, ``-1`` after
    them, ``[r, width]`` (``width`` at least each row's count)."""
    r, C = cols.shape
    out = cols[:, :width] if C >= width else torch.cat([cols, cols.new_full((r, width - C), -1)], 1)
    if C > 1:
        used = cols >= 0
        gap = (used[:, 1:] & ~used[:, :-1]).any(1)  # an unused column before a used one
        if bool(gap.any()):
            g = torch.nonzero(gap).flatten()
            keep = torch.sort((~used[g]).to(torch.int8), dim=1, stable=True).indices
            out = out.clone()
            out[g] = _pad(cols[g].gather(1, keep), width)
    return out.contiguous()


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    r, C = x.shape
    return x[:, :width] if C >= width else torch.cat([x, x.new_full((r, width - C), -1)], 1)


def _select_pools(v: torch.Tensor, n_vis: torch.Tensor, topk: int, kpool: int, capture_order: bool, k_sel: int):
    """Pool-id rows ``v [r, W]`` int32 or int16 (``-1`` unused): ``(bad [r] bool, pools
    [r, k_sel] int32)``, each row's pools ascending or in column order, ``-1`` after them."""
    r, W = v.shape
    if W == 0:  # nothing captured: no problem, no pool
        return torch.zeros(r, dtype=torch.bool, device=v.device), v.new_full((r, k_sel), -1)
    lo, hi = torch.aminmax(v, dim=1)
    bad = (lo < -1) | (hi >= n_vis)
    if int(n_vis.max()) < _NARROW:  # ids fit int16: sorted as uint16, -1 (0xFFFF) last (a row with
        # an id out of int16's range, or below -1, is bad whatever its sort gives)
        s = torch.sort(v.to(torch.int16).view(torch.uint16), dim=1).values.view(torch.int16)
    else:
        s = _sort_unused_last(v).values  # ids ascending, then -1
    unused = (v == -1).sum(1, dtype=torch.int32)
    if W > 1:  # an id twice: more equal neighbours than the -1s make among themselves
        bad |= (s[:, 1:] == s[:, :-1]).sum(1, dtype=torch.int32) > (unused - 1).clamp_min(0)
    bad |= W - unused > topk // kpool
    pools = _compact(v, k_sel) if capture_order else _pad(s, k_sel)
    return bad, pools.to(torch.int32).contiguous()


def _select_tokens(v: torch.Tensor, j: torch.Tensor, n_vis: torch.Tensor, topk: int, kpool: int,
                   capture_order: bool, k_sel: int):  # fmt: skip
    """Token-position rows ``v [r, W]`` int32: ``(bad [r] bool, pools [r, k_sel] int32)``.

    Collapsed to pools first: a row whose history ids fill whole consecutive blocks of ``K``
    columns ``[p K, p K + 1, .., p K + K - 1]`` (``kpool_topk``'s own layout) gives pool ``p``
    per block without a sort; the other rows sort their ids (whole pools are then ``K``
    consecutive sorted ids starting at a multiple of ``K``). Tail ids (``>= n K``, at most
    ``K - 1`` of them) are checked for duplicates on their own."""
    r, W = v.shape
    K = kpool
    Wb = W // K
    hist_end = n_vis * K
    lo, hi = torch.aminmax(v, dim=1)
    bad = (lo < -1) | (hi > j)  # below -1, or after the row
    below = (v < hist_end[:, None]).sum(1, dtype=torch.int32)  # history ids and -1s
    unused = (v == -1).sum(1, dtype=torch.int32)
    n_hist = below - unused
    n_tail = W - below
    pools = v.new_full((r, Wb), -1)
    regular = torch.zeros(r, dtype=torch.bool, device=v.device)
    if Wb:
        blocks = v.as_strided((r, Wb, K), (v.stride(0), K, 1))
        first = blocks[:, :, 0]
        pool_block = (first >= 0) & (first < hist_end[:, None])
        if K > 1:
            pool_block &= first % K == 0
            pool_block &= (blocks == first[:, :, None] + torch.arange(K, device=v.device, dtype=v.dtype)).all(2)
        pools = torch.where(pool_block, torch.div(first, K, rounding_mode="floor"), -1)
        regular = pool_block.sum(1, dtype=torch.int32) * K == n_hist  # no history id outside whole pool blocks
    else:
        regular = n_hist == 0
    irregular = torch.nonzero(~regular & ~bad).flatten()
    if irregular.numel():
        sub = v.index_select(0, irregular)
        s, perm = _sort_unused_last(sub)
        u = unused[irregular]
        bad_sub = torch.zeros_like(u, dtype=torch.bool)
        if W > 1:  # an id twice
            bad_sub |= (s[:, 1:] == s[:, :-1]).sum(1, dtype=torch.int32) > (u - 1).clamp_min(0)
        h = n_hist[irregular]
        bad_sub |= h % K != 0
        sub_pools = v.new_full((irregular.numel(), Wb), -1)
        if Wb:
            sb = s.as_strided((s.shape[0], Wb, K), (s.stride(0), K, 1))
            f = sb[:, :, 0]
            whole = (f % K == 0) & (sb[:, :, K - 1] == f + (K - 1))
            in_hist = torch.arange(Wb, device=v.device)[None] < (h // K)[:, None]
            bad_sub |= (in_hist & ~whole).any(1)
            sub_pools = torch.where(in_hist, torch.div(f, K, rounding_mode="floor"), -1)
            if capture_order:  # each pool's first captured column: its ids are consecutive in sorted order
                pb = perm.as_strided((perm.shape[0], Wb, K), (perm.stride(0), K, 1))
                first_col = torch.where(in_hist, pb.amin(2), _BIG)
                sub_pools = sub_pools.gather(1, torch.sort(first_col, dim=1, stable=True).indices)
        bad[irregular] |= bad_sub
        pools[irregular] = sub_pools
    with_tail = torch.nonzero((n_tail > 1) & ~bad).flatten()
    if with_tail.numel():  # two tail ids alike (history ids never equal tail ids)
        sub = v.index_select(0, with_tail)
        tail0 = hist_end[with_tail, None]
        if K <= _TAIL_PASSES:  # a tail id is one of K - 1 values: count each
            twice = torch.zeros(with_tail.numel(), dtype=torch.bool, device=v.device)
            for c in range(K - 1):
                twice |= (sub == tail0 + c).sum(1, dtype=torch.int32) > 1
        else:
            s = _sort_unused_last(torch.where(sub >= tail0, sub, -1)).values
            pos = torch.arange(W - 1, device=v.device)[None]
            twice = ((s[:, 1:] == s[:, :-1]) & (pos < (n_tail[with_tail] - 1)[:, None])).any(1)
        bad[with_tail] |= twice
    # the pools: duplicates, their number, the order (of regular rows: their column order)
    bad_p, out = _select_pools(pools, n_vis, topk, kpool, capture_order, min(k_sel, max(Wb, 1)))
    return bad | bad_p, _pad(out, k_sel).contiguous()


def select_rows(v: torch.Tensor, j: torch.Tensor, kpool: int, topk: int, pools: bool, capture_order: bool,
                k_sel: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Validate the captured rows ``v [r, W]`` int32 (``j [r]`` their document-local
    positions) and select: ``(bad [r] bool, pools [r, k_sel] int32)``: the rows breaking a
    rule (:func:`_first_problem` names the problem) and, for the others, the row's
    document-local pools ascending or, with ``capture_order``, in the order of each pool's
    first captured column, ``-1`` after them (a bad row's pools are meaningless)."""
    if v.shape[1] == 0:  # nothing captured: no problem, no pool
        return torch.zeros(v.shape[0], dtype=torch.bool, device=v.device), v.new_full((v.shape[0], k_sel), -1)
    j32 = j.to(torch.int32)
    n_vis = torch.div(j32 + 1, kpool, rounding_mode="floor")
    v = v.contiguous()
    if pools:
        return _select_pools(v, n_vis, topk, kpool, capture_order, k_sel)
    return _select_tokens(v, j32, n_vis, topk, kpool, capture_order, k_sel)



def _first_problem(v: torch.Tensor, j: torch.Tensor, kpool: int, topk: int, pools: bool) -> tuple[int, int]:
    """``(code, column)`` of the first problem of one bad captured row ``v [W]`` int32 (the
    lowest code, then the lowest column)."""
    W = v.numel()
    v, j = v[None], j.reshape(1)
    n_vis = (j + 1) // kpool
    limit = n_vis if pools else j + 1
    code = torch.zeros((1, W), dtype=torch.int64, device=v.device)
    code.masked_fill_(v < -1, _NEGATIVE)
    code.masked_fill_(v >= limit[:, None], _NOT_CAUSAL)
    s, perm, ok = _sorted_live(v, limit)
    dup = torch.zeros_like(ok)
    if W > 1:
        dup[:, 1:] = (s[:, 1:] == s[:, :-1]) & ok[:, 1:]
    hist = ok & ~dup
    if not pools:
        hist &= s < (n_vis * kpool)[:, None]
    partial = torch.zeros_like(ok)
    if not pools and kpool > 1:
        slot = torch.where(hist, s % kpool, 0)
        pos = torch.arange(W, device=v.device)[None]
        lo, hi, base = pos - slot, pos - slot + kpool - 1, s - slot
        whole = (lo >= 0) & (s.gather(1, lo.clamp(0, W - 1)) == base)
        whole &= (hi < W) & (s.gather(1, hi.clamp(0, W - 1)) == base + kpool - 1)
        partial = hist & ~whole
    start = hist & ~partial & ((s % kpool == 0) if not pools else torch.ones_like(hist))
    too_many = start & (torch.cumsum(start.to(torch.int64), dim=1) > topk // kpool)
    in_sorted = torch.zeros_like(code)
    in_sorted.masked_fill_(too_many, _TOO_MANY).masked_fill_(partial, _PARTIAL_POOL).masked_fill_(dup, _DUPLICATE)
    code = torch.where(code > 0, code, torch.zeros_like(code).scatter_(1, perm, in_sorted))[0].tolist()
    c = min(x for x in code if x > 0)
    return c, code.index(c)


def _reason(code: int, value: int, j: int, length: int, kpool: int, topk: int, pools: bool, d: int) -> str:
    if code == _NEGATIVE:
        return f"expected a {'pool id' if pools else 'token position'} >= 0 (inside the document) or -1 (unused)"
    if code == _NOT_CAUSAL:
        if pools:
            n = (j + 1) // kpool
            where = "outside the document" if value >= length // kpool else "not causal"
            return (f"{where}: expected a complete pool ending at or before the row, pool ids < (j + 1) // K = {n} "
                    f"(document {d} has {length // kpool} pools)")  # fmt: skip
        if value >= length:
            return f"outside document {d} of {length} tokens (expected a position <= {j}, the row)"
        return f"after the row (not causal): expected a position <= {j}"
    if code == _DUPLICATE:
        return "selected twice in the row"
    if code == _PARTIAL_POOL:
        p = value // kpool
        return (f"pool {p} (positions {p * kpool}..{p * kpool + kpool - 1}) is not whole: history ids must come in "
                f"whole pools of K = {kpool}")  # fmt: skip
    return f"more than topk // K = {topk // kpool} history pools in the row"


