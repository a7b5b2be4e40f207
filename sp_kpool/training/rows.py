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
    share its slot)."""

    pools: torch.Tensor
    col_slot: torch.Tensor


def sparse_candidates(ids: torch.Tensor, rows: torch.Tensor, tables: RowTables, slots: int, *,
                      name: str = "selection") -> SparseCandidates:  # fmt: skip
    """The complete pools among the selected ids of real rows ``rows``.

    Args:
        ids: ``[n, width]`` int64 CPU: real-token ids (``-1`` unused) of the rows ``rows``
            (``[n]`` int64 real rows).
        slots: the most candidates a row may have (``topk // K``).

    Raises ``ValueError`` naming ``name``, the row and the id when an id is neither in a
    complete pool the row can see nor in its tail, when a pool appears with other than
    ``K`` of its ids (or an id twice), or a row has more than ``slots`` pools.
    """
    K = tables.kpool
    n, width = ids.shape
    N = tables.doc.numel()
    valid = ids >= 0
    if bool((ids >= N).any()):
        r, c = (int(v) for v in torch.nonzero(ids >= N)[0])
        raise ValueError(f"{name}: row {int(rows[r])} (real row) column {c} holds id {int(ids[r, c])}, "
                         f"expected -1 or a real token id < {N}")  # fmt: skip
    x = ids.clamp(min=0)
    t = rows[:, None].expand(n, width)
    pool = tables.tok_pool[x]
    ok_pool = pool >= 0
    pool_c = pool.clamp(min=0)
    same_doc = tables.doc[x] == tables.doc[t]
    visible = valid & ok_pool & same_doc & (tables.pool_tok_start[pool_c] + K - 1 <= t) if tables.num_pools else valid & False
    tail_lo = t - (tables.pos[t] + 1) % K + 1
    tail = valid & same_doc & (x <= t) & (x >= tail_lo) & ~visible
    bad = valid & ~visible & ~tail
    if bool(bad.any()):
        r, c = (int(v) for v in torch.nonzero(bad)[0])
        raise ValueError(f"{name}: row {int(rows[r])} (real row) column {c} holds id {int(ids[r, c])}, which that row "
                         f"cannot select: expected a token of a complete pool of its document ending at or before "
                         f"it, or of its tail, or -1")  # fmt: skip
    P = max(tables.num_pools, 1)
    key = torch.where(visible, torch.arange(n)[:, None] * P + pool_c, torch.full_like(pool_c, -1))
    flat = key[visible]
    uniq, inverse, counts = torch.unique(flat, return_inverse=True, return_counts=True)
    if bool((counts != K).any()):
        i = int(torch.nonzero(counts != K)[0])
        r, p = divmod(int(uniq[i]), P)
        raise ValueError(f"{name}: row {int(rows[r])} (real row) holds {int(counts[i])} ids of pool {p} "
                         f"(tokens {int(tables.pool_tok_start[p])}..{int(tables.pool_tok_start[p]) + K - 1}), "
                         f"expected all {K} ids of a selected pool, once each")  # fmt: skip
    row_of = uniq // P
    per_row = torch.bincount(row_of, minlength=n)
    if n and int(per_row.max()) > slots:
        r = int(per_row.argmax())
        raise ValueError(f"{name}: row {int(rows[r])} (real row) selects {int(per_row[r])} pools, expected at most "
                         f"topk // kpool = {slots}")  # fmt: skip
    first = torch.cumsum(per_row, 0) - per_row
    slot = torch.arange(uniq.numel()) - first[row_of]  # uniq is sorted: ascending pools within a row
    pools = torch.full((n, slots), -1, dtype=torch.int64)
    pools[row_of, slot] = uniq % P
    col_slot = torch.full((n, width), -1, dtype=torch.int64)
    col_slot[visible] = slot[inverse]
    return SparseCandidates(pools, col_slot)
