"""The chunk plan: which query rows are scored together, against which pools.

Query rows are scored in chunks of ``C`` rows on a grid aligned to **global** row ids, and
every chunk is scored against the pool range of the whole global chunk; rows a rank does
not compute are zero rows with empty pool ranges (kernels skip them). ``C`` depends only
on global quantities (heads, pools, real length, the logits budget, the backend), so a
given row is always computed by the same kernel call shape at the same position,
whichever rank computes it: that is what makes every sharding bitwise equal to world
size 1::

    C = 4, real rows 0..13, this rank computes rows [5, 11)
    grid        [0 1 2 3] [4 5 6 7] [8 9 10 11] [12 13]
    chunks      .         [- 5 6 7] [8 9 10 -]           (- : zero row, empty range)
    pool range  of chunk [4, 8): the pools visible to rows 4..7 of the global sequence

A backend whose score cells do not depend on the call's rows
(:attr:`~sp_kpool.backends.base.Backend.row_local_scores`: ``deepgemm``, ``triton``) needs
no common grid: the pipeline plans each span of its rows on a grid of its own
(``plan_chunks(row_local=True)``: :func:`local_chunks`, equal chunks of at most ``C`` rows
from the span's first row), and its chunks are scored from views of its rows, without
zero rows (:attr:`ChunkPlan.row_local`).

This module is the only place the grid is computed: the pipeline (:mod:`sp_kpool.pipeline`)
and the parity replay both iterate :attr:`ChunkPlan.chunks`.

Tables. A plan carries its tables on the device: the real documents' boundaries, their
first pools, each chunk's pool range, the pool table (first token of every pool), each
row's ``[start, end)`` within its chunk's pool range and each row's causal metadata. They
are built with one host-to-device copy that does not make the host wait for the device
(:func:`sp_kpool._device.to_device`), and cached in the per-batch object of the
:class:`~sp_kpool.sharding.ShardedSequence` they belong to (``seq.batch``, a
:class:`~sp_kpool.batch.BatchCache`; its ``plans`` section, also ``seq.tables``): build
the sequence once per batch and pass it to every layer, and every layer after the first
skips this host work (about 0.3-0.6 ms of host time per call on an H200 host), and that of
the spans (:func:`rank_spans`) too. The cache lives and dies with its sequence;
``Settings.table_cache = False`` (``SP_KPOOL_TABLE_CACHE=0``) turns it off.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from . import _device
from ._device import to_device
from ._probe import probe
from .batch import TableCache
from .pooling import extend_pools
from .selection import RowMeta, row_meta

__all__ = ["Chunk", "ChunkPlan", "TableCache", "Span", "plan_chunks", "row_spans", "rank_spans", "grid_span",
           "local_chunks", "pad_rows", "row_ranges_torch", "plan_rows"]  # fmt: skip


def grid_span(C: int, lo_row: int, hi_row: int, origin: int = 0) -> tuple[int, int]:
    """``(first, end)``: the global rows that the chunks of ``C`` rows holding ``[lo_row,
    hi_row)`` cover (``first <= lo_row``, ``end >= hi_row``, multiples of ``C`` apart), on
    the grid of chunks starting at ``origin + j * C`` (``origin <= lo_row``)."""
    if hi_row <= lo_row:
        return lo_row, lo_row
    first = origin + ((lo_row - origin) // C) * C
    return first, first + -(-(hi_row - first) // C) * C


def pad_rows(x: torch.Tensor, before: int, after: int) -> torch.Tensor:
    """``x`` with ``before`` zero rows in front and ``after`` behind (dim 0), in one host
    call: how a partial chunk's rows are laid on the chunk grid."""
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (before, after))


