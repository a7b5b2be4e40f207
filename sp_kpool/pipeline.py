"""The operator's data path, top to bottom (what :func:`sp_kpool.kpool_topk` runs).

:func:`run` lists the stages in data order, one function each:

1. **validate and agree** (:func:`validate_and_agree`): local checks, the config resolved
   against the settings, the backend resolved, the balance partition and the scoring
   chunk computed from global quantities; then one small all-gather checks that every
   rank agrees (or every rank raises the same error) before any data moves;
2. **gather**: keys and gates all-gathered into real-row order (``gather="keys"``), or
   pools built by the owner of their first token and their pooled keys all-gathered
   (``gather="pools"``, :mod:`sp_kpool.pool_gather`);
3. **partition**: with ``balance="causal"`` the query rows move to the rank that scores
   them (:mod:`sp_kpool.balance`);
4. **plan**: the chunk grid of the rows scored here and its tables (:mod:`sp_kpool.plan`;
   one span of rows in the contiguous layout, one per group of nearby runs in the
   interleaved ones);
5. **pool and prepare**: the backend's pools (unless gathered) and prepared query rows,
   in one step (:meth:`~sp_kpool.backends.base.Backend.prepare`);
6. **score and select**: chunk by chunk (:mod:`sp_kpool.scoring`);
7. **route back**: selected pools return to the rows' owners (balanced calls only);
8. **expand**: pools to token ids, the tail, the column layout
   (:func:`sp_kpool.selection.assemble`); in layouts other than the contiguous one, the
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
  kernel), and the FP8 query kernel writes the zero rows of the chunk grid itself, so
  chunks are scored from views (no padded copies);
* chunks scored from views are launched first; the output rows are allocated after the
  first scoring launch, and the rows' metadata (small kernels) after the last;
* the selector writes straight into the output rows and needs no host synchronisation.
"""

from __future__ import annotations

import dataclasses
import zlib

import torch

from .backends import resolve_backend
from .backends.base import Backend, PoolInputs, Pools, Problem, Queries, QueryInputs
from .balance import (
    CausalPartition,
    causal_partition,
    move_queries,
    owned_work,
    route_pools,
    row_work_prefix,
)
from .checks import check_float_tensor
from ._device import to_device
from .comm import CommStats, agree_or_raise, gather_keys, real_order, take_rows
from .config import KPoolConfig, RunOptions, split_keywords
from .layouts import LAYOUTS
from .plan import ChunkPlan, Span, plan_chunks, row_spans
from .pool_gather import gather_pools, pool_owners, pool_shards
from .pooling import pool_table
from .scoring import select_chunks
from .selection import assemble, row_meta
from .settings import Settings, current_settings
from .sharding import ShardedSequence
from .timing import stage

__all__ = [
    "run", "run_gathered", "solve", "validate_and_agree", "fail_on_every_rank", "Call", "Computed", "num_pools",
]  # fmt: skip

# names of the signature entries when a rank has no valid config (its error is reported
# first): the records' own entries, so that every rank's vector has the same length
_CONFIG_SIGNATURE = tuple(e[0] for e in KPoolConfig(topk=1, kpool=1).signature())
_OPTIONS_SIGNATURE = tuple(e[0] for e in RunOptions().signature())
_DERIVED_SIGNATURE = ("backend (resolved, crc32)", "scoring chunk rows", "balance partition (crc32)",
                      "check_finite (resolved)")  # fmt: skip
#: The output ``[S_local, width]`` int32 is refused above this many entries when ``topk``
#: exceeds the longest document (every column past it is ``-1``: a mistaken ``topk``).
MAX_PADDED_OUTPUT_ENTRIES = 2**31 - 1


@dataclasses.dataclass
class Call:
    """One validated call: the problem, the resolved backend and options, the scoring
    chunk rows ``C`` (``None`` without pools), the number of pools, the balance partition
    (``None`` unless ``balance="causal"`` with several ranks) and the bytes counter."""

    problem: Problem
    backend: Backend
    options: RunOptions
    chunk: int | None
    pools: int
    partition: CausalPartition | None
    counter: CommStats | None
    check_finite: bool = False

    @property
    def balanced(self) -> bool:
        return self.partition is not None and self.partition.applied


