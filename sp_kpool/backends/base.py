"""What a backend is, and the chunked driver that every scoring backend shares.

A backend turns gathered keys and gates into pooled keys (``pool``) and scores a chunk of
query rows against a contiguous range of pools (``score``). The driver owns everything that
must be identical for every backend and every sharding: the pool table, the causal ranges,
the chunk grid, deterministic Top-K, expansion, tail and layout.

Bitwise equality across world sizes: query rows are scored in chunks of ``C`` rows on a
grid aligned to *global* row ids, and every chunk is scored against the pool range of the
whole global chunk, with the rows this rank does not compute set to zero and given empty
pool ranges (kernels skip them). ``C`` depends only on global quantities (heads, pools,
real length, the logits budget, the backend). So a given row is always computed by the same
kernel call shape at the same position, whichever rank computes it; this was checked bit
for bit on CPU (gloo), and on an H200 for the TileLang and DeepGEMM kernels.
"""

from __future__ import annotations

import bisect
import functools
import inspect
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from .._device import to_device
from .._env import env_int
from .._probe import probe
from ..selection import assemble, output_width, row_meta, select_pools
from ..sharding import ShardedSequence

__all__ = ["Problem", "Backend", "stage", "round_rows", "pad_rows", "grid_span", "prepare_rows", "pool_and_prepare_rows",
           "run_chunked", "select_rows",
           "stage_tables", "clear_table_cache", "default_max_logits_bytes", "MAX_CHUNK_ROWS"]  # fmt: skip

#: Upper bound on the rows of one scoring chunk (larger chunks gain nothing on CPU).
MAX_CHUNK_ROWS = 512
_ENV_BUDGET = "SP_KPOOL_MAX_LOGITS_BYTES"
_DEFAULT_BUDGET = 256 * 2**20
_DEFAULT_BUDGET_CUDA = 2 * 2**30


class stage:
    """``with stage(problem, "score"):`` accumulates synchronized wall time if requested."""

    def __init__(self, problem: "Problem", name: str):
        self.times, self.name, self.device = problem.stage_times, name, problem.device

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self):
        if self.times is not None:
            self._sync()
            self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        if self.times is not None:
            self._sync()
            self.times[self.name] = self.times.get(self.name, 0.0) + time.perf_counter() - self.t0


def default_max_logits_bytes(device: torch.device | str | None = None) -> int:
    """The logits budget: ``$SP_KPOOL_MAX_LOGITS_BYTES`` if set, else 2 GiB on CUDA devices
    (fewer, larger chunks: each chunk costs a few host synchronisations) and 256 MiB
    elsewhere. Ranks on the same kind of device get the same default, so results stay
    bitwise equal across world sizes."""
    value = env_int(_ENV_BUDGET, minimum=1, expected="a positive integer number of bytes")
    if value is None:
        return _DEFAULT_BUDGET_CUDA if device is not None and torch.device(device).type == "cuda" else _DEFAULT_BUDGET
    return value


@dataclass
class Problem:
    """One call of the operator, after validation and the gather.

    q: ``[S_local, H, D]`` local queries; head_weights: ``[S_local, H]`` raw gate output;
    k, gates: ``[S, D]`` gathered over the group (``S`` = padded global length);
    ape: ``[K, D]``; seq: the sharding; the rest are the options of ``kpool_topk``.
    """

    q: torch.Tensor
    head_weights: torch.Tensor
    k: torch.Tensor
    gates: torch.Tensor
    ape: torch.Tensor
    seq: ShardedSequence
    topk: int
    kpool: int
    tail: str
    order: str
    alignment: int
    max_logits_bytes: int
    precision: str = "bf16"
    #: When a dict, the driver synchronizes the device around each stage and adds the
    #: seconds spent to ``stage_times["pool" | "score" | "select" | "expand"]`` (benchmarks;
    #: where the backend pools and prepares the queries in one step, ``"pool"`` holds both).
    stage_times: dict | None = None

    @property
    def heads(self) -> int:
        return self.q.shape[1]

    @property
    def head_dim(self) -> int:
        return self.q.shape[2]

    @property
    def device(self) -> torch.device:
        return self.q.device


