"""The layouts' index maps of a ``ShardedSequence``: stream positions, real rows, ranks.

The **stream** is the user's documents with the padding documents the layout adds; the
**real rows** are the real documents packed without padding (what a world-size-1
contiguous call on the same documents sees); a rank holds its rows in **storage order**
(its ``positions``). :class:`RowMaps`, a base of :class:`~sp_kpool.sharding.ShardedSequence`,
holds every table between them (CPU int64, each computed once per sequence): real rows of
stream positions and back (:meth:`~RowMaps.real_ids`, :meth:`~RowMaps.stream_ids`), the real
rows a rank owns and where it stores them (:meth:`~RowMaps.real_rows`,
:meth:`~RowMaps.storage_index`), the owner of every real row, its place in an all-gather
of the ranks' rows, and the layout's digest. Pure: no communication.
"""

from __future__ import annotations

import functools
import zlib

import torch

__all__ = ["RowMaps", "row_runs"]


def row_runs(rows: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """The maximal ``(lo, hi)`` runs of consecutive values of ``rows`` (ascending int64 CPU)."""
    if rows.numel() == 0:
        return ()
    cut = torch.nonzero(rows[1:] != rows[:-1] + 1).flatten() + 1
    starts = torch.cat([rows.new_zeros(1), cut]).tolist()
    ends = torch.cat([cut, rows.new_tensor([rows.numel()])]).tolist()
    r = rows.tolist()
    return tuple((r[a], r[b - 1] + 1) for a, b in zip(starts, ends))


class RowMaps:
    """The stream <-> real-row <-> rank tables of a sequence (a base of
    :class:`~sp_kpool.sharding.ShardedSequence`, whose fields they read: ``cu_seq_lens``,
    ``padding_docs``, ``rank_positions``, ``rank``, ``world_size``, ``total_length``,
    ``num_real_tokens``, ``positions``)."""

    @functools.cached_property
    def real_cu_seq_lens(self) -> torch.Tensor:
        """``[num_real_docs + 1]`` int64 CPU: the real documents packed without padding."""
        if not self.padding_docs:
            return self.cu_seq_lens
        lens = self.cu_seq_lens[1:] - self.cu_seq_lens[:-1]
        keep = torch.ones(lens.numel(), dtype=torch.bool)
        keep[list(self.padding_docs)] = False
        return torch.cat([lens.new_zeros(1), torch.cumsum(lens[keep], 0)])

    @functools.cached_property
    def stream_shift(self) -> torch.Tensor | None:
        """``[num_real_docs]`` int64 CPU: stream position minus real row of each real
        document's tokens (the padding before it), or ``None`` when all are zero."""
        if not self.padding_docs or self.padding_docs == (self.cu_seq_lens.numel() - 2,):
            return None  # no padding, or only at the end
        n_docs = self.cu_seq_lens.numel() - 1
        real = [d for d in range(n_docs) if d not in set(self.padding_docs)]
        return self.cu_seq_lens[real] - self.real_cu_seq_lens[:-1]

    @functools.cached_property
    def real_of_stream(self) -> torch.Tensor:
        """``[S]`` int64 CPU: the real row of every stream position (``-1``: padding)."""
        S = self.total_length
        out = torch.full((S,), -1, dtype=torch.int64)
        cu, rcu = self.cu_seq_lens.tolist(), self.real_cu_seq_lens.tolist()
        pad, i = set(self.padding_docs), 0
        for d in range(len(cu) - 1):
            if d in pad:
                continue
            out[cu[d] : cu[d + 1]] = torch.arange(rcu[i], rcu[i + 1])
            i += 1
        return out

    def stream_ids(self, real_ids: torch.Tensor) -> torch.Tensor:
        """Stream positions of real rows ``real_ids`` (any shape, any device; ``-1`` kept)."""
        shift = self.stream_shift
        if shift is None:
            return real_ids
        dev = real_ids.device
        rcu = self.real_cu_seq_lens[1:].to(dev)
        ids = real_ids.to(torch.int64)
        doc = torch.searchsorted(rcu, ids.clamp(min=0), right=True).clamp_(max=shift.numel() - 1)
        return torch.where(ids >= 0, ids + shift.to(dev)[doc], ids).to(real_ids.dtype)

    def real_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Real rows of stream positions ``ids`` (any shape, any device; ``-1`` kept): the
        inverse of :meth:`stream_ids`. ``ValueError`` if an id is a padding position."""
        if self.stream_shift is None:  # real rows = stream positions; the padding is at the end
            if ids.numel() and int(ids.max()) >= self.num_real_tokens:
                raise ValueError("ids: a stream position of a padding token")
            return ids
        table = self.real_of_stream.to(ids.device)
        flat = ids.to(torch.int64)
        out = torch.where(flat >= 0, table[flat.clamp(min=0)], flat)
        if bool(((flat >= 0) & (out < 0)).any()):
            raise ValueError("ids: a stream position of a padding token")
        return out.to(ids.dtype)

    @functools.cached_property
    def _ownership(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Per rank: its real rows sorted (int64 CPU) and the storage index of each."""
        rows, order = [], []
        for p in self.rank_positions:
            real = self.real_of_stream[p]
            keep = torch.nonzero(real >= 0).flatten()
            srt = torch.argsort(real[keep])
            rows.append(real[keep][srt])
            order.append(keep[srt])
        return tuple(rows), tuple(order)

    def real_rows(self, rank: int | None = None) -> torch.Tensor:
        """Real rows owned by ``rank`` (this rank by default), ascending, int64 CPU."""
        return self._ownership[0][self.rank if rank is None else rank]

    def storage_index(self, rank: int | None = None) -> torch.Tensor:
        """Storage index of each of :meth:`real_rows`' rows on ``rank``, int64 CPU."""
        return self._ownership[1][self.rank if rank is None else rank]

    @functools.cached_property
    def padding_rows(self) -> torch.Tensor:
        """``[S_local]`` bool CPU: which of this rank's rows (storage order) are padding.
        The operator never reads them and returns them all ``-1``; what they hold does not
        matter (:meth:`local_rows` fills them)."""
        return self.real_of_stream[self.positions] < 0

    @functools.cached_property
    def owner_of_real(self) -> torch.Tensor:
        """``[N]`` int64 CPU: the rank that owns each real row."""
        out = torch.empty(self.num_real_tokens, dtype=torch.int64)
        for r in range(self.world_size):
            out[self.real_rows(r)] = r
        return out

    @functools.cached_property
    def storage_of_real(self) -> torch.Tensor:
        """``[N]`` int64 CPU: each real row's storage index on the rank that owns it."""
        out = torch.empty(self.num_real_tokens, dtype=torch.int64)
        for r in range(self.world_size):
            out[self.real_rows(r)] = self.storage_index(r)
        return out

    @functools.cached_property
    def gathered_index(self) -> torch.Tensor:
        """``[N]`` int64 CPU: for each real row, its row in the concatenation of every rank's
        rows in rank order (what an all-gather of the ranks' rows returns)."""
        out = torch.empty(self.num_real_tokens, dtype=torch.int64)
        base = 0
        for r, p in enumerate(self.rank_positions):
            out[self.real_rows(r)] = base + self.storage_index(r)
            base += p.numel()
        return out

    @functools.cached_property
    def runs(self) -> tuple[tuple[int, int], ...]:
        """This rank's real rows as maximal ``(lo, hi)`` runs, ascending."""
        return row_runs(self.real_rows())

    @functools.cached_property
    def layout_crc(self) -> int:
        """CRC-32 of every rank's positions (equal on ranks that agree on the layout)."""
        crc = 0
        for p in self.rank_positions:
            crc = zlib.crc32(p.numpy().tobytes(), zlib.crc32(str(p.numel()).encode(), crc))
        return crc