def num_pools(seq: ShardedSequence, kpool: int) -> int:
    """Complete pools of the real documents (host arithmetic)."""
    cu = seq.real_cu_seq_lens.tolist()
    return sum((b - a) // kpool for a, b in zip(cu, cu[1:]))


def _check_seq(seq) -> None:
    """``seq`` is a consistent ``ShardedSequence`` of the process group it names: its world
    size and rank are the group's (a rank that built it with another rank would return
    that rank's rows)."""
    if not isinstance(seq, ShardedSequence):
        raise TypeError(f"seq: expected a ShardedSequence, got {type(seq).__name__}")
    if seq.is_contiguous:
        if seq.shard_start != seq.rank * seq.shard_size or seq.total_length != seq.world_size * seq.shard_size:
            raise ValueError(f"seq: expected shard_start = rank * shard_size and {seq.world_size} shards of "
                             f"{seq.shard_size} rows covering cu_seq_lens, got {seq!r}")  # fmt: skip
    else:
        counts = [p.numel() for p in seq.rank_positions]
        if len(counts) != seq.world_size or counts[seq.rank] != seq.shard_size or sum(counts) != seq.total_length:
            raise ValueError(f"seq: expected {seq.world_size} ranks' positions covering the {seq.total_length} stream "
                             f"positions, {seq.shard_size} of them this rank's, got {counts} ({seq!r})")  # fmt: skip
    if seq.world_size == 1 and seq.group is None:
        return  # world size 1 without a group: a local call
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"seq: world size {seq.world_size} (or a group) needs an initialized torch.distributed "
                         f"process group, and none is")  # fmt: skip
    world, rank = dist.get_world_size(seq.group), dist.get_rank(seq.group)
    if seq.world_size != world:
        raise ValueError(f"seq.world_size: expected {world} (dist.get_world_size(seq.group)), got {seq.world_size}")
    if seq.rank != rank:
        raise ValueError(f"seq.rank: expected {rank} (dist.get_rank(seq.group)), got {seq.rank}")


@dataclasses.dataclass(frozen=True)
class _Ranks:
    """The process group an agreement runs over, as the group itself reports it."""

    group: object
    rank: int
    world_size: int


def _ranks_of(seq) -> _Ranks | None:
    """Who takes part in the agreement of a call with ``seq``: the group of ``seq`` (its own
    size and rank, whatever ``seq`` claims), the default group when ``seq`` is no
    ``ShardedSequence`` and ``torch.distributed`` runs several ranks (so that the other
    ranks do not wait forever), or ``None``: a local call (world size 1 without a group)."""
    import torch.distributed as dist

    running = dist.is_available() and dist.is_initialized()
    if isinstance(seq, ShardedSequence):
        if not running or (seq.world_size == 1 and seq.group is None):
            return None
        group = seq.group
    elif running and dist.get_world_size() > 1:
        group = None
    else:
        return None
    world = dist.get_world_size(group)
    return _Ranks(group, dist.get_rank(group), world) if world > 1 else None


def _check_output_size(seq: ShardedSequence, config: KPoolConfig) -> None:
    """Refuse, before any allocation, an output that is mostly ``-1`` columns and too large:
    ``topk`` beyond the longest document with more than
    :data:`MAX_PADDED_OUTPUT_ENTRIES` output entries (global quantities: every rank alike)."""
    cu = seq.real_cu_seq_lens
    longest = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    entries = seq.shard_size * config.width
    if config.topk > longest and entries > MAX_PADDED_OUTPUT_ENTRIES:
        raise ValueError(
            f"topk: expected at most the longest document ({longest} tokens) for an output this large, got "
            f"{config.topk}: the output [{seq.shard_size}, {config.width}] int32 would take "
            f"{4 * entries / 2**30:.1f} GiB, every column past {longest + config.kpool - 1} being -1"
        )