@dataclass(frozen=True)
class Span:
    """Real rows ``[lo, hi)`` scored in one plan. ``rows_here`` (int64 CPU, ascending, within
    the span) and ``runs`` (their ``(lo, hi)`` runs) are the rows computed here when not all
    are (``None``: all); the others are zero rows with empty pool ranges, like the rows of
    a partial chunk."""

    lo: int
    hi: int
    rows_here: torch.Tensor | None = None
    runs: tuple[tuple[int, int], ...] | None = None

    @property
    def rows(self) -> int:
        """Rows computed here."""
        return self.hi - self.lo if self.rows_here is None else self.rows_here.numel()

    def lay(self, x: torch.Tensor) -> torch.Tensor:
        """The computed rows ``x [rows, ...]`` laid on the span ``[hi - lo, ...]``, zero rows
        between them."""
        if self.rows_here is None:
            return x
        out = x.new_zeros((self.hi - self.lo, *x.shape[1:]))
        return out.index_copy_(0, to_device(self.rows_here - self.lo, x.device), x)

    def pick(self, y: torch.Tensor) -> torch.Tensor:
        """The computed rows of ``y [hi - lo, ...]``."""
        if self.rows_here is None:
            return y
        return y.index_select(0, to_device(self.rows_here - self.lo, y.device))


def row_spans(runs, C: int, rows: torch.Tensor | None = None) -> list[Span]:
    """The :class:`Span` s of the ascending ``(lo, hi)`` runs of real rows ``rows``: runs
    whose chunks of ``C`` rows touch or meet share a span (no chunk is scored twice, and
    no chunk without a computed row is scored)."""
    groups: list[list[tuple[int, int]]] = []
    for lo, hi in runs:
        if groups and lo // C <= (groups[-1][-1][1] - 1) // C + 1:
            groups[-1].append((lo, hi))
        else:
            groups.append([(lo, hi)])
    spans = []
    for g in groups:
        lo, hi = g[0][0], g[-1][1]
        if len(g) == 1:
            spans.append(Span(lo, hi))
            continue
        here = torch.cat([torch.arange(a, b) for a, b in g]) if rows is None else \
            rows[torch.searchsorted(rows, torch.tensor(lo)) : torch.searchsorted(rows, torch.tensor(hi))]
        spans.append(Span(lo, hi, here, tuple(g)))
    return spans


