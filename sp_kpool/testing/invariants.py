"""Invariant checks of an output (contract §4-5); each raises ``AssertionError`` with the row."""

from __future__ import annotations

import torch

from ..selection import output_width
from ..sharding import ShardedSequence

__all__ = ["check_invariants", "row_token_sets"]


def row_token_sets(out: torch.Tensor) -> list[frozenset[int]]:
    """Per row, the set of valid (``>= 0``) ids."""
    return [frozenset(v for v in row.tolist() if v >= 0) for row in out.cpu()]


def check_invariants(out: torch.Tensor, seq: ShardedSequence, *, topk: int, kpool: int, tail: str, alignment: int = 1):
    """Check every local row of ``out`` (``[S_local, W]`` int32) against contract §4-5.

    Counts (``min((j+1)//K, T//K) * K + (j+1) % K`` valid ids), ids inside
    ``[doc_start, t]``, no repeats, whole complete pools in the history, the tail exactly
    ``t - tail + 1 .. t`` at the right columns, ``-1`` after the valid ids of each region,
    and all ``-1`` for padding rows. Any layout: rows and ids are mapped from stream
    positions to real rows first (in real rows, row ``t`` of document ``[start, end)``).
    """
    width = output_width(topk, kpool, alignment)
    assert out.dtype == torch.int32, f"dtype {out.dtype}"
    assert tuple(out.shape) == (seq.shard_size, width), f"shape {tuple(out.shape)} != {(seq.shard_size, width)}"
    import bisect

    from .problems import to_document_positions

    cu = seq.real_cu_seq_lens.tolist()
    rows = to_document_positions(out.cpu(), seq).tolist()  # real rows (raises on an id of a padding token)
    real = seq.real_of_stream[seq.positions].tolist()
    for i, row in enumerate(rows):
        t = real[i]
        if t < 0:
            assert all(v == -1 for v in row), f"padding row {i} (stream {int(seq.positions[i])}) not all -1: {row}"
            continue
        doc = bisect.bisect_right(cu, t) - 1
        start = cu[doc]
        j = t - start
        n_hist = min((j + 1) // kpool, topk // kpool) * kpool
        n_tail = (j + 1) % kpool
        valid = [v for v in row if v >= 0]
        assert len(valid) == n_hist + n_tail, f"row {t}: {len(valid)} valid ids, expected {n_hist + n_tail}: {row}"
        assert len(set(valid)) == len(valid), f"row {t}: repeated ids {row}"
        assert all(start <= v <= t for v in valid), f"row {t}: id outside [{start}, {t}]: {row}"
        hist = row[:n_hist]
        assert all(v >= 0 for v in hist), f"row {t}: history not first: {row}"
        for p in range(0, n_hist, kpool):
            pool = hist[p : p + kpool]
            assert (pool[0] - start) % kpool == 0, f"row {t}: pool not aligned to its document: {pool}"
            assert pool == list(range(pool[0], pool[0] + kpool)), f"row {t}: pool not in slot order: {pool}"
            assert pool[-1] <= t - n_tail, f"row {t}: pool {pool} not complete before the tail"
        tail_col = topk if tail == "fixed" else n_hist
        want_tail = list(range(t - n_tail + 1, t + 1))
        assert row[tail_col : tail_col + n_tail] == want_tail, f"row {t}: tail {row[tail_col:tail_col + n_tail]} != {want_tail}"
        rest = row[n_hist:tail_col] + row[tail_col + n_tail :]
        assert all(v == -1 for v in rest), f"row {t}: stray ids outside the history and tail regions: {row}"