def _check_finite(tensors: dict, seq: ShardedSequence) -> None:
    """``ValueError`` naming the first input tensor with a NaN or an infinity in a real row
    (padding rows are never read), its first such row and value: one device-to-host read."""
    local = seq.storage_index()  # the real rows' storage rows, in real-row order
    found = []
    for name, t in tensors.items():
        rows = t if name == "ape" else take_rows(t, local)
        if rows.numel() == 0:
            found.append(torch.full((2,), -1.0, dtype=torch.float64, device=t.device))
            continue
        flat = rows.reshape(-1)
        bad = ~torch.isfinite(flat)
        first = bad.to(torch.int64).argmax()  # the first non-finite element (0 if none)
        per_row = flat.numel() // rows.shape[0]
        row = torch.where(bad.any(), first // per_row, -1)
        found.append(torch.stack([row.to(torch.float64), flat[first].to(torch.float64)]))
    for name, (row, value) in zip(tensors, torch.stack(found).tolist()):
        if row >= 0:
            at = int(local[int(row)]) if name != "ape" else 0
            where = f"slot {int(row)}" if name == "ape" else (
                f"local row {at} (stream position {int(seq.positions[at])}) on rank {seq.rank}")  # fmt: skip
            raise ValueError(f"{name}: expected finite values (check_finite), got {value} in {where}")


def _validate(q, k, gates, head_weights, ape, seq, config, options, keywords, settings, stats) -> Call:
    """Local checks, in argument order; raises on the first problem found."""
    _check_seq(seq)
    config, options = split_keywords(config, options, keywords)
    if settings is None:
        settings = current_settings()
    elif not isinstance(settings, Settings):
        raise TypeError(f"settings: expected a Settings, got {type(settings).__name__}")
    settings.check()  # an environment variable that could not be read: every rank raises it
    if stats is not None and not isinstance(stats, dict):
        raise TypeError(f"stats: expected a dict or None, got {type(stats).__name__}")
    check_float_tensor("q", q, (None, None, None))
    S, H, D = q.shape
    if S != seq.shard_size:
        raise ValueError(
            f"q: expected {seq.shard_size} local rows (seq.shard_size of rank {seq.rank}/{seq.world_size}), got {S}"
        )
    if H < 1 or D < 1:
        raise ValueError(f"q: expected H >= 1 and D >= 1, got shape {list(q.shape)}")
    dev = q.device
    config = config.resolve(settings, dev)
    check_float_tensor("k", k, (S, D), dev)
    check_float_tensor("gates", gates, (S, D), dev)
    check_float_tensor("head_weights", head_weights, (S, H), dev)
    check_float_tensor("ape", ape, (config.kpool, D), dev)
    _check_output_size(seq, config)
    problem = Problem(q=q, head_weights=head_weights, k=k, gates=gates, ape=ape, seq=seq, config=config,
                      settings=settings)  # fmt: skip
    call = _call(problem, options, CommStats() if stats is not None else None)
    call.check_finite = settings.check_finite if options.check_finite is None else options.check_finite
    if call.check_finite:
        _check_finite({"q": q, "k": k, "gates": gates, "head_weights": head_weights, "ape": ape}, seq)
    return call


def _call(problem: Problem, options: RunOptions, counter: CommStats | None = None) -> Call:
    """The backend, the scoring chunk and the balance partition of ``problem``, from global
    quantities only (the same on every rank)."""
    seq, config = problem.seq, problem.config
    backend = resolve_backend(options.backend, problem)
    P = num_pools(seq, config.kpool)
    # the logits budget against global quantities, here, so that every rank raises alike
    # (a rank whose shard holds only padding never reaches the scoring chunks)
    chunk = backend.chunk_rows(problem, P) if P else None
    part = None
    if options.balance == "causal" and seq.world_size > 1:
        block = options.balance_block
        if block is None:  # global quantities only: the same on every rank
            block = chunk if chunk is not None else backend.chunk_rows(problem, 0)
        row_cost = options.balance_row_cost
        if row_cost is None:
            row_cost = backend.balance_row_cost
        if P >= 2**31:
            raise ValueError(f"balance: at most 2**31 - 1 pools supported, got {P}")
        owned = None if seq.is_contiguous else owned_work(seq, config.kpool, row_cost)
        part = causal_partition(
            seq.real_cu_seq_lens, kpool=config.kpool, world_size=seq.world_size,
            shard_size=-(-seq.num_real_tokens // seq.world_size) if owned else seq.shard_size, block=block,
            row_cost=row_cost, owned=owned,
        )  # fmt: skip
    return Call(problem, backend, options, chunk, P, part, counter)


LAYOUT_CODES = {name: i for i, name in enumerate(LAYOUTS + ("positions",))}
LAYOUT_NAMES = {-1: "no ShardedSequence", -2: "another layout", **{i: name for name, i in LAYOUT_CODES.items()}}

#: dtypes and device types as codes of the agreement (-1: not a tensor, -2: another one)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.int64, torch.int32)
_DTYPE_NAMES = {-1: "not a tensor", -2: "another dtype", **{i: str(d).replace("torch.", "") for i, d in enumerate(_DTYPES)}}
_DEVICE_TYPES = ("cpu", "cuda", "meta")
_DEVICE_NAMES = {-1: "not a tensor", -2: "another device type", **dict(enumerate(_DEVICE_TYPES))}


def _tensor_signature(tensors: dict) -> list[tuple]:
    """The dtype and device type of every input tensor: ranks that differ in them would
    exchange buffers of other sizes (gloo aborts the process, NCCL may hang)."""
    sig = []
    for name, t in tensors.items():
        is_t = isinstance(t, torch.Tensor)
        dtype = (_DTYPES.index(t.dtype) if t.dtype in _DTYPES else -2) if is_t else -1
        dev = (_DEVICE_TYPES.index(t.device.type) if t.device.type in _DEVICE_TYPES else -2) if is_t else -1
        sig += [(f"{name}.dtype", dtype, _DTYPE_NAMES), (f"{name}.device type", dev, _DEVICE_NAMES)]
    return sig


def _signature(q, seq, call: Call | None, tensors: dict) -> list[tuple]:
    """Integers that must agree on every rank (checked by one small all-gather); the same
    entries, in the same order, whatever the inputs (``-1`` where a value is missing)."""
    is_seq = isinstance(seq, ShardedSequence)
    three = isinstance(q, torch.Tensor) and q.dim() == 3
    sig = _tensor_signature(tensors) + [
        ("cu_seq_lens (crc32)", zlib.crc32(seq.cu_seq_lens.numpy().tobytes()) if is_seq else -1),
        ("len(cu_seq_lens)", seq.cu_seq_lens.numel() if is_seq else -1),
        ("layout", LAYOUT_CODES.get(seq.layout, -2) if is_seq else -1, LAYOUT_NAMES),
        ("rows per rank (crc32)", seq.layout_crc if is_seq else -1),
        ("world_size", seq.world_size if is_seq else -1),
        ("prompt_lens (crc32)", zlib.crc32(repr(seq.prompt_lens).encode()) if is_seq else -1),
        ("q.shape[1] (H)", q.shape[1] if three else -1),
        ("q.shape[2] (D)", q.shape[2] if three else -1),
    ]
    if call is None:
        sig += [(name, -1) for name in _CONFIG_SIGNATURE + _OPTIONS_SIGNATURE]
        return sig + [(name, -1) for name in _DERIVED_SIGNATURE]
    sig += call.problem.config.signature() + call.options.signature()
    part = call.partition
    return sig + [
        ("backend (resolved, crc32)", zlib.crc32(call.backend.name.encode())),
        # derived from per-process settings too (e.g. the DeepGEMM column layout): ranks
        # that resolved them differently would score other chunks or exchange other rows
        ("scoring chunk rows", call.chunk if call.chunk is not None else -1),
        ("balance partition (crc32)", zlib.crc32(repr(part.bounds).encode()) if part is not None else -1),
        ("check_finite (resolved)", int(call.check_finite), {0: False, 1: True}),
    ]


def validate_and_agree(q, k, gates, head_weights, ape, seq, config: KPoolConfig | None, options: RunOptions | None,
                       keywords: dict, settings: Settings | None, stats: dict | None) -> Call:  # fmt: skip
    """Stage 1: the validated :class:`Call`, agreed on by every rank. ``config`` and
    ``options`` may be ``None`` and are then built from ``keywords`` (the keyword form of
    :func:`sp_kpool.kpool_topk`).

    Error rule: a local check raises ``TypeError`` or ``ValueError`` naming the argument.
    With world size 1 that error is raised as is. With several ranks (the group of
    ``seq``; the default group when ``seq`` is not a ``ShardedSequence``) bad input on any
    rank, or ranks that disagree on a value they must share (dtypes and devices, shapes,
    options, resolved defaults, the sequence), make every rank raise an exception of the
    same type with the same message, naming the argument, the ranks and their values,
    before any data moves (:func:`sp_kpool.comm.agree_or_raise`). The agreement waits at
    most ``settings.comm_timeout`` seconds for the other ranks (``TimeoutError``)."""
    error = call = None
    try:
        call = _validate(q, k, gates, head_weights, ape, seq, config, options, keywords, settings, stats)
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it, whatever it is
        error = exc
    tensors = {"q": q, "k": k, "gates": gates, "head_weights": head_weights, "ape": ape}
    _agree(seq, error, _signature(q, seq, call, tensors), settings, call.counter if call is not None else None)
    if stats is not None:  # the stages time themselves (device synchronized) into this dict
        call.problem.stage_times = {}
    return call


def fail_on_every_rank(seq, error: Exception, settings: Settings | None = None) -> None:
    """Raise ``error`` on every rank of the call with ``seq``: what a rank calls instead of
    :func:`validate_and_agree` when it failed before it had the operator's inputs (e.g.
    ``KPoolIndexer.prepare``), while the other ranks are in their agreement. With world
    size 1 (or no group) ``error`` itself is raised."""
    _agree(seq, error, _signature(None, seq, None, dict.fromkeys(("q", "k", "gates", "head_weights", "ape"))),
           settings, None)  # fmt: skip
    raise error  # not reached: the agreement raised it


def _agree(seq, error: Exception | None, signature: list[tuple], settings, counter: CommStats | None) -> None:
    ranks = _ranks_of(seq)
    if ranks is None:  # a local call: the error as it is
        if error is not None:
            raise error
        return
    if not isinstance(settings, Settings):
        settings = current_settings()
    agree_or_raise(ranks, error, signature, stats=counter, timeout=settings.comm_timeout)


@torch.no_grad()
def run(q, k, gates, head_weights, ape, seq, config: KPoolConfig | None = None, options: RunOptions | None = None, *,
        keywords: dict | None = None, settings: Settings | None = None, stats: dict | None = None) -> torch.Tensor:
    """Selected global token ids ``[S_local, config.width]`` int32 (see
    :func:`sp_kpool.kpool_topk` for the arguments)."""
    call = validate_and_agree(q, k, gates, head_weights, ape, seq, config, options, keywords or {}, settings, stats)
    problem, backend, counter, options = call.problem, call.backend, call.counter, call.options
    pooled = None
    if options.gather == "keys":  # 2. gather
        with stage(problem, "gather"):
            timeout = problem.settings.comm_timeout
            k_all, gates_all = gather_keys(k, seq, counter, timeout), gather_keys(gates, seq, counter, timeout)
        problem = dataclasses.replace(problem, k=k_all, gates=gates_all)
    elif call.pools:  # problem.k / gates stay this rank's shards: with pools gathered, nothing reads them
        pooled = gather_pools(backend, problem, pool_table(seq.real_cu_seq_lens, problem.kpool)[0], stats=counter)
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
    problem, backend, counter, seq = call.problem, call.backend, call.counter, call.problem.seq
    device, C = problem.device, call.chunk or 1
    q, head_weights = problem.q, problem.head_weights
    owned = seq.real_rows()  # this rank's real rows, ascending (its storage order: seq.storage_index())
    if call.balanced:  # 3. partition: this rank scores the rows of its compute range
        computed = call.partition.ranges
        with stage(problem, "balance_exchange"):
            q_rows, w_rows = move_queries(problem, computed, counter)
        spans = [Span(*computed[seq.rank])]
    elif seq.is_contiguous:  # the real rows are the first rows of the shard
        q_rows, w_rows = q[: owned.numel()], head_weights[: owned.numel()]
        spans = row_spans(seq.runs, C)
    else:
        q_rows, w_rows = take_rows(q, seq.storage_index()), take_rows(head_weights, seq.storage_index())
        spans = seq.__dict__.setdefault("_spans", {})  # per chunk rows, on the sequence (a loop over the runs)
        if C not in spans:
            spans[C] = row_spans(seq.runs, C, seq.real_rows())
        spans = spans[C]
    k_sel = problem.topk // problem.kpool
    pools, queries, parts, offset, done = pooled, None, [], 0, []
    for span in spans or [Span(0, 0)]:
        plan = plan_chunks(seq, problem.kpool, C, span.lo, span.hi, device, runs=span.runs,
                           cache=problem.settings.table_cache)  # 4. plan  # fmt: skip
        n = span.rows
        if not plan.chunks:  # no rows scored here, or no complete pool at all
            parts.append(torch.full((n, k_sel), -1, dtype=torch.int32, device=device))
            offset += n
            done.append((plan, None))
            continue
        with stage(problem, "pool"):  # 5. pool and prepare
            pool_in = None if pools is not None else PoolInputs(problem.k, problem.gates, plan.pool_tok_start,
                                                                plan.extend)  # fmt: skip
            q_span, w_span = span.lay(q_rows[offset : offset + n]), span.lay(w_rows[offset : offset + n])
            built, queries = backend.prepare(problem, pool_in, QueryInputs(q_span, w_span, span.lo, *plan.padding()))
        pools = pools if pools is not None else built
        selected = select_chunks(backend, problem, pools, queries, plan)  # 6. score and select
        parts.append(span.pick(selected))
        offset += n
        done.append((plan, queries))
    selected = parts[0] if len(parts) == 1 else torch.cat(parts)
    if call.balanced:  # 7. route back
        with stage(problem, "balance_route"):
            selected = route_pools(problem, selected, computed, counter)
    if seq.is_contiguous and not call.balanced:
        meta = plan.meta
    else:
        meta = row_meta(to_device(owned, device), plan.cu, plan.offs, problem.kpool)
    ids = _expand(problem, selected, meta, plan.pool_tok_start)  # 8. expand
    return Computed(ids, call, pools, queries, plan, done)


def run_gathered(inputs: dict, seq: ShardedSequence, config: KPoolConfig, options: RunOptions | None = None,
                 settings: Settings | None = None) -> Computed:  # fmt: skip
    """One rank's stages 3-8 from inputs already gathered, in this process: ``inputs`` holds
    ``q [S_local, H, D]``, ``head_weights [S_local, H]``, ``ape`` and the keys and gates of
    the **whole** sequence, ``k``/``gates [S, D]`` (the concatenation of every rank's
    rows in rank order, which is what the all-gather returns). Simulations of several ranks and the
    parity replay use it; ``balance`` and ``gather`` are ignored (they need the ranks),
    and they change no output bit."""
    settings = settings if settings is not None else current_settings()
    config = config.resolve(settings, inputs["q"].device)
    inputs = {**inputs, "k": real_order(inputs["k"], seq), "gates": real_order(inputs["gates"], seq)}
    problem = Problem(**inputs, seq=seq, config=config, settings=settings)
    return solve(problem, (options or RunOptions()).backend)


def solve(problem: Problem, backend: str = "torch") -> Computed:
    """Stages 3-8 of one rank for a :class:`~sp_kpool.backends.base.Problem` that holds the
    gathered keys and gates (``problem.config`` resolved), with the backend named
    ``backend`` (or ``"auto"``), in this process: what :func:`run_gathered` runs, for tests
    and benchmarks that build the problem themselves."""
    return _compute(_call(problem, RunOptions(backend=backend)), None)


def _expand(problem: Problem, selected: torch.Tensor, meta, pool_tok_start: torch.Tensor) -> torch.Tensor:
    """``[S_local, width]`` int32 in storage order: this rank's real rows (``selected``,
    ascending real rows) expanded to stream ids, the padding rows ``-1``."""
    cfg, seq = problem.config, problem.seq
    n = selected.shape[0]
    out = torch.empty((seq.shard_size, cfg.width), dtype=torch.int32, device=problem.device)
    if seq.is_contiguous:  # storage order = real order, padding rows last
        out[n:].fill_(-1)  # assemble writes the others whole
        rows = out[:n]
    else:
        out.fill_(-1)
        rows = torch.empty((n, cfg.width), dtype=torch.int32, device=problem.device)
    if n:
        with stage(problem, "expand"):
            assemble(selected, meta, pool_tok_start, topk=cfg.topk, kpool=cfg.kpool, tail=cfg.tail, order=cfg.order,
                     alignment=cfg.alignment, presorted=True, out=rows)  # fmt: skip
            if not seq.is_contiguous:
                out[to_device(seq.storage_index(), problem.device)] = seq.stream_ids(rows)
    return out


def _pools_built(seq: ShardedSequence, pts: torch.Tensor, kpool: int) -> int:
    """Pools this rank builds with ``gather="pools"``."""
    if seq.is_contiguous:
        return pool_shards(pts, shard_size=seq.shard_size, world_size=seq.world_size, kpool=kpool).counts[seq.rank]
    return pool_owners(pts, seq, kpool).counts[seq.rank]


def _fill_stats(stats: dict, call: Call, computed: Computed) -> None:
    problem, options, part = call.problem, call.options, call.partition
    seq, kpool = problem.seq, problem.kpool
    n = seq.num_real_tokens
    pairs = row_work_prefix(seq.real_cu_seq_lens, kpool, row_cost=0)
    if call.balanced:
        lo, hi = part.bounds[seq.rank], part.bounds[seq.rank + 1]
        scored, causal = (lo, hi), int(pairs[hi] - pairs[lo])
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
        time_s=dict(problem.stage_times),
        partition=part.as_dict() if part is not None else None,
        rows_scored=scored,
        causal_pairs=causal,
        # the (row, pool) cells of the chunk grid scored here, zero rows included
        scored_cells=sum(plan.rows * (c.pool_hi - c.pool_lo) for plan, _ in computed.spans for c in plan.chunks),
        layout=seq.layout,
        pools=int(pts.numel()),
        pools_built=_pools_built(seq, pts, kpool) if options.gather == "pools" else int(pts.numel()),
    )  # fmt: skip
