"""The operator's data path, top to bottom (what :func:`sp_kpool.kpool_topk` runs).

:func:`run` lists the stages in data order, one function each:

1. **validate and agree** (:func:`validate_and_agree`, :mod:`sp_kpool.agreement`): local
   checks, the config resolved against the settings, the backend resolved, the balance
   partition and the scoring chunk computed from global quantities; then one small
   all-gather checks that every rank agrees (or every rank raises the same error) before
   any data moves;
2. **gather**: keys and gates all-gathered into real-row order (``gather="keys"``), or
   pools built by the owner of their first token and their pooled keys all-gathered
   (``gather="pools"``, :mod:`sp_kpool.pool_gather`);
3. **partition**: with ``balance="causal"`` the query rows move to the rank that scores
   them (:mod:`sp_kpool.balance`);
4. **plan**: the chunk grid of the rows scored here and its tables (:mod:`sp_kpool.plan`;
   one span of rows in the contiguous layout, one per group of nearby runs in the
   interleaved ones; the global grid, or for a backend with ``row_local_scores`` equal
   chunks of the span's own, :func:`~sp_kpool.plan.local_chunks`);
5. **pool and prepare**: the backend's pools (unless gathered) and prepared query rows,
   in one step (:meth:`~sp_kpool.backends.base.Backend.prepare`);
6. **score and select**: chunk by chunk (:mod:`sp_kpool.scoring`);
7. **route back**: selected pools return to the rows' owners (balanced calls only);
8. **expand**: pools to token ids, the tail, the column layout
   (:func:`sp_kpool.expansion.assemble`); in layouts other than the contiguous one, the
   ids mapped to stream positions and the rows put back in storage order.

Every layout (:mod:`sp_kpool.layouts`) runs the same stages on the **real rows** (the real
documents packed without padding); :class:`~sp_kpool.sharding.ShardedSequence` maps its
rows and ids between the stream and the real rows.

Host latency
------------
On a GPU the host runs ahead of the device, and a cold call's device waits for the host's
first scoring launch; the stages are arranged so that the host reaches it soon:

* the plan's tables are built by host arithmetic on the document boundaries and copied
  with **one** non-blocking copy (pinned memory: a pageable copy would wait for every
  kernel queued before it), and cached on the sequence, so later layers skip them;
* pools and queries are prepared in one launch where the backend can (FP8: one Triton
  kernel); chunks are scored from views of the prepared rows, no padded copies, on the
  backends with ``row_local_scores`` (their chunks hold rows of this rank's span only);
* chunks scored from views are launched first; the output rows are allocated after the
  first scoring launch, and the rows' metadata (small kernels) after the last;
* the selector writes straight into the output rows and needs no host synchronisation.
"""

from __future__ import annotations

import dataclasses

import torch

from ._device import to_device
from .agreement import Call, call_of, check_rows, fail_on_every_rank, num_pools, validate_and_agree
from .backends.base import PoolInputs, Pools, Problem, Queries, QueryInputs
from .balance import move_queries, route_pools, row_work
from .comm import gather_keys, real_order, take_rows
from .config import KPoolConfig, RunOptions
from .plan import ChunkPlan, Span, plan_chunks, plan_rows, rank_spans, row_spans
from .pool_gather import gather_pools, pool_owners, pool_shards
from .pooling import pool_table
from .scoring import select_chunks
from .expansion import assemble
from .selection import row_meta
from .settings import Settings, current_settings
from .sharding import ShardedSequence, row_runs
from .timing import RunRecord, stage

__all__ = [
    "run", "run_gathered", "solve", "validate_and_agree", "fail_on_every_rank", "Call", "Computed", "RunRecord",
    "num_pools",
]  # fmt: skip