def local_chunks(lo_row: int, hi_row: int, C: int) -> int:
    """Rows per chunk of the rows ``[lo_row, hi_row)`` for a backend with
    :attr:`~sp_kpool.backends.base.Backend.row_local_scores`: the fewest chunks of at most
    ``C`` rows, of equal rows (the last one shorter by less than their number), on a grid
    starting at ``lo_row``. Such a backend's cell bits do not depend on the call's rows, so
    any chunks give the same ids; equal ones store the least logits at once (the global
    grid can leave a chunk of ``C`` rows next to one of a few rows)."""
    n = hi_row - lo_row
    if n <= 0:
        return C
    return -(-n // -(-n // C))


def rank_spans(seq, C: int, *, cache: bool = True) -> list[Span]:
    """The :class:`Span` s of ``seq``'s real rows on this rank (:func:`row_spans` of
    ``seq.runs``) in chunks of ``C`` rows: one span in the contiguous layout, one per group
    of nearby runs in the interleaved ones. ``cache``: kept in the ``spans`` section of
    ``seq.batch`` (a loop over the runs, once per batch). Read-only (shared)."""

    def build() -> list[Span]:
        return row_spans(seq.runs, C, None if seq.is_contiguous else seq.real_rows())

    return seq.batch.get("spans", C, build, cache=cache)


@dataclass(frozen=True)
class Chunk:
    """One chunk of the grid: global rows ``[first, first + C)`` (``end``: the last real row
    + 1, ``<= first + C``), scored against pools ``[pool_lo, pool_hi)``; ``index`` is its
    position in the plan (its rows' ranges are ``ChunkPlan.ranges[:, index * C : ...]``)."""

    index: int
    first: int
    end: int
    pool_lo: int
    pool_hi: int


@dataclass(eq=False)
class ChunkPlan:
    """The chunk grid of rows ``[lo_row, hi_row)`` and its tables on ``device``.

    runs: the ``(lo, hi)`` runs of those rows computed here (``None``: all of them); the
    others have empty ranges.

    rows: chunk rows ``C``. chunks: the grid (empty without rows or pools).
    num_pools: complete pools of the whole sequence. pool_tok_start ``[P]``, cu
    ``[num_docs + 1]``, offs ``[num_docs + 1]`` (each document's first pool), bounds
    ``[n_chunks, 2]``: int64 on ``device``. Read-only once built (cached plans are shared).
    """

    rows: int
    lo_row: int
    hi_row: int
    kpool: int
    chunks: tuple[Chunk, ...]
    num_pools: int
    pool_tok_start: torch.Tensor
    cu: torch.Tensor
    offs: torch.Tensor
    bounds: torch.Tensor
    extend: torch.Tensor | None = None
    runs: tuple[tuple[int, int], ...] | None = None
    #: ``True``: the chunks of a backend with ``row_local_scores`` (a grid starting at
    #: ``lo_row``, :func:`local_chunks`; scored from views of the rows computed here, no zero
    #: rows: :meth:`padding` is ``(0, 0)``); ``False``: the global grid
    row_local: bool = False
    #: a plan of row subsets (:func:`plan_rows`): the global real rows (int64 CPU, ascending) of
    #: the plan's positions ``0 .. hi_row - 1``; its chunks' ``first``/``end`` are positions,
    #: and each chunk holds the rows of one chunk of the global grid against that chunk's pool
    #: range. ``None``: positions are global rows.
    row_ids: torch.Tensor | None = None
    _ranges: torch.Tensor | None = field(default=None, repr=False)
    _meta: RowMeta | None = field(default=None, repr=False)

    @property
    def first(self) -> int:
        """Global row of the first chunk's first row."""
        return grid_span(self.rows, self.lo_row, self.hi_row, self.lo_row if self.row_local else 0)[0]

    def global_rows(self, a: int, b: int) -> tuple[int, int]:
        """The global rows ``[first, last + 1)`` that hold the plan's positions ``[a, b)``
        (``a < b``): themselves, or in a plan of row subsets their first and last row's."""
        if self.row_ids is None:
            return a, b
        return int(self.row_ids[a]), int(self.row_ids[b - 1]) + 1

    def computed(self, chunk: Chunk) -> tuple[int, int]:
        """``(a, b)``: the rows of ``chunk`` in ``[lo_row, hi_row)``."""
        return max(chunk.first, self.lo_row), min(chunk.end, self.hi_row)

    def padding(self) -> tuple[int, int]:
        """``(before, after)``: the zero rows that the prepared query rows need in front of and
        behind ``[lo_row, hi_row)``: out to the edges of the chunks, ``(0, 0)`` with
        :attr:`row_local` (chunks scored from views of the rows computed here)."""
        if self.row_local:
            return 0, 0
        first, end = grid_span(self.rows, self.lo_row, self.hi_row)
        return self.lo_row - first, end - self.hi_row

    @property
    def ranges(self) -> torch.Tensor:
        """``[2, n_chunks * C]`` int32: each row's ``[start, end)`` relative to its chunk's
        pool range, on the chunk grid (rows not in ``[lo_row, hi_row)`` empty). Built on
        first use (one kernel launch on CUDA with Triton, torch ops elsewhere), then kept."""
        if self._ranges is None and self.row_ids is not None:
            self._ranges = self._subset_ranges()
        if self._ranges is None:
            args = (self.cu, self.offs, self.bounds, self.lo_row, self.hi_row, self.first, self.rows, self.kpool)
            if _device.on_gpu(self.bounds.device) and probe("triton")[0] is not None:
                from .kernels.triton_ranges import chunk_row_ranges

                self._ranges = chunk_row_ranges(*args)
            else:
                self._ranges = row_ranges_torch(*args)
            if self.runs is not None:  # rows between the runs are not computed here: empty ranges
                keep = torch.zeros(self._ranges.shape[1], dtype=torch.bool)
                for a, b in self.runs:
                    keep[a - self.first : b - self.first] = True
                keep = to_device(keep, self._ranges.device)
                self._ranges[1] = torch.where(keep, self._ranges[1], self._ranges[0])
        return self._ranges

    @property
    def meta(self) -> RowMeta:
        """Causal metadata of the rows ``[lo_row, hi_row)`` (built on first use, then kept:
        its small kernels queue behind the scoring instead of delaying the first one)."""
        if self._meta is None:
            rows = torch.arange(self.lo_row, self.hi_row, device=self.bounds.device) if self.row_ids is None else \
                to_device(self.row_ids, self.bounds.device)
            self._meta = row_meta(rows, self.cu, self.offs, self.kpool)
        return self._meta

    def _subset_ranges(self) -> torch.Tensor:
        """:attr:`ranges` of a plan of row subsets: chunk ``i``'s rows at ``i * C ..``."""
        device = self.bounds.device
        ranges = torch.zeros((2, len(self.chunks) * self.rows), dtype=torch.int32, device=device)
        if not self.chunks:
            return ranges
        meta = self.meta
        sizes = torch.tensor([c.end - c.first for c in self.chunks])
        which = to_device(torch.repeat_interleave(torch.arange(len(self.chunks)), sizes), device)
        at = which * self.rows + torch.arange(self.hi_row, device=device) - self.bounds.new_tensor(
            [c.first for c in self.chunks])[which]  # fmt: skip
        start, end = _relative_ranges(meta, self.bounds[which])
        ranges[0, at], ranges[1, at] = start.to(torch.int32), end.to(torch.int32)
        return ranges


def plan_chunks(seq, kpool: int, C: int, lo_row: int, hi_row: int, device: torch.device, *,
                runs: tuple[tuple[int, int], ...] | None = None, cache: bool = True,
                row_local: bool = False) -> ChunkPlan:  # fmt: skip
    """The :class:`ChunkPlan` of real rows ``[lo_row, hi_row)`` of ``seq`` in chunks of
    ``C`` rows on the global grid (host arithmetic on the document boundaries only, one copy
    to ``device``): every rank gets the same chunks. ``row_local`` (the backend's
    :attr:`~sp_kpool.backends.base.Backend.row_local_scores`): chunks of
    :func:`local_chunks` rows on a grid starting at ``lo_row`` instead.

    ``runs``: the ``(lo, hi)`` runs of the rows computed here when not all of
    ``[lo_row, hi_row)`` are (a :class:`Span`'s); the others get empty pool ranges.
    ``cache``: take it from (or put it in) the ``plans`` section of ``seq.batch``
    (:class:`~sp_kpool.batch.BatchCache`). Without complete pools the plan has no chunks
    (nothing is scored).
    """

    def build() -> ChunkPlan:
        return _build(seq, kpool, C, lo_row, hi_row, device, runs, row_local)

    if not cache:
        return build()
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    # the boundaries by value too: an in-place change of seq.cu_seq_lens is another plan
    key = (tuple(seq.cu_seq_lens.tolist()), seq.padding_docs, seq.prompt_lens, kpool, C, lo_row, hi_row, runs,
           device, stream, row_local)  # fmt: skip
    return seq.batch.get("plans", key, build)


def _build(seq, kpool: int, C: int, lo_row: int, hi_row: int, device: torch.device, runs=None,
           row_local: bool = False) -> ChunkPlan:  # fmt: skip
    origin = 0
    if row_local:
        C, origin = local_chunks(lo_row, hi_row, C), lo_row
    grid = _Grid(seq, kpool)
    chunks = []
    if hi_row > lo_row and grid.num_pools:
        for i, g0 in enumerate(range(*grid_span(C, lo_row, hi_row, origin), C)):
            g1 = min(g0 + C, seq.num_real_tokens)
            chunks.append(Chunk(i, g0, g1, *grid.pools_of(g0, g1)))
    return grid.plan(C, lo_row, hi_row, chunks, device, runs=runs, row_local=row_local)


def plan_rows(seq, kpool: int, C: int, rows: torch.Tensor, device: torch.device) -> ChunkPlan:
    """The :class:`ChunkPlan` of the real rows ``rows`` of ``seq`` alone (int64 CPU,
    ascending; ``kpool_topk(rows=)``), for a backend whose cells do not depend on the
    call's other rows (:meth:`~sp_kpool.backends.base.Backend.scores_row_subsets`): the
    plan's positions ``0 .. n - 1`` are those rows (:attr:`ChunkPlan.row_ids`), and each
    chunk of the global grid of ``C`` rows that holds some of them gives one chunk of just
    those rows, scored against the grid chunk's pool range, so a row's cells are made
    against the same pools as in the full call, and no row that was not asked for is
    scored. Not cached (the rows change from call to call)."""
    grid = _Grid(seq, kpool)
    chunks = []
    if rows.numel() and grid.num_pools:
        cells, counts = torch.unique_consecutive(rows // C, return_counts=True)
        pos = 0
        for i, (g, n) in enumerate(zip(cells.tolist(), counts.tolist())):
            g0 = g * C
            chunks.append(Chunk(i, pos, pos + n, *grid.pools_of(g0, min(g0 + C, seq.num_real_tokens))))
            pos += n
    return grid.plan(C, 0, rows.numel(), chunks, device, row_local=True, row_ids=rows)


class _Grid:
    """The pool arithmetic of ``seq``'s real documents (host ints): each document's first
    pool, and the pool range of a chunk of global rows; :meth:`plan` makes the tables."""

    def __init__(self, seq, kpool: int):
        self.seq, self.kpool = seq, kpool
        self.cu = [int(v) for v in seq.real_cu_seq_lens.tolist()]
        offs = [0]
        for d in range(len(self.cu) - 1):
            offs.append(offs[-1] + (self.cu[d + 1] - self.cu[d]) // kpool)
        self.offs, self.num_pools = offs, offs[-1]

    def pools_of(self, g0: int, g1: int) -> tuple[int, int]:
        """``(pool_lo, pool_hi)`` of the global rows ``[g0, g1)``: from the first pool of
        ``g0``'s document to the last pool that row ``g1 - 1`` sees."""
        cu, offs = self.cu, self.offs
        d0, d1 = bisect.bisect_right(cu, g0) - 1, bisect.bisect_right(cu, g1 - 1) - 1
        return offs[d0], offs[d1] + (g1 - 1 - cu[d1] + 1) // self.kpool

    def plan(self, C: int, lo_row: int, hi_row: int, chunks: list, device: torch.device, **kw) -> ChunkPlan:
        """The plan of ``chunks`` with its tables on ``device`` (one host-to-device copy)."""
        seq, K, cu, offs, P = self.seq, self.kpool, self.cu, self.offs, self.num_pools
        shift = [cu[d] - offs[d] * K for d in range(len(cu) - 1)]  # pool p of doc d starts at shift[d] + p * K
        ext = extend_pools(seq.real_cu_seq_lens, seq.prompt_lens, K) if seq.has_prompts else None
        ext = ext if ext is not None and bool(ext.any()) else None
        host = torch.tensor(cu + offs + shift + [v for c in chunks for v in (c.pool_lo, c.pool_hi)], dtype=torch.int64)
        if ext is not None:  # in the same one copy
            host = torch.cat([host, ext.to(torch.int64)])
        flat = to_device(host, device)
        n, nb = len(cu), 2 * len(chunks)
        cu_d, offs_d, shift_d = flat[:n], flat[n : 2 * n], flat[2 * n : 3 * n - 1]
        bounds = flat[3 * n - 1 : 3 * n - 1 + nb].view(-1, 2)
        extend = flat[3 * n - 1 + nb :] != 0 if ext is not None else None
        pid = torch.arange(P, device=device)
        pts = shift_d[torch.searchsorted(offs_d, pid, right=True) - 1] + pid * K if P else pid
        return ChunkPlan(C, lo_row, hi_row, K, tuple(chunks), P, pts, cu_d, offs_d, bounds, extend, **kw)


def row_ranges_torch(cu, offs, bounds, lo_row: int, hi_row: int, first: int, C: int, kpool: int) -> torch.Tensor:
    """``[2, n_chunks * C]`` int32 ``[start, end)`` of every row of the chunk grid relative
    to its chunk's pool range (:func:`sp_kpool.kernels.triton_ranges.chunk_row_ranges` is
    its one-launch CUDA twin)."""
    device = bounds.device
    meta = row_meta(torch.arange(lo_row, hi_row, device=device), cu, offs, kpool)
    start, end = _relative_ranges(meta, bounds[(meta.rows - first) // C])
    ranges = torch.zeros((2, bounds.shape[0] * C), dtype=torch.int32, device=device)
    ranges[0, lo_row - first : hi_row - first] = start
    ranges[1, lo_row - first : hi_row - first] = end
    return ranges


def _relative_ranges(meta: RowMeta, bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's visible pools ``[start, end)`` relative to the pool range ``bounds [n, 2]``
    of its chunk (empty where it sees none of them)."""
    start = (meta.pool_lo - bounds[:, 0]).clamp_(min=0)
    return start, torch.maximum(start, torch.minimum(meta.pool_hi, bounds[:, 1]) - bounds[:, 0])
