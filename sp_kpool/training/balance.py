"""``balance="causal"`` for the training path: rows computed where the work is even.

The partition is :mod:`sp_kpool.balance`'s (boundaries on the training's global chunk grid,
declined on every rank alike when it would not lower the largest rank's work), with the
training's work model per real row: its candidates (dense: its visible pools; sparse: at
most ``topk // K`` of them) plus the per-row constant. Each row's data (its queries, head
weights, candidates and teacher rows) moves from its owner to the rank that computes it
(:func:`to_computers`), and its unit gradients come back (:func:`to_owners`), point to
point. A row's values do not depend on the rank that computes it (the global grid), so the
balance changes no bit.
"""

from __future__ import annotations

import torch

from .._device import to_device
from ..balance import CausalPartition, _partition
from ..comm import exchange_rows, pack_rows, unpack_rows
from ..config import ROW_COST

__all__ = ["training_partition", "to_computers", "to_owners"]


def training_partition(seq, tables, chunk: int, dense: bool, slots: int) -> CausalPartition:
    """The partition of ``seq``'s real rows by the training's work (the same on every rank)."""
    vis = tables.vis_hi - tables.vis_lo
    per_row = (vis if dense else vis.clamp(max=slots)) + ROW_COST
    prefix = torch.zeros(per_row.numel() + 1, dtype=torch.int64)
    torch.cumsum(per_row, 0, out=prefix[1:])
    owned = None
    if not seq.is_contiguous:
        owned = tuple(int(per_row[seq.real_rows(r)].sum()) for r in range(seq.world_size))
    return _partition(prefix, seq.world_size, seq.shard_size, chunk, ROW_COST, owned)


def _within(rows: torch.Tensor, lo: int, hi: int) -> tuple[int, int]:
    i0, i1 = torch.searchsorted(rows, torch.tensor([lo, hi], dtype=rows.dtype)).tolist()
    return i0, i1


def to_computers(seq, ranges, data: list[torch.Tensor], *, timeout: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``data`` (tensors aligned with this rank's real rows, ascending) moved to the ranks
    that compute them (``ranges``: per rank ``(lo, hi)`` real rows). Returns the rows
    computed here (``[lo, hi)``) and their data, in row order."""
    me, W = seq.rank, seq.world_size
    mine = seq.real_rows()
    buf, layout = pack_rows(data)
    lo, hi = ranges[me]
    sends, recvs = {}, {}
    for peer in range(W):
        if peer == me:
            continue
        i0, i1 = _within(mine, *ranges[peer])
        if i1 > i0:
            sends[peer] = buf[i0:i1]
        j0, j1 = _within(seq.real_rows(peer), lo, hi)
        if j1 > j0:
            recvs[peer] = (j1 - j0, buf.shape[1])
    got = exchange_rows(sends, recvs, seq, dtype=torch.uint8, device=buf.device, tag="train_balance_rows",
                        timeout=timeout)  # fmt: skip
    out = buf.new_empty((hi - lo, buf.shape[1]))
    for peer in range(W):
        rows = seq.real_rows(peer)
        j0, j1 = _within(rows, lo, hi)
        if j1 > j0:
            part = buf[j0:j1] if peer == me else got[peer]
            out.index_copy_(0, to_device(rows[j0:j1] - lo, out.device), part)
    return torch.arange(lo, hi), unpack_rows(out, layout)


def to_owners(seq, ranges, data: list[torch.Tensor], *, timeout: float) -> list[torch.Tensor]:
    """The reverse of :func:`to_computers`: ``data`` aligned with the rows computed here
    (``[lo, hi)`` of ``ranges[rank]``) returned to their owners; aligned with this rank's
    real rows (ascending)."""
    me, W = seq.rank, seq.world_size
    mine = seq.real_rows()
    buf, layout = pack_rows(data)
    lo, hi = ranges[me]
    sends, recvs = {}, {}
    for peer in range(W):
        if peer == me:
            continue
        rows = seq.real_rows(peer)
        j0, j1 = _within(rows, lo, hi)
        if j1 > j0:
            sends[peer] = buf.index_select(0, to_device(rows[j0:j1] - lo, buf.device))
        i0, i1 = _within(mine, *ranges[peer])
        if i1 > i0:
            recvs[peer] = (i1 - i0, buf.shape[1])
    got = exchange_rows(sends, recvs, seq, dtype=torch.uint8, device=buf.device, tag="train_balance_grads",
                        timeout=timeout)  # fmt: skip
    out = buf.new_empty((mine.numel(), buf.shape[1]))
    for peer in range(W):
        i0, i1 = _within(mine, *ranges[peer])
        if i1 <= i0:
            continue
        if peer == me:
            out[i0:i1] = buf.index_select(0, to_device(mine[i0:i1] - lo, buf.device))
        else:
            out[i0:i1] = got[peer]
    return unpack_rows(out, layout)