class Backend:
    """Interface of a backend. Subclasses set ``name``, ``precisions`` and ``priority``."""

    name: str = "?"
    #: Arithmetic modes this backend implements exactly.
    precisions: tuple[str, ...] = ()
    #: Higher runs first under ``backend="auto"``.
    priority: int = 0

    def not_supported_reasons(self, problem: Problem) -> list[str]:
        """Why this backend cannot run ``problem`` (empty list: it can)."""
        reasons = []
        if problem.precision not in self.precisions:
            reasons.append(f"precision {problem.precision!r} not implemented (has {list(self.precisions)})")
        if problem.order == "serving":
            from ..selection import _radix_selector

            k = problem.topk // problem.kpool
            if problem.device.type != "cuda":
                reasons.append(f"order 'serving' needs the CUDA serving selector, inputs are on {problem.device}")
            elif k not in (512, 2048):
                reasons.append(f"order 'serving' needs topk // kpool in (512, 2048), got {k}")
            elif _radix_selector(k) is None:
                reasons.append("order 'serving' needs lmdeploy's sparse_index_topk (pip install 'sp-kpool[serving]')")
        return reasons

    def pool(self, problem: Problem, pool_tok_start: torch.Tensor) -> Any:
        """Pooled keys of the complete pools ``[P]`` (backend-specific representation)."""
        raise NotImplementedError

    def score_bytes_per_cell(self, problem: Problem) -> int:
        """Bytes of scratch per (row, pool) cell that one scoring call allocates."""
        return 4

    def chunk_rows(self, problem: Problem, num_pools: int) -> int:
        """Rows per scoring chunk, from global quantities only (same on every rank)."""
        return chunk_rows(problem, num_pools, self.score_bytes_per_cell(problem), self.max_chunk_rows)

    def score(
        self,
        problem: Problem,
        pooled: Any,
        q: torch.Tensor,
        w: torch.Tensor,
        lo: int,
        hi: int,
        starts: torch.Tensor,
        ends: torch.Tensor,
    ) -> torch.Tensor:
        """Scores ``[C, hi - lo]`` FP32 of the chunk ``q [C, H, D]``, ``w [C, H]`` (raw gates)
        against pools ``lo .. hi - 1``. ``starts``/``ends`` (``[C]`` int32, relative to
        ``lo``) give each row's visible columns; a backend may skip the rest. Cells outside a
        row's range are ignored, unless ``masks_scores`` is set, which promises ``-inf``
        there (the driver then skips its own masking pass). A backend with request-local
        columns returns ``(scores [C, W], offset [C] int64)``: column ``c`` of row ``r`` is
        pool ``lo + offset[r] + c`` (``masks_scores`` must then hold)."""
        raise NotImplementedError

    def prepare_queries(self, problem: Problem, q: torch.Tensor, w: torch.Tensor) -> tuple[Any, Any]:
        """The per-row part of scoring, done once per call for all the rows a rank scores
        (e.g. query rotation and quantization): ``(q', w')`` with rows matching ``q
        [R, H, D]`` / ``w [R, H]``, where row ``r`` depends on row ``r`` of the inputs
        only and an all-zero input row gives an all-zero output row. Default: ``(q, w)``.

        Override it together with :meth:`score_prepared` (the driver checks), and keep
        :meth:`score` equal to ``score_prepared(prepare_queries(...))``: the driver calls
        ``score_prepared``, so a subclass that overrides only ``score`` of a backend with
        these hooks is not used by the driver.

        A backend that sets :attr:`pads_prepared` also takes ``before=`` and ``after=``
        (row counts) and returns ``before`` all-zero rows in front of the prepared rows and
        ``after`` behind them, written in place (the driver then scores partial chunks
        from views instead of zero-padded copies)."""
        return q, w

    #: :meth:`prepare_queries` takes ``before=`` / ``after=`` zero rows around its output.
    pads_prepared: bool = False

    #: :meth:`pool_and_prepare` pools and prepares the queries in one step (e.g. one kernel
    #: launch: each launch costs host time before the first scoring call). The driver then
    #: calls it instead of :meth:`pool` and :meth:`prepare_queries` when it pools (the
    #: ``"pool"`` stage time then holds both). Needs :attr:`pads_prepared`.
    pools_with_queries: bool = False

    def pool_and_prepare(self, problem: Problem, pool_tok_start: torch.Tensor, q: torch.Tensor, w: torch.Tensor,
                         before: int = 0, after: int = 0) -> tuple[Any, Any, Any]:  # fmt: skip
        """``(pooled, q', w')``: :meth:`pool` of ``pool_tok_start [P]`` and
        :meth:`prepare_queries` of ``q [R, H, D]``, ``w [R, H]`` with ``before`` / ``after``
        zero rows, in one step; the same values as the two calls (default: the two calls)."""
        pooled = self.pool(problem, pool_tok_start)
        return (pooled, *self.prepare_queries(problem, q, w, before=before, after=after))

    def score_prepared(self, problem: Problem, pooled: Any, q: Any, w: Any, lo: int, hi: int,
                       starts: torch.Tensor, ends: torch.Tensor):  # fmt: skip
        """:meth:`score` of rows already passed through :meth:`prepare_queries` (the
        driver's path; ``score`` itself takes raw rows). Default: ``score``."""
        return self.score(problem, pooled, q, w, lo, hi, starts, ends)

    #: ``score`` writes ``-inf`` outside each row's visible range, or may leave those cells
    #: when :func:`select_pools` will select with the Triton selector and ``order`` is not
    #: ``"serving"`` (that selector reads only ``[start, end)`` of each row).
    masks_scores: bool = False
    #: Upper bound on the rows of one scoring chunk.
    max_chunk_rows: int = MAX_CHUNK_ROWS

    def run(self, problem: Problem, pooled: Any = None) -> torch.Tensor:
        """Selected global token ids, ``[S_local, width]`` int32.

        ``pooled``: the pooled keys of all complete pools if already built (e.g. pooled
        per shard and gathered); ``None`` pools ``problem.k`` / ``problem.gates`` here.
        """
        return run_chunked(self, problem, pooled)


