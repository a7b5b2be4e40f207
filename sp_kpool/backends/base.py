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

import time
from dataclasses import dataclass
from typing import Any

import torch

from .._env import env_int
from ..pooling import pool_table
from ..selection import assemble, output_width, row_meta, select_pools
from ..sharding import ShardedSequence

__all__ = ["Problem", "Backend", "stage", "round_rows", "run_chunked", "select_rows", "default_max_logits_bytes", "MAX_CHUNK_ROWS"]

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
    #: seconds spent to ``stage_times["pool" | "score" | "select" | "expand"]`` (benchmarks).
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


def select_rows(
    backend: Backend,
    problem: Problem,
    pooled: Any,
    tables: tuple[torch.Tensor, torch.Tensor],
    lo_row: int,
    hi_row: int,
    q: torch.Tensor,
    w: torch.Tensor,
) -> torch.Tensor:
    """Selected pools of the global rows ``[lo_row, hi_row)`` (all real rows).

    ``q [hi_row - lo_row, H, D]`` and ``w [hi_row - lo_row, H]`` are those rows' queries and
    raw head weights, ``tables`` is ``pool_table(real_cu_seq_lens, kpool)``. Returns
    ``[hi_row - lo_row, topk // kpool]`` int32 global pool ids, valid ones first, ``-1``
    after: in score order for ``order="score"``, in the serving selector's order for
    ``"serving"``, ascending for ``"ascending"``. Any rank computing a row gets the same set
    (global chunk grid, see the module docstring).
    """
    seq, kpool, device = problem.seq, problem.kpool, problem.device
    real_cu = seq.real_cu_seq_lens
    pool_tok_start, doc_pool_offset = tables
    num_pools = pool_tok_start.numel()
    k_sel = problem.topk // kpool
    out = torch.full((hi_row - lo_row, k_sel), -1, dtype=torch.int32, device=device)
    if hi_row <= lo_row or num_pools == 0:
        return out
    C = backend.chunk_rows(problem, num_pools)
    num_real = seq.num_real_tokens
    H, D = problem.heads, problem.head_dim
    # device copies made once: a host-to-device copy inside the loop would make the host
    # wait for the chunk's kernels before it can queue the next ones
    real_cu_dev, offs_dev = real_cu.to(device), doc_pool_offset.to(device)
    for g0 in range((lo_row // C) * C, hi_row, C):
        g1 = min(g0 + C, num_real)
        a, b = max(g0, lo_row), min(g1, hi_row)  # rows of this chunk computed here
        ends = row_meta(torch.tensor([g0, g1 - 1]), real_cu, doc_pool_offset, kpool)
        lo, hi = int(ends.pool_lo[0]), int(ends.pool_hi[1])
        if hi <= lo:
            continue
        # the call has the same shape and row positions whichever rank computes it; rows not
        # computed here (and past the real length) get empty ranges, so kernels skip them
        meta = row_meta(torch.arange(g0, g0 + C, device=device), real_cu_dev, offs_dev, kpool)
        mine = torch.zeros(C, dtype=torch.bool, device=device)
        mine[a - g0 : b - g0] = True
        r_start = torch.where(mine, (meta.pool_lo - lo).clamp(0, hi - lo), 0)
        r_end = torch.where(mine, (meta.pool_hi - lo).clamp(0, hi - lo), 0)
        r_end = torch.maximum(r_start, r_end)
        qc = q.new_zeros((C, H, D))
        wc = w.new_zeros((C, H))
        qc[a - g0 : b - g0] = q[a - lo_row : b - lo_row]
        wc[a - g0 : b - g0] = w[a - lo_row : b - lo_row]
        with stage(problem, "score"):
            scores = backend.score(problem, pooled, qc, wc, lo, hi, r_start.to(torch.int32), r_end.to(torch.int32))
        col0: Any = lo
        row_starts, row_ends = r_start[a - g0 : b - g0], r_end[a - g0 : b - g0]
        if isinstance(scores, tuple):  # request-local columns: column c of row r is pool lo + offset[r] + c
            scores, offset = scores
            col0 = lo + offset[a - g0 : b - g0, None]
            row_starts = row_starts - offset[a - g0 : b - g0]
            row_ends = row_ends - offset[a - g0 : b - g0]
        scores = scores[a - g0 : b - g0]
        visible = None
        if not backend.masks_scores:
            cols = torch.arange(hi - lo, device=device)
            visible = (cols[None] >= r_start[a - g0 : b - g0, None]) & (cols[None] < r_end[a - g0 : b - g0, None])
        with stage(problem, "select"):
            pools = select_pools(scores, visible, k_sel, col0, row_ends, order=problem.order, starts=row_starts)
        out[a - lo_row : b - lo_row, : pools.shape[1]] = pools
    return out


def run_chunked(backend: Backend, problem: Problem, pooled: Any = None) -> torch.Tensor:
    """The shared driver: pool (unless ``pooled`` is given), select this shard's rows chunk
    by chunk, then assemble."""
    seq, kpool, device = problem.seq, problem.kpool, problem.device
    tables = pool_table(seq.real_cu_seq_lens, kpool)
    width = output_width(problem.topk, kpool, problem.alignment)
    out = torch.empty((seq.shard_size, width), dtype=torch.int32, device=device)
    own_lo, own_hi = seq.shard_start, min(seq.shard_end, seq.num_real_tokens)
    if own_hi <= own_lo:
        return out.fill_(-1)  # this shard holds only padding
    out[own_hi - own_lo :].fill_(-1)  # padding rows; assemble writes the others whole
    # host-to-device copies before any kernel is queued (see select_rows)
    pts_dev, cu_dev, offs_dev = tables[0].to(device), seq.real_cu_seq_lens.to(device), tables[1].to(device)
    if pooled is None and pts_dev.numel():
        with stage(problem, "pool"):
            pooled = backend.pool(problem, pts_dev)
    n = own_hi - own_lo
    pools = select_rows(backend, problem, pooled, tables, own_lo, own_hi, problem.q[:n], problem.head_weights[:n])
    with stage(problem, "expand"):
        # the rows' metadata only now: its small kernels queue behind the scoring instead of
        # delaying the first one
        meta = row_meta(torch.arange(own_lo, own_hi, device=device), cu_dev, offs_dev, kpool)
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
