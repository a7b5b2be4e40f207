"""Row tables of the training path: what each real row may use, and its candidates.

All host arithmetic on the global ``cu_seq_lens`` (int64 CPU), the same on every rank.
Real row ``t`` (document ``d``, document position ``j``) sees the complete pools
``[vis_lo[t], vis_hi[t]) = [off[d], off[d] + (j + 1) // K)`` of its own document.

Candidates ``C_t`` (``docs/contract.md`` section 13): **dense**, every visible pool;
**sparse**, the complete pools among the row's selected ids (:func:`sparse_candidates`),
tail ids excluded, sorted by pool id (so the loss does not depend on the column order of
the ids: ``ascending``, ``score``, serving's or a replay's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..pooling import pool_table

__all__ = ["RowTables", "row_tables", "sparse_candidates", "SparseCandidates"]


@dataclass(frozen=True)
class RowTables:
    """Per real row (``[N]`` int64 CPU): ``doc``, document position ``pos``, visible pools
    ``vis_lo``/``vis_hi``; per token ``tok_pool`` (its complete pool, ``-1``: none); per pool
    ``pool_tok_start`` and ``pool_doc``; ``rows_with_pool``: real rows with a visible
    complete pool, ``sum_d max(0, len_d - K + 1)``."""

    kpool: int
    doc: torch.Tensor
    pos: torch.Tensor
    vis_lo: torch.Tensor
    vis_hi: torch.Tensor
    tok_pool: torch.Tensor
    pool_tok_start: torch.Tensor
    pool_doc: torch.Tensor
    rows_with_pool: int

    @property
    def num_pools(self) -> int:
        return int(self.pool_tok_start.numel())


def row_tables(real_cu_seq_lens: torch.Tensor, kpool: int) -> RowTables:
    """The :class:`RowTables` of the real documents ``real_cu_seq_lens`` (``[docs + 1]``)."""
    cu = real_cu_seq_lens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    n = int(cu[-1])
    pts, off = pool_table(cu, kpool)
    doc = torch.repeat_interleave(torch.arange(lengths.numel()), lengths, output_size=n)
    pos = torch.arange(n) - cu[:-1][doc]
    vis_lo = off[:-1][doc]
    vis_hi = vis_lo + (pos + 1) // kpool
    tok_pool = torch.full((n,), -1, dtype=torch.int64)
    if pts.numel():
        tok_pool[(pts[:, None] + torch.arange(kpool)).flatten()] = torch.arange(pts.numel()).repeat_interleave(kpool)
    pool_doc = doc[pts] if pts.numel() else pts
    rows = int((lengths - kpool + 1).clamp(min=0).sum())
    return RowTables(kpool, doc, pos, vis_lo, vis_hi, tok_pool, pts, pool_doc, rows)


@dataclass(frozen=True)
class SparseCandidates:
    """Sparse candidates of some real rows: ``pools [n, slots]`` int64 (ascending, ``-1``
    after), and for every selected column of those rows its candidate slot ``col_slot
    [n, width]`` int64 (``-1``: a ``-1`` column or a tail id; a candidate's ``K`` columns
    share its slot; ``None`` when not asked for)."""

    pools: torch.Tensor
    col_slot: torch.Tensor


def sparse_candidates(ids: torch.Tensor, rows: torch.Tensor, tables: RowTables, slots: int, *,
                      name: str = "selection", block: int = 1024, columns: bool = True) -> SparseCandidates:  # fmt: skip
    """The complete pools among the selected ids of real rows ``rows``.

    Args:
        ids: ``[n, width]`` int64 CPU: real-token ids (``-1`` unused) of the rows ``rows``
            (``[n]`` int64 real rows).
        slots: the most candidates a row may have (``topk // K``).
        block: rows handled at once (bounds the scratch: a few ``[block, width]`` int64).
        columns: also map every column to its candidate slot (``col_slot``, what a
            :class:`~sp_kpool.training.teachers.TokenMass` needs; else ``None``).

    One sort per row of its visible pools: a row's ids are valid when, sorted, its visible
    pools come in runs of exactly ``K`` (the candidate ``j`` is then the run at ``[jK, (j + 1)K)``).
    Raises ``ValueError`` naming ``name``, the row and the id when an id is neither in a
    complete pool the row can see nor in its tail, when a pool appears with other than
    ``K`` of its ids (or an id twice), or a row has more than ``slots`` pools.
    """
    n, width = ids.shape
    pools = torch.full((n, slots), -1, dtype=torch.int64)
    col_slot = torch.full((n, width), -1, dtype=torch.int64) if columns else None
    for a in range(0, n, block):
        b = min(n, a + block)
        got, cols = _candidates_block(ids[a:b], rows[a:b], tables, slots, name, columns)
        pools[a:b] = got
        if columns:
            col_slot[a:b] = cols
    return SparseCandidates(pools, col_slot)


def _candidates_block(ids, rows, tables: RowTables, slots: int, name: str, columns: bool):
    K = tables.kpool
    n, width = ids.shape
    N = tables.doc.numel()
    if bool((ids >= N).any()):
        r, c = (int(v) for v in torch.nonzero(ids >= N)[0])
        raise ValueError(f"{name}: row {int(rows[r])} (real row) column {c} holds id {int(ids[r, c])}, "
                         f"expected -1 or a real token id < {N}")  # fmt: skip
    valid = ids >= 0
    pool = torch.where(valid, tables.tok_pool[ids.clamp(min=0)], -1)
    lo, hi = tables.vis_lo[rows][:, None], tables.vis_hi[rows][:, None]
    visible = (pool >= lo) & (pool < hi)  # a complete pool of the row's document ending at or before it
    other = valid & ~visible
    if bool(other.any()):  # the tail, or an id the row cannot select
        r_i, c_i = torch.nonzero(other, as_tuple=True)
        t, x = rows[r_i], ids[r_i, c_i]
        tail = (tables.doc[x] == tables.doc[t]) & (x <= t) & (x > t - (tables.pos[t] + 1) % K)
        if not bool(tail.all()):
            i = int(torch.nonzero(~tail)[0])
            raise ValueError(f"{name}: row {int(t[i])} (real row) column {int(c_i[i])} holds id {int(x[i])}, which "
                             f"that row cannot select: expected a token of a complete pool of its document ending "
                             f"at or before it, or of its tail, or -1")  # fmt: skip
    big = torch.iinfo(torch.int64).max
    pad = (-width) % K
    key = torch.where(visible, pool, big)
    if pad:
        key = torch.cat([key, key.new_full((n, pad), big)], dim=1)
    srt, order = torch.sort(key, dim=1, stable=True)
    groups = srt.view(n, -1, K)
    head = groups[:, :, 0]
    used = head != big
    whole = (groups == head[:, :, None]).all(dim=2)
    distinct = torch.ones_like(used)
    distinct[:, 1:] = head[:, 1:] != head[:, :-1]
    bad = used & ~(whole & distinct)
    if bool(bad.any()):
        r, j = (int(v) for v in torch.nonzero(bad)[0])
        p = int(head[r, j]) if not bool(whole[r, j]) or bool(distinct[r, j]) else int(head[r, j - 1])
        count = int((key[r] == p).sum())
        raise ValueError(f"{name}: row {int(rows[r])} (real row) holds {count} ids of pool {p} "
                         f"(tokens {int(tables.pool_tok_start[p])}..{int(tables.pool_tok_start[p]) + K - 1}), "
                         f"expected all {K} ids of a selected pool, once each")  # fmt: skip
    per_row = used.sum(dim=1)
    if n and int(per_row.max()) > slots:
        r = int(per_row.argmax())
        raise ValueError(f"{name}: row {int(rows[r])} (real row) selects {int(per_row[r])} pools, expected at most "
                         f"topk // kpool = {slots}")  # fmt: skip
    m = min(slots, head.shape[1])
    pools = torch.full((n, slots), -1, dtype=torch.int64)
    pools[:, :m] = torch.where(used[:, :m], head[:, :m], -1)
    if not columns:
        return pools, None
    slot_of = (torch.arange(key.shape[1]) // K)[None].expand(n, -1)
    col = torch.full((n, key.shape[1]), -1, dtype=torch.int64)
    col.scatter_(1, order, torch.where(srt != big, slot_of, -1))
    return pools, col[:, :width]