@torch.no_grad()
def run(q, k, gates, head_weights, ape, seq, config: KPoolConfig | None = None, options: RunOptions | None = None, *,
        keywords: dict | None = None, settings: Settings | None = None, stats: dict | None = None,
        rows: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Selected global token ids ``[S_local, config.width]`` int32 (see
    :func:`sp_kpool.kpool_topk` for the arguments)."""
    call = validate_and_agree(q, k, gates, head_weights, ape, seq, config, options, keywords or {}, settings, stats,
                              rows)  # fmt: skip
    problem, backend, counter, options, record = call.problem, call.backend, call.counter, call.options, call.record
    pooled = None
    if options.gather == "keys":  # 2. gather
        with stage(record, "gather", problem.device):
            timeout = problem.settings.comm_timeout
            k_all, gates_all = gather_keys(k, seq, counter, timeout), gather_keys(gates, seq, counter, timeout)
        problem = dataclasses.replace(problem, k=k_all, gates=gates_all)
    elif call.pools:  # problem.k / gates stay this rank's shards: with pools gathered, nothing reads them
        pooled = gather_pools(backend, problem, pool_table(seq.real_cu_seq_lens, problem.kpool)[0], stats=counter,
                              record=record)  # fmt: skip
    computed = _compute(dataclasses.replace(call, problem=problem), pooled)
    if stats is not None:
        _fill_stats(stats, call, computed)
    return computed.ids


@dataclasses.dataclass
class Computed:
    """What stages 3-8 produced on this rank: the output ``ids [S_local, width]`` int32, and
    for inspection (the parity replay) the pools, the prepared query rows and the plan of
    the rows scored here (``pools``/``queries`` ``None`` when nothing was scored; with
    several spans, the last one's, and all of them in ``spans``)."""

    ids: torch.Tensor
    call: Call
    pools: Pools | None
    queries: Queries | None
    plan: ChunkPlan
    #: every span's ``(plan, queries)`` in row order (one unless the layout interleaves)
    spans: list = dataclasses.field(default_factory=list)


def _compute(call: Call, pooled: Pools | None) -> Computed:
    """Stages 3-8 on this rank, after the gather: ``call.problem`` holds the gathered keys
    and gates (``gather="keys"``) or ``pooled`` the gathered pools."""
    problem, backend, counter, seq, record = call.problem, call.backend, call.counter, call.problem.seq, call.record
    device, C = problem.device, call.chunk or 1
    q, head_weights = problem.q, problem.head_weights
    owned = seq.real_rows()  # this rank's real rows, ascending (its storage order: seq.storage_index())
    storage = None  # the storage rows of the rows computed here (None: every real row)
    subset = None  # rows=, on a backend that scores row subsets: the global rows asked for (plan_rows)
    if call.balanced:  # 3. partition: this rank scores the rows of its compute range
        computed = call.partition.ranges
        with stage(record, "balance_exchange", device):
            q_rows, w_rows = move_queries(problem, computed, counter)
        spans = [Span(*computed[seq.rank])]
    elif call.rows is not None:  # rows=: only the rows asked for, in spans of the chunks holding them
        owned, storage = owned[call.rows], seq.storage_index()[call.rows]
        q_rows, w_rows = take_rows(q, storage), take_rows(head_weights, storage)
        if backend.scores_row_subsets(device):  # those rows alone, in one span of their own positions
            subset, spans = owned, [Span(0, owned.numel())]
        else:  # the chunks of the global grid that hold them, the other rows zero rows
            spans = row_spans(row_runs(owned), C, owned)
    else:
        if seq.is_contiguous:  # the real rows are the first rows of the shard
            q_rows, w_rows = q[: owned.numel()], head_weights[: owned.numel()]
        else:
            q_rows, w_rows = take_rows(q, seq.storage_index()), take_rows(head_weights, seq.storage_index())
        spans = rank_spans(seq, C, cache=problem.settings.table_cache)  # per batch, in seq.batch
    k_sel = problem.topk // problem.kpool
    pools, queries, parts, offset, done = pooled, None, [], 0, []
    for span in spans or [Span(0, 0)]:
        if subset is not None:  # 4. plan
            plan = plan_rows(seq, problem.kpool, C, subset, device)
        else:
            plan = plan_chunks(seq, problem.kpool, C, span.lo, span.hi, device, runs=span.runs,
                               cache=problem.settings.table_cache and call.rows is None,
                               row_local=backend.row_local_scores)  # fmt: skip
        n = span.rows
        if not plan.chunks:  # no rows scored here, or no complete pool at all
            parts.append(torch.full((n, k_sel), -1, dtype=torch.int32, device=device))
            offset += n
            done.append((plan, None))
            continue
        with stage(record, "pool", device):  # 5. pool and prepare
            pool_in = None if pools is not None else PoolInputs(problem.k, problem.gates, plan.pool_tok_start,
                                                                plan.extend)  # fmt: skip
            q_span, w_span = span.lay(q_rows[offset : offset + n]), span.lay(w_rows[offset : offset + n])
            built, queries = backend.prepare(problem, pool_in, QueryInputs(q_span, w_span, span.lo, *plan.padding()))
        pools = pools if pools is not None else built
        selected = select_chunks(backend, problem, pools, queries, plan, record)  # 6. score and select
        parts.append(span.pick(selected))
        offset += n
        done.append((plan, queries))
    selected = parts[0] if len(parts) == 1 else torch.cat(parts)
    if call.balanced:  # 7. route back
        with stage(record, "balance_route", device):
            selected = route_pools(problem, selected, computed, counter)
    if seq.is_contiguous and not call.balanced and call.rows is None:
        meta = plan.meta
    else:
        meta = row_meta(to_device(owned, device), plan.cu, plan.offs, problem.kpool)
    ids = _expand(problem, selected, meta, plan.pool_tok_start, record, storage)  # 8. expand
    return Computed(ids, call, pools, queries, plan, done)


def run_gathered(inputs: dict, seq: ShardedSequence, config: KPoolConfig, options: RunOptions | None = None,
                 settings: Settings | None = None, rows: torch.Tensor | None = None) -> Computed:  # fmt: skip
    """One rank's stages 3-8 from inputs already gathered, in this process: ``inputs`` holds
    ``q [S_local, H, D]``, ``head_weights [S_local, H]``, ``ape`` and the keys and gates of
    the **whole** sequence, ``k``/``gates [S, D]`` (the concatenation of every rank's
    rows in rank order, which is what the all-gather returns). Simulations of several ranks and the
    parity replay use it; ``balance`` and ``gather`` are ignored (they need the ranks),
    and they change no output bit. ``rows``: as :func:`sp_kpool.kpool_topk`'s."""
    settings = settings if settings is not None else current_settings()
    config = config.resolve(settings, inputs["q"].device)
    inputs = {**inputs, "k": real_order(inputs["k"], seq), "gates": real_order(inputs["gates"], seq)}
    problem = Problem(**inputs, seq=seq, config=config, settings=settings)
    return solve(problem, (options or RunOptions()).backend, rows=rows)


def solve(problem: Problem, backend: str = "torch", record: RunRecord | None = None, *,
          rows: torch.Tensor | None = None) -> Computed:  # fmt: skip
    """Stages 3-8 of one rank for a :class:`~sp_kpool.backends.base.Problem` that holds the
    gathered keys and gates (``problem.config`` resolved), with the backend named
    ``backend`` (or ``"auto"``), in this process: what :func:`run_gathered` runs, for tests
    and benchmarks that build the problem themselves. ``record``: a
    :class:`~sp_kpool.timing.RunRecord` to fill (``RunRecord(stage_times={})`` times the
    stages; its ``counters`` get a fused selector's counts); ``None``: a fresh one, which
    the result holds (``computed.call.record``). ``rows``: as :func:`sp_kpool.kpool_topk`'s."""
    call = call_of(problem, RunOptions(backend=backend))
    call.rows = check_rows(rows, problem.seq)
    if record is not None:
        call.record = record
    return _compute(call, None)


def _expand(problem: Problem, selected: torch.Tensor, meta, pool_tok_start: torch.Tensor,
            record: RunRecord | None = None, storage: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``[S_local, width]`` int32 in storage order: this rank's real rows (``selected``,
    ascending real rows) expanded to stream ids, the padding rows ``-1``. ``storage``: the
    storage rows of ``selected``'s rows when not every real row is computed (``rows=``;
    the other rows ``-1``)."""
    cfg, seq = problem.config, problem.seq
    n = selected.shape[0]
    out = torch.empty((seq.shard_size, cfg.width), dtype=torch.int32, device=problem.device)
    in_place = seq.is_contiguous and storage is None  # storage order = real order, padding rows last
    if in_place:
        out[n:].fill_(-1)  # assemble writes the others whole
        rows = out[:n]
    else:
        out.fill_(-1)
        rows = torch.empty((n, cfg.width), dtype=torch.int32, device=problem.device)
    if n:
        with stage(record, "expand", problem.device):
            assemble(selected, meta, pool_tok_start, topk=cfg.topk, kpool=cfg.kpool, tail=cfg.tail, order=cfg.order,
                     alignment=cfg.alignment, presorted=True, out=rows)  # fmt: skip
            if not in_place:
                at = seq.storage_index() if storage is None else storage
                out[to_device(at, problem.device)] = seq.stream_ids(rows)
    return out


def _pools_built(seq: ShardedSequence, pts: torch.Tensor, kpool: int) -> int:
    """Pools this rank builds with ``gather="pools"``."""
    if seq.is_contiguous:
        return pool_shards(pts, shard_size=seq.shard_size, world_size=seq.world_size, kpool=kpool).counts[seq.rank]
    return pool_owners(pts, seq, kpool).counts[seq.rank]


def _counters(counters: dict) -> dict:
    """``RunRecord.counters`` with tensors read to Python numbers (``{}``: no fused selector ran)."""
    return {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in counters.items()}


def _scored_cells(spans) -> int:
    """The (row, pool) cells of the scoring calls made here, zero rows included: whole
    chunks, or in a :attr:`~sp_kpool.plan.ChunkPlan.row_local` plan the rows of each chunk
    computed here (:func:`sp_kpool.scoring.chunk_calls`)."""
    total = 0
    for plan, _ in spans:
        for c in plan.chunks:
            a, b = plan.computed(c)
            total += (b - a if plan.row_local else plan.rows) * max(0, c.pool_hi - c.pool_lo)
    return total


def _fill_stats(stats: dict, call: Call, computed: Computed) -> None:
    problem, options, part = call.problem, call.options, call.partition
    seq, kpool = problem.seq, problem.kpool
    n = seq.num_real_tokens
    pairs = row_work(seq, kpool, row_cost=0, cache=problem.settings.table_cache)
    if call.balanced:
        lo, hi = part.bounds[seq.rank], part.bounds[seq.rank + 1]
        scored, causal = (lo, hi), int(pairs[hi] - pairs[lo])
    elif call.rows is not None:  # the rows asked for: their runs and their own causal pairs
        asked = seq.real_rows()[call.rows]
        scored = [list(r) for r in row_runs(asked)]
        work = torch.as_tensor(pairs)
        causal = int((work[asked + 1] - work[asked]).sum()) if asked.numel() else 0
    else:
        scored = [list(r) for r in seq.runs]
        causal = sum(int(pairs[b] - pairs[a]) for a, b in seq.runs)
        if seq.is_contiguous:
            scored = tuple(scored[0]) if scored else (min(seq.shard_start, n),) * 2
    pts = pool_table(seq.real_cu_seq_lens, kpool)[0]
    stats.update(
        gather=options.gather,
        balance=options.balance,
        balance_applied=call.balanced,
        bytes=call.counter.as_dict(),
        time_s=dict(call.record.stage_times),
        selection=_counters(call.record.counters),
        partition=part.as_dict() if part is not None else None,
        rows_scored=scored,
        rows=None if call.rows is None else int(call.rows.sum()),
        causal_pairs=causal,
        scored_cells=_scored_cells(computed.spans),
        layout=seq.layout,
        pools=int(pts.numel()),
        pools_built=_pools_built(seq, pts, kpool) if options.gather == "pools" else int(pts.numel()),
    )  # fmt: skip
