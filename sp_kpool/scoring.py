"""Score and select: the chunks of a :class:`~sp_kpool.plan.ChunkPlan`, one backend call each.

:func:`chunk_calls` lists the scoring calls of a plan (the same for the pipeline and the
parity replay, which records the values the selection ranked), :func:`score_chunk` makes
one, and :func:`select_chunks` turns every chunk's scores into the selected pools of its
rows with the deterministic Top-K of :func:`sp_kpool.selectors.select_pools`, or scores and
selects each chunk in one step where a registered fused selector supports the call
(:func:`sp_kpool.selectors.choose_fused`; the ids are the same bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

from .backends.base import Backend, ChunkScores, Pools, Problem, Queries
from .plan import Chunk, ChunkPlan, pad_rows
from .selectors import choose_fused, select_pools, short_rows_hint
from .timing import RunRecord, stage

__all__ = ["ChunkCall", "chunk_calls", "score_chunk", "select_chunks"]


@dataclass(frozen=True)
class ChunkCall:
    """One scoring call: ``chunk`` of the plan, the rows ``[a, b)`` of it computed here,
    the prepared rows ``q``, ``w`` of the call, and each call row's ``starts``/``ends``
    int32 relative to ``chunk.pool_lo`` (empty for rows not computed here). The call's row
    ``i`` is the chunk's row ``skip + i``: the whole chunk (``skip`` 0, ``C`` rows, the rows
    not computed here zero rows), or, in a :attr:`~sp_kpool.plan.ChunkPlan.row_local`
    plan, only the rows ``[a, b)``.
    ``q`` is ``None`` for a chunk without pools."""

    chunk: Chunk
    a: int
    b: int
    q: Any = None
    w: Any = None
    starts: torch.Tensor | None = None
    ends: torch.Tensor | None = None
    skip: int = 0

    @property
    def rows(self) -> slice:
        """The call rows of ``[a, b)`` (the rows of the call's scores to select from)."""
        return slice(self.a - self.chunk.first - self.skip, self.b - self.chunk.first - self.skip)


def chunk_calls(plan: ChunkPlan, queries: Queries, *, views_first: bool = True) -> Iterator[ChunkCall]:
    """The scoring calls of ``plan`` for the prepared rows ``queries``.

    A chunk whose rows the prepared tensors cover is scored from views of them; the others
    from views of their rows computed here (:attr:`~sp_kpool.plan.ChunkPlan.row_local`),
    or else from zero-padded copies (one host call per tensor) of the chunk's shape. ``views_first``: the chunks
    scored from whole views come first, so the host reaches the first scoring call sooner
    (a cold call's device waits for it); the chunks are independent, so the order changes
    no result. Without it the chunks come in row order (what the parity replay walks)."""
    C, first = plan.rows, queries.first
    ranges = plan.ranges if plan.chunks else None
    p1 = first + queries.q.shape[0]  # the prepared rows are the global rows [first, p1)
    # (a plan of row subsets has chunks of fewer than C rows: views of their rows, below)
    whole = [first <= c.first and c.first + C <= p1 and plan.row_ids is None for c in plan.chunks]
    order = sorted(range(len(whole)), key=lambda i: not whole[i]) if views_first else range(len(whole))
    for i in order:
        c = plan.chunks[i]
        a, b = plan.computed(c)
        if c.pool_hi <= c.pool_lo:
            yield ChunkCall(c, a, b)
            continue
        if whole[i]:  # views, no copies (rows not ours are zero rows of the padding)
            qc, wc = queries.rows(c.first - first, c.first - first + C)
        elif plan.row_local:  # views of the rows here: a cell's bits do not depend on the call's rows
            lo, hi = i * C + a - c.first, i * C + b - c.first
            qc, wc = queries.rows(a - first, b - first)
            yield ChunkCall(c, a, b, qc, wc, ranges[0, lo:hi], ranges[1, lo:hi], skip=a - c.first)
            continue
        else:  # the call has the same shape and row positions whichever rank computes it
            qc, wc = queries.rows(a - first, b - first)
            qc, wc = pad_rows(qc, a - c.first, c.first + C - b), pad_rows(wc, a - c.first, c.first + C - b)
        yield ChunkCall(c, a, b, qc, wc, ranges[0, i * C : (i + 1) * C], ranges[1, i * C : (i + 1) * C])


def score_chunk(backend: Backend, problem: Problem, pools: Pools, call: ChunkCall,
                record: RunRecord | None = None) -> ChunkScores:  # fmt: skip
    """``backend.score`` of one call (timed as the ``score`` stage into ``record``)."""
    c = call.chunk
    with stage(record, "score", problem.device):
        return backend.score(problem, pools, call.q, call.w, c.pool_lo, c.pool_hi, call.starts, call.ends)


def select_chunks(backend: Backend, problem: Problem, pools: Pools, queries: Queries, plan: ChunkPlan,
                  record: RunRecord | None = None) -> torch.Tensor:  # fmt: skip
    """Selected pools ``[hi_row - lo_row, topk // kpool]`` int32 of the plan's rows: global
    pool ids, valid ones first, ``-1`` after; ascending for ``order="ascending"``, by score
    for ``"score"``, the serving selector's order for ``"serving"``. Every element is
    written. Any rank computing a row gets the same ids (see :mod:`sp_kpool.plan`).

    With a fused selector (:func:`~sp_kpool.selectors.choose_fused`) each chunk is scored
    and selected in one step (timed as the ``score`` stage, no ``select`` stage), its
    counters added to ``record.counters``. ``record``: the call's
    :class:`~sp_kpool.timing.RunRecord` (stage times, counters), or ``None``: nothing is
    timed and the counters are dropped."""
    device = problem.device
    fused = choose_fused(backend, problem)
    lo_row, hi_row = plan.lo_row, plan.hi_row
    k_sel = problem.topk // problem.kpool
    out = None
    unscored = []  # rows of chunks without pools
    cu = problem.seq.real_cu_seq_lens.tolist()  # document boundaries (host): the selector's short-row hint
    for call in chunk_calls(plan, queries):
        a, b, c = call.a, call.b, call.chunk
        if call.q is None:
            unscored.append((a, b))
            continue
        if fused is not None:
            if out is None:
                out = torch.empty((hi_row - lo_row, k_sel), dtype=torch.int32, device=device)
            with stage(record, "score", device):
                counts = fused.score_select(backend, problem, pools, call, out[a - lo_row : b - lo_row])
            if record is not None:
                _add_counts(record.counters, fused.name, counts)
            continue
        sc = score_chunk(backend, problem, pools, call, record)
        rows = call.rows
        col0: Any = c.pool_lo
        row_starts, row_ends = call.starts[rows], call.ends[rows]
        if sc.col_offset is not None:  # request-local columns: column j of row r is pool lo + offset[r] + j
            offset = sc.col_offset[rows]
            col0 = c.pool_lo + offset[:, None]
            row_starts, row_ends = row_starts - offset, row_ends - offset
        scores = sc.scores[rows]
        visible = None
        if not sc.masked:
            cols = torch.arange(c.pool_hi - c.pool_lo, device=device)
            visible = (cols[None] >= row_starts[:, None]) & (cols[None] < row_ends[:, None])
        if out is None:  # allocated after the first scoring launch, not before
            out = torch.empty((hi_row - lo_row, k_sel), dtype=torch.int32, device=device)
        short = short_rows_hint(cu, *plan.global_rows(a, b), k_sel, problem.kpool)
        with stage(record, "select", device):
            # straight into this chunk's output rows, every element written
            select_pools(scores, visible, k_sel, col0, row_ends, order=problem.order, starts=row_starts,
                         out=out[a - lo_row : b - lo_row], short_rows=short)  # fmt: skip
        # the chunk's scores die here, not when the next chunk's scores are assigned: only one
        # chunk's logits exist at a time (the next scoring call reuses their memory, on the
        # same stream, after the selector has read them)
        del sc, scores, visible
    if out is None:
        return torch.full((hi_row - lo_row, k_sel), -1, dtype=torch.int32, device=device)
    for a, b in unscored:  # every row lies in one chunk: the others are written above
        out[a - lo_row : b - lo_row].fill_(-1)
    return out


def _add_counts(counters: dict, name: str, counts: dict) -> None:
    """Add a fused selector's per-chunk ``counts`` (ints or 0-d tensors; ``*_max`` keys are
    maxima, the others sums) to ``counters`` (``selector`` names the selector)."""
    counters["selector"] = name
    counters["fused_chunks"] = counters.get("fused_chunks", 0) + 1
    for key, value in counts.items():
        old = counters.get(key)
        if old is None:
            counters[key] = value
        elif key.endswith("_max"):
            tensor = next((t for t in (old, value) if isinstance(t, torch.Tensor)), None)
            if tensor is None:
                counters[key] = max(old, value)
            else:  # on the device: no host synchronisation per chunk
                counters[key] = torch.maximum(torch.as_tensor(old, device=tensor.device),
                                              torch.as_tensor(value, device=tensor.device))  # fmt: skip
        else:
            counters[key] = old + value
