"""What a backend is: the call record it sees, the interface, and the records it returns.

A backend implements one or more arithmetics (``precisions``) and two steps, the only
ones that differ between backends:

* :meth:`Backend.prepare`: pooled keys of the complete pools (:class:`Pools`) and/or the
  per-row preparation of the query rows (:class:`Queries`: e.g. rotation and quantization
  in FP8), in one step where the backend can do both at once;
* :meth:`Backend.score`: the scores of one chunk of prepared query rows against a
  contiguous range of pools (:class:`ChunkScores`).

Everything else (the chunk plan, the causal ranges, deterministic Top-K, expansion, tail,
layout, the collectives) is the pipeline's (:mod:`sp_kpool.pipeline`), identical for every
backend and every sharding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..config import ROW_COST, KPoolConfig
from ..selectors import _radix_selector
from ..settings import Settings, current_settings

if TYPE_CHECKING:  # the sharding sits above the backend interface (it calls the pipeline)
    from ..sharding import ShardedSequence

__all__ = ["Problem", "Backend", "Pools", "Queries", "ChunkScores", "PoolInputs", "QueryInputs", "MAX_CHUNK_ROWS",
           "budget_chunk_rows", "round_rows", "fold_bf16_weights"]  # fmt: skip

#: Upper bound on the rows of one scoring chunk (larger chunks gain nothing on CPU).
MAX_CHUNK_ROWS = 512


def round_rows(rows: int) -> int:
    """``rows`` rounded down to a multiple of 128 when >= 128 (whole kernel row groups)."""
    return int(rows // 128 * 128 if rows >= 128 else max(1, rows))


@dataclass(frozen=True)
class Problem:
    """One call of the operator, as a backend sees it (a frozen record: the pipeline builds
    a new one with ``dataclasses.replace`` after the gather).

    q: ``[S_local, H, D]`` local queries; head_weights: ``[S_local, H]`` raw gate output;
    k, gates: ``[S, D]`` gathered over the group (``S`` the padded global length), or this
    rank's ``[S_local, D]`` shards with ``gather="pools"``; ape: ``[K, D]``; seq: the
    sharding; config: the call's :class:`~sp_kpool.config.KPoolConfig`, resolved
    (``precision`` and ``max_logits_bytes`` set); settings: the process settings.
    What the pipeline records while it runs (stage times, a fused selector's counters)
    travels next to it, in the call's :class:`~sp_kpool.timing.RunRecord`.
    """

    q: torch.Tensor
    head_weights: torch.Tensor
    k: torch.Tensor
    gates: torch.Tensor
    ape: torch.Tensor
    seq: ShardedSequence
    config: KPoolConfig
    settings: Settings = field(default_factory=current_settings)

    @property
    def topk(self) -> int:
        return self.config.topk

    @property
    def kpool(self) -> int:
        return self.config.kpool

    @property
    def tail(self) -> str:
        return self.config.tail

    @property
    def order(self) -> str:
        return self.config.order

    @property
    def alignment(self) -> int:
        return self.config.alignment

    @property
    def precision(self) -> str:
        return self.config.precision

    @property
    def max_logits_bytes(self) -> int:
        return self.config.max_logits_bytes

    @property
    def heads(self) -> int:
        return self.q.shape[1]

    @property
    def head_dim(self) -> int:
        return self.q.shape[2]

    @property
    def device(self) -> torch.device:
        return self.q.device


@dataclass(frozen=True)
class Pools:
    """Pooled keys of the complete pools: ``keys [P, D]`` (the key dtype in the BF16
    modes; ``float8_e4m3fn`` in ``fp8``) and ``scales [P]`` float32 (``fp8``) or ``None``."""

    keys: torch.Tensor
    scales: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.keys.shape[0]

    def parts(self) -> list[torch.Tensor]:
        """The tensors, for a collective (see :meth:`from_parts`)."""
        return [self.keys] if self.scales is None else [self.keys, self.scales]

    @classmethod
    def from_parts(cls, parts) -> "Pools":
        return cls(*parts)

    def __getitem__(self, rows: slice) -> "Pools":
        return Pools(self.keys[rows], None if self.scales is None else self.scales[rows])


@dataclass(frozen=True)
class PoolInputs:
    """What pooling reads: key and gate rows ``k``, ``gates`` ``[S', D]``, the row of each
    pool's slot 0, ``pool_tok_start [P]`` int64, and ``extend [P]`` bool, the pools that the
    serving arithmetics compress in the extend order (``None``: none), on the rows' device."""

    k: torch.Tensor
    gates: torch.Tensor
    pool_tok_start: torch.Tensor
    extend: torch.Tensor | None = None


@dataclass(frozen=True)
class QueryInputs:
    """Query rows to prepare: ``q [n, H, D]`` and raw head weights ``w [n, H]`` of the global
    rows ``[row, row + n)``, and the zero rows that would cover the plan's chunks: ``before``
    in front, ``after`` behind. A backend that lays them around its output (in place, as
    the FP8 query kernel does) lets every chunk be scored from a view; one that does not
    has its partial chunks copied with zero rows."""

    q: torch.Tensor
    w: torch.Tensor
    row: int
    before: int = 0
    after: int = 0


@dataclass(frozen=True)
class Queries:
    """Prepared query rows: ``q``, ``w`` in the backend's representation (torch: as given;
    fp8: rotated E4M3 queries ``[n', H, D]`` and folded FP32 weights ``[n', H]``), row ``i``
    being the global row ``first + i``. Row ``i`` depends on input row ``i`` only, and a
    zero input row gives a zero row."""

    q: Any
    w: Any
    first: int

    def rows(self, a: int, b: int) -> tuple[Any, Any]:
        """Rows ``[a, b)`` of ``q`` and ``w`` (positions, not global rows)."""
        return self.q[a:b], self.w[a:b]


@dataclass(frozen=True)
class ChunkScores:
    """FP32 scores of one chunk: ``scores [C, N]``; column ``c`` of row ``r`` is pool
    ``lo + c`` or, with ``col_offset [C]`` int64 (request-local columns), pool
    ``lo + col_offset[r] + c``. ``masked``: cells outside each row's range are ``-inf``, or
    may be left unwritten because the selector reads only the ranges
    (:func:`sp_kpool.selection.reads_row_ranges_only`); otherwise they hold anything and
    the pipeline masks them."""

    scores: torch.Tensor
    col_offset: torch.Tensor | None = None
    masked: bool = False


def fold_bf16_weights(w: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """The BF16 GPU scorers' head weights: ``w [n, H]`` (the raw gate output, any float dtype)
    times ``H^-0.5 * D^-0.5`` (one Python float, applied in FP32), ``[n, H]`` float32. ReLU
    commutes with the positive ``D^-0.5`` (contract §3), so the scorers take it here once."""
    return w.float() * (heads**-0.5 * dim**-0.5)


def budget_chunk_rows(problem: Problem, num_pools: int, bytes_per_cell: int, max_rows: int = MAX_CHUNK_ROWS) -> int:
    """Rows per scoring chunk that fit the logits budget at ``bytes_per_cell`` bytes per
    (row, pool) cell, from global quantities only (a multiple of 128 when at least 128
    rows fit; ``ValueError`` naming ``max_logits_bytes`` when not one row fits)."""
    per_row = max(1, num_pools) * bytes_per_cell
    rows = problem.max_logits_bytes // per_row
    if rows < 1:
        raise ValueError(
            f"max_logits_bytes: expected at least {per_row} (one query row against {num_pools} pools "
            f"at {bytes_per_cell} bytes per cell), got {problem.max_logits_bytes}"
        )
    return round_rows(min(rows, max_rows, problem.seq.num_real_tokens))


class Backend:
    """Interface of a backend. Subclasses set ``name``, ``precisions`` and ``priority`` and
    implement :meth:`prepare` and :meth:`score`; the pipeline calls nothing else of theirs
    besides :meth:`not_supported_reasons` and :meth:`chunk_rows`."""

    name: str = "?"
    #: Arithmetic modes this backend implements exactly.
    precisions: tuple[str, ...] = ()
    #: Higher runs first under ``backend="auto"``.
    priority: int = 0
    #: Upper bound on the rows of one scoring chunk.
    max_chunk_rows: int = MAX_CHUNK_ROWS
    #: Per-row constant of the balance work model, in (row, pool) scores (see
    #: :mod:`sp_kpool.balance`): a row's fixed cost besides its visible pools.
    balance_row_cost: int = ROW_COST
    #: ``True``: every score cell is a function of its row's prepared inputs, its pool and the
    #: heads only, never of the call's other rows or of the row's position in the call (the
    #: Triton scorer and DeepGEMM: one dot product and one head chain per cell). The pipeline
    #: then scores a chunk that this rank covers only in part from a view of its rows here,
    #: and asks :meth:`prepare` for no zero rows around them. ``False`` (a BLAS ``matmul``,
    #: whose sum order may depend on the call's shape): such a chunk is scored as ``C`` rows,
    #: the others zero rows, so every rank makes the same call for it.
    row_local_scores: bool = False

    def scores_row_subsets(self, device: torch.device) -> bool:
        """Whether a cell's bits depend only on its row's prepared inputs, its pool, the heads
        and the pool range of its chunk of the global grid, never on which other rows of that
        chunk are in the call or where: then ``kpool_topk(rows=)`` scores only the rows asked
        for (:func:`sp_kpool.plan.plan_rows`). True with :attr:`row_local_scores`."""
        return self.row_local_scores

    def not_supported_reasons(self, problem: Problem) -> list[str]:
        """Why this backend cannot run ``problem`` (empty list: it can)."""
        reasons = []
        if problem.precision not in self.precisions:
            reasons.append(f"precision {problem.precision!r} not implemented (has {list(self.precisions)})")
        if problem.order == "serving":
            k = problem.topk // problem.kpool
            if problem.device.type != "cuda":
                reasons.append(f"order 'serving' needs the CUDA serving selector, inputs are on {problem.device}")
            elif k not in (512, 2048):
                reasons.append(f"order 'serving' needs topk // kpool in (512, 2048), got {k}")
            elif _radix_selector(k) is None:
                reasons.append("order 'serving' needs lmdeploy's sparse_index_topk (pip install 'sp-kpool[serving]')")
        return reasons

    def score_bytes_per_cell(self, problem: Problem) -> int:
        """Bytes of scratch per (row, pool) cell that one scoring call allocates."""
        return 4

    def chunk_rows(self, problem: Problem, num_pools: int) -> int:
        """Rows per scoring chunk, from global quantities only (same on every rank)."""
        return budget_chunk_rows(problem, num_pools, self.score_bytes_per_cell(problem), self.max_chunk_rows)

    def prepare(self, problem: Problem, pools: PoolInputs | None, queries: QueryInputs | None
                ) -> tuple[Pools | None, Queries | None]:  # fmt: skip
        """Pool ``pools`` (``None``: no pooling) and prepare ``queries`` (``None``: none),
        in one step where the backend can; returns ``(Pools | None, Queries | None)``, each
        equal bit for bit to what the step alone gives."""
        raise NotImplementedError

    def pools(self, problem: Problem, pool_tok_start: torch.Tensor, extend: torch.Tensor | None = None) -> Pools:
        """The pools of ``problem.k`` / ``problem.gates`` whose slot 0 is at rows
        ``pool_tok_start [P]`` (``int64`` on the device; ``extend``: see
        :class:`PoolInputs`): :meth:`prepare` without queries."""
        return self.prepare(problem, PoolInputs(problem.k, problem.gates, pool_tok_start, extend), None)[0]

    def score(self, problem: Problem, pools: Pools, q: Any, w: Any, lo: int, hi: int, starts: torch.Tensor,
              ends: torch.Tensor) -> ChunkScores:  # fmt: skip
        """Scores of the chunk of prepared rows ``q``, ``w`` (``C`` rows of a
        :class:`Queries`) against pools ``lo .. hi - 1``. ``starts``/``ends`` (``[C]`` int32,
        relative to ``lo``) give each row's visible columns; a backend may skip the rest."""
        raise NotImplementedError