def chunk_rows(problem: Problem, num_pools: int, bytes_per_cell: int, max_rows: int = MAX_CHUNK_ROWS) -> int:
    """Rows per scoring chunk: fits the budget, from global quantities only (a multiple
    of 128 when at least 128 rows fit)."""
    per_row = max(1, num_pools) * bytes_per_cell
    rows = problem.max_logits_bytes // per_row
    if rows < 1:
        raise ValueError(
            f"max_logits_bytes: expected at least {per_row} (one query row against {num_pools} pools "
            f"at {bytes_per_cell} bytes per cell), got {problem.max_logits_bytes}"
        )
    return round_rows(min(rows, max_rows, problem.seq.num_real_tokens))


def round_rows(rows: int) -> int:
    """``rows`` rounded down to a multiple of 128 when >= 128 (whole kernel row groups)."""
    return int(rows // 128 * 128 if rows >= 128 else max(1, rows))


def pad_rows(x: torch.Tensor, before: int, after: int) -> torch.Tensor:
    """``x`` with ``before`` zero rows in front and ``after`` behind (dim 0), in one host
    call: how the driver lays a partial chunk's rows on the chunk grid."""
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (before, after))


@dataclass
class _Staged:
    """The chunk grid of one driver call and its tables on the device (one copy).

    ``ranges`` (the rows' ``[start, end)`` on the chunk grid) and ``meta`` (the rows'
    :class:`~sp_kpool.selection.RowMeta`) are filled by the driver on first use. Nothing
    here is written after it is built: cached tables are shared by later calls."""

    C: int
    grid: list
    num_pools: int
    pool_tok_start: torch.Tensor
    cu: torch.Tensor
    offs: torch.Tensor
    bounds: torch.Tensor
    ranges: torch.Tensor | None = None
    meta: Any = None


_ENV_TABLE_CACHE = "SP_KPOOL_TABLE_CACHE"
#: Staged tables of recent calls, keyed by everything they depend on (see stage_tables).
_TABLES: "OrderedDict[tuple, _Staged]" = OrderedDict()
_TABLES_MAX = 16


def clear_table_cache() -> None:
    """Drop the cached driver tables (:func:`stage_tables`)."""
    _TABLES.clear()


def _table_cache_enabled() -> bool:
    raw = os.environ.get(_ENV_TABLE_CACHE, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{_ENV_TABLE_CACHE}: expected 0 or 1, got {raw!r}")
    return raw != "0"


def _geometry(backend: Backend, problem: Problem) -> tuple[list, list, int]:
    """``(cu, offs, C)``: the real documents' boundaries, their first pools (host lists,
    ``offs[-1]`` = number of complete pools) and the chunk rows ``C`` (1 without pools:
    nothing is scored, so no budget check)."""
    K = problem.kpool
    cu = [int(v) for v in problem.seq.real_cu_seq_lens.tolist()]
    offs = [0]
    for d in range(len(cu) - 1):
        offs.append(offs[-1] + (cu[d + 1] - cu[d]) // K)
    return cu, offs, backend.chunk_rows(problem, offs[-1]) if offs[-1] else 1


def grid_span(C: int, lo_row: int, hi_row: int) -> tuple[int, int]:
    """``(first, end)``: the global rows that the chunks of ``C`` rows holding ``[lo_row,
    hi_row)`` cover (``first <= lo_row``, ``end >= hi_row``, multiples of ``C`` apart)."""
    if hi_row <= lo_row:
        return lo_row, lo_row
    first = (lo_row // C) * C
    return first, first + -(-(hi_row - first) // C) * C


def stage_tables(backend: Backend, problem: Problem, lo_row: int, hi_row: int, geometry: tuple | None = None) -> _Staged:
    """The chunk grid of rows ``[lo_row, hi_row)`` (host arithmetic on the document
    boundaries only) and the device tables: ``real_cu_seq_lens``, ``doc_pool_offset`` and
    the pool range of each chunk ``[n_chunks, 2]`` in **one** host-to-device copy, then
    ``pool_tok_start [P]`` built on the device (all int64, as :func:`pool_table`).

    The copy does not make the host wait for the device (:func:`sp_kpool._device.to_device`).

    Cached: a later call with the same document boundaries (by value), ``kpool``, chunk
    rows, row range, device and current CUDA stream gets the same tables (every layer of a
    step after the first skips this host work, the copy, the small kernels that build
    ``pool_tok_start`` and, in the driver, the row ranges and row metadata). The tables
    are read-only. ``$SP_KPOOL_TABLE_CACHE=0`` turns the cache off;
    :func:`clear_table_cache` empties it. ``geometry``: ``_geometry(backend, problem)`` if
    the caller has it already."""
    seq, device, K = problem.seq, problem.device, problem.kpool
    # no complete pools: nothing is scored (select_rows returns -1 rows), so no grid
    cu, offs, C = geometry if geometry is not None else _geometry(backend, problem)
    P = offs[-1]
    key = None
    if _table_cache_enabled():
        stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
        key = (tuple(cu), K, C, lo_row, hi_row, device, stream)
        hit = _TABLES.get(key)
        if hit is not None:
            _TABLES.move_to_end(key)
            return hit
    grid = []
    if hi_row > lo_row and P:
        def doc(r):  # document of the real row r
            return bisect.bisect_right(cu, r) - 1

        for g0 in range(*grid_span(C, lo_row, hi_row), C):
            g1 = min(g0 + C, seq.num_real_tokens)
            d0, d1 = doc(g0), doc(g1 - 1)
            grid.append((g0, g1, offs[d0], offs[d1] + (g1 - 1 - cu[d1] + 1) // K))
    shift = [cu[d] - offs[d] * K for d in range(len(cu) - 1)]  # pool p of doc d starts at shift[d] + p * K
    host = torch.tensor(cu + offs + shift + [v for _, _, lo, hi in grid for v in (lo, hi)], dtype=torch.int64)
    flat = to_device(host, device)
    n = len(cu)
    cu_d, offs_d, shift_d, bounds = flat[:n], flat[n : 2 * n], flat[2 * n : 3 * n - 1], flat[3 * n - 1 :].view(-1, 2)
    pid = torch.arange(P, device=device)
    pts = shift_d[torch.searchsorted(offs_d, pid, right=True) - 1] + pid * K if P else pid
    staged = _Staged(C, grid, P, pts, cu_d, offs_d, bounds)
    if key is not None:
        _TABLES[key] = staged
        while len(_TABLES) > _TABLES_MAX:
            _TABLES.popitem(last=False)
    return staged


def _check_query_hooks(backend: Backend) -> None:
    """``prepare_queries`` and ``score_prepared`` are overridden together or not at all
    (the driver prepares rows once and scores them with ``score_prepared``; one without the
    other would prepare twice or score raw rows as prepared ones)."""
    cls = type(backend)
    prep = cls.prepare_queries is not Backend.prepare_queries
    scored = cls.score_prepared is not Backend.score_prepared
    if prep != scored:
        raise TypeError(
            f"backend {cls.__name__}: prepare_queries and score_prepared must be overridden together "
            f"(prepare_queries overridden: {prep}, score_prepared overridden: {scored})"
        )


@functools.lru_cache(maxsize=None)
def _check_pads(cls: type) -> None:
    """A backend class with ``pads_prepared`` set must take ``before=`` / ``after=`` in
    ``prepare_queries`` (a subclass that overrides the hook without them inherits the flag)."""
    try:
        params = inspect.signature(cls.prepare_queries).parameters
    except (TypeError, ValueError):  # no signature to read: trust the flag
        return
    if not {"before", "after"} <= set(params) and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise TypeError(
            f"backend {cls.__name__}: pads_prepared is set, so prepare_queries must take before= and after= "
            f"(its parameters: {list(params)}); set pads_prepared = False or add them"
        )


def row_ranges_torch(cu, offs, bounds, lo_row: int, hi_row: int, first: int, C: int, kpool: int) -> torch.Tensor:
    """``[2, n_chunks * C]`` int32 ``[start, end)`` of every row of the chunk grid relative
    to its chunk's pool range (see :func:`sp_kpool.kernels.triton_ranges.chunk_row_ranges`,
    its one-launch CUDA twin)."""
    device = bounds.device
    meta = row_meta(torch.arange(lo_row, hi_row, device=device), cu, offs, kpool)
    which = (meta.rows - first) // C
    clo, chi = bounds[which, 0], bounds[which, 1]
    r_start = (meta.pool_lo - clo).clamp_(min=0)
    r_end = torch.minimum(meta.pool_hi, chi) - clo
    ranges = torch.zeros((2, bounds.shape[0] * C), dtype=torch.int32, device=device)
    ranges[0, lo_row - first : hi_row - first] = r_start
    ranges[1, lo_row - first : hi_row - first] = torch.maximum(r_start, r_end)
    return ranges


def _pad_rows_of(C: int, lo_row: int, hi_row: int) -> tuple[int, int, int]:
    """``(first, before, after)``: the first global row of the chunks of ``C`` rows holding
    ``[lo_row, hi_row)`` and the zero rows in front of and behind those rows."""
    first, end = grid_span(C, lo_row, hi_row)
    return first, lo_row - first, end - hi_row


def prepare_rows(backend: Backend, problem: Problem, q, w, C: int, lo_row: int, hi_row: int) -> tuple[Any, Any, int]:
    """``(q', w', first)``: ``backend.prepare_queries`` of the rows ``[lo_row, hi_row)``
    (``q [n, H, D]``, ``w [n, H]``), with zero rows out to the edges of their chunks of
    ``C`` rows where the backend can write them in place (:attr:`Backend.pads_prepared`);
    row 0 of ``q'`` is the global row ``first``. The padding costs up to ``2 (C - 1)``
    prepared rows of memory for the whole call (a zero-padded copy costs ``C`` rows per
    partial chunk, and a copy)."""
    if not backend.pads_prepared or hi_row <= lo_row:
        qp, wp = backend.prepare_queries(problem, q, w)
        return qp, wp, lo_row
    _check_pads(type(backend))
    first, before, after = _pad_rows_of(C, lo_row, hi_row)
    qp, wp = backend.prepare_queries(problem, q, w, before=before, after=after)
    return qp, wp, first


@functools.lru_cache(maxsize=None)
def _pools_with_queries(cls: type) -> bool:
    """Whether the driver calls ``cls.pool_and_prepare`` instead of ``pool`` and
    ``prepare_queries``: the class sets :attr:`Backend.pools_with_queries` and
    :attr:`Backend.pads_prepared`, and its ``pool_and_prepare`` is defined where its ``pool``
    and ``prepare_queries`` are or below (a subclass that overrides either of them without
    ``pool_and_prepare`` inherits the flag: its overrides are used, step by step)."""
    if not (cls.pools_with_queries and cls.pads_prepared):
        return False

    def owner(name):
        return next(c for c in cls.__mro__ if name in c.__dict__)

    fused = owner("pool_and_prepare")
    return issubclass(fused, owner("pool")) and issubclass(fused, owner("prepare_queries"))


def pool_and_prepare_rows(backend: Backend, problem: Problem, pool_tok_start: torch.Tensor, q, w, C: int, lo_row: int,
                          hi_row: int) -> tuple[Any, tuple[Any, Any, int]]:  # fmt: skip
    """``(pooled, (q', w', first))``: :meth:`Backend.pool_and_prepare` of the pools and of
    the rows ``[lo_row, hi_row)``, the prepared rows laid out as :func:`prepare_rows` lays
    them (zero rows out to the edges of their chunks of ``C`` rows). A backend without
    :attr:`Backend.pools_with_queries` and :attr:`Backend.pads_prepared`, no pools or no
    rows: the separate steps (``pooled`` is ``None`` without pools: nothing is scored). So
    does a subclass that overrides ``pool`` or ``prepare_queries`` but not
    ``pool_and_prepare``."""
    if not _pools_with_queries(type(backend)) or not pool_tok_start.numel() or hi_row <= lo_row:
        pooled = backend.pool(problem, pool_tok_start) if pool_tok_start.numel() else None
        return pooled, prepare_rows(backend, problem, q, w, C, lo_row, hi_row)
    first, before, after = _pad_rows_of(C, lo_row, hi_row)
    pooled, qp, wp = backend.pool_and_prepare(problem, pool_tok_start, q, w, before=before, after=after)
    return pooled, (qp, wp, first)


def select_rows(
    backend: Backend,
    problem: Problem,
    pooled: Any,
    lo_row: int,
    hi_row: int,
    q: torch.Tensor | None,
    w: torch.Tensor | None,
    staged: "_Staged | None" = None,
    prepared: tuple[Any, Any, int] | None = None,
) -> torch.Tensor:
    """Selected pools of the global rows ``[lo_row, hi_row)`` (all real rows).

    ``q [hi_row - lo_row, H, D]`` and ``w [hi_row - lo_row, H]`` are those rows' queries and
    raw head weights; ``staged``: the chunk grid and the tables on the device (from
    :func:`stage_tables`, which is called here when ``None``); ``prepared``: ``(q', w',
    first)`` if already made (``q`` and ``w`` are then not used), as
    :func:`prepare_rows` returns it: row 0 of ``q'`` is the global row ``first``, zero
    rows outside ``[lo_row, hi_row)``.

    Returns ``[hi_row - lo_row, topk // kpool]`` int32 global pool ids, valid ones first,
    ``-1`` after: in score order for ``order="score"``, in the serving selector's order
    for ``"serving"``, ascending for ``"ascending"``. Any rank computing a row gets the
    same set (global chunk grid, see the module docstring).

    The rows are prepared once (:meth:`Backend.prepare_queries`, with zero rows up to the
    chunk grid's edges where the backend can: :attr:`Backend.pads_prepared`); a chunk
    whose rows the prepared tensors cover is scored from views of them, other chunks from
    zero-padded copies, after the others. The rows' causal ranges are computed once for
    all chunks, on the device.
    """
    kpool, device = problem.kpool, problem.device
    _check_query_hooks(backend)
    k_sel = problem.topk // kpool

    def empty_out():
        return torch.full((hi_row - lo_row, k_sel), -1, dtype=torch.int32, device=device)

    if hi_row <= lo_row:
        return empty_out()
    if staged is None:
        staged = stage_tables(backend, problem, lo_row, hi_row)
    if staged.num_pools == 0:
        return empty_out()
    C, grid, cu_dev, offs_dev, bounds_dev = staged.C, staged.grid, staged.cu, staged.offs, staged.bounds
    if prepared is None:
        prepared = prepare_rows(backend, problem, q, w, C, lo_row, hi_row)
    qp, wp, p0 = prepared
    p1 = p0 + qp.shape[0]  # the prepared rows are the global rows [p0, p1)
    # each row's [start, end) relative to its chunk's pool range, laid out on the chunk grid
    # (rows not computed here stay empty): one pass for all chunks, views per chunk
    first = grid[0][0]
    ranges = staged.ranges
    if ranges is None:
        if device.type == "cuda" and probe("triton")[0] is not None:
            from ..kernels.triton_ranges import chunk_row_ranges

            ranges = chunk_row_ranges(cu_dev, offs_dev, bounds_dev, lo_row, hi_row, first, C, kpool)
        else:
            ranges = row_ranges_torch(cu_dev, offs_dev, bounds_dev, lo_row, hi_row, first, C, kpool)
        staged.ranges = ranges
    # chunks that the prepared rows cover first: their scoring call takes views (no padded
    # copies), so the host reaches the first one sooner (a cold call's device waits for
    # it); the chunks are independent, so the order changes no result
    whole = [p0 <= g0 and g0 + C <= p1 for g0, _, _, _ in grid]
    out = None
    unscored = []  # row ranges of chunks without pools
    for i in sorted(range(len(grid)), key=lambda j: not whole[j]):
        g0, g1, lo, hi = grid[i]
        a, b = max(g0, lo_row), min(g1, hi_row)  # rows of this chunk computed here
        if hi <= lo:
            unscored.append((a, b))
            continue
        r_s, r_e = ranges[0, i * C : (i + 1) * C], ranges[1, i * C : (i + 1) * C]
        if whole[i]:  # views, no copies (rows not ours are zero rows of the padding)
            qc, wc = qp[g0 - p0 : g0 - p0 + C], wp[g0 - p0 : g0 - p0 + C]
        else:  # the call has the same shape and row positions whichever rank computes it
            # zero rows around ours (one host call per tensor: the host's path to the first
            # scoring call is where a cold call waits)
            qc = pad_rows(qp[a - p0 : b - p0], a - g0, g0 + C - b)
            wc = pad_rows(wp[a - p0 : b - p0], a - g0, g0 + C - b)
        with stage(problem, "score"):
            scores = backend.score_prepared(problem, pooled, qc, wc, lo, hi, r_s, r_e)
        col0: Any = lo
        row_starts, row_ends = r_s[a - g0 : b - g0], r_e[a - g0 : b - g0]
        if isinstance(scores, tuple):  # request-local columns: column c of row r is pool lo + offset[r] + c
            scores, offset = scores
            col0 = lo + offset[a - g0 : b - g0, None]
            row_starts = row_starts - offset[a - g0 : b - g0]
            row_ends = row_ends - offset[a - g0 : b - g0]
        scores = scores[a - g0 : b - g0]
        visible = None
        if not backend.masks_scores:
            cols = torch.arange(hi - lo, device=device)
            visible = (cols[None] >= row_starts[:, None]) & (cols[None] < row_ends[:, None])
        if out is None:  # allocated after the first scoring launch, not before
            out = torch.empty((hi_row - lo_row, k_sel), dtype=torch.int32, device=device)
        with stage(problem, "select"):
            # straight into this chunk's output rows, every element written
            select_pools(scores, visible, k_sel, col0, row_ends, order=problem.order, starts=row_starts,
                         out=out[a - lo_row : b - lo_row])  # fmt: skip
    if out is None:
        return empty_out()
    for a, b in unscored:  # every row lies in one chunk: the others are written above
        out[a - lo_row : b - lo_row].fill_(-1)
    return out


def run_chunked(backend: Backend, problem: Problem, pooled: Any = None) -> torch.Tensor:
    """The shared driver: pool (unless ``pooled`` is given), select this shard's rows chunk
    by chunk, then assemble."""
    seq, kpool, device = problem.seq, problem.kpool, problem.device
    width = output_width(problem.topk, kpool, problem.alignment)
    own_lo, own_hi = seq.shard_start, min(seq.shard_end, seq.num_real_tokens)
    if own_hi <= own_lo:  # this shard holds only padding
        return torch.full((seq.shard_size, width), -1, dtype=torch.int32, device=device)
    n = own_hi - own_lo
    q, w = problem.q[:n], problem.head_weights[:n]
    # one step for the pools and the queries where the backend has it; else the queries'
    # preparation first: it needs no host tables, and the host builds them (and copies them
    # over, once) while the device works. The output is allocated after the scoring calls
    # are queued (each host step before the first one delays it on a cold call)
    fused = pooled is None and _pools_with_queries(type(backend))
    with stage(problem, "score"):
        # the chunk rows from host arithmetic only (without the one step, the tables come
        # after the query kernel is queued)
        geometry = _geometry(backend, problem)
        if not fused:
            prepared = prepare_rows(backend, problem, q, w, geometry[2], own_lo, own_hi)
    staged = stage_tables(backend, problem, own_lo, own_hi, geometry)
    pts_dev, cu_dev, offs_dev = staged.pool_tok_start, staged.cu, staged.offs
    if fused:
        with stage(problem, "pool"):
            pooled, prepared = pool_and_prepare_rows(backend, problem, pts_dev, q, w, geometry[2], own_lo, own_hi)
    elif pooled is None and pts_dev.numel():
        with stage(problem, "pool"):
            pooled = backend.pool(problem, pts_dev)
    pools = select_rows(backend, problem, pooled, own_lo, own_hi, None, None, staged, prepared)
    out = torch.empty((seq.shard_size, width), dtype=torch.int32, device=device)
    out[n:].fill_(-1)  # padding rows; assemble writes the others whole
    with stage(problem, "expand"):
        # the rows' metadata only now: its small kernels queue behind the scoring instead of
        # delaying the first one (once per staged tables)
        meta = staged.meta
        if meta is None:
            meta = staged.meta = row_meta(torch.arange(own_lo, own_hi, device=device), cu_dev, offs_dev, kpool)
        assemble(
            pools,
            meta,
            pts_dev,
            topk=problem.topk,
            kpool=kpool,
            tail=problem.tail,
            order=problem.order,
            alignment=problem.alignment,
            presorted=True,
            out=out[:n],
        )
    return out
