"""Stage 1 of the data path: validate the call and agree on it across ranks.

:func:`validate_and_agree` runs the local checks (argument order; the config resolved
against the settings; the backend, the scoring chunk and the balance partition from global
quantities), then one small all-gather (:func:`sp_kpool.comm.agree_or_raise`) checks that
every rank saw valid input and agrees on everything it must share: dtypes and devices of
every tensor, shapes, options, resolved defaults, the sequence and its layout. Bad input
on any rank makes every rank raise the same exception, before any data moves.
"""

from __future__ import annotations

import dataclasses
import zlib

import torch

from .backends import resolve_backend
from .backends.base import Backend, Problem
from .balance import CausalPartition, owned_work, sequence_partition
from .checks import check_float_tensor
from .comm import CommStats, Listed, agree_or_raise, take_rows, tensor_codes
from .config import KPoolConfig, RunOptions, split_keywords
from .layouts import LAYOUTS
from .settings import Settings, current_settings
from .sharding import ShardedSequence
from .timing import RunRecord

__all__ = ["Call", "num_pools", "validate_and_agree", "check_rows", "fail_on_every_rank", "call_of", "MAX_PADDED_OUTPUT_ENTRIES"]

# names of the signature entries when a rank has no valid config (its error is reported
# first): the records' own entries, so that every rank's vector has the same length
_CONFIG_SIGNATURE = tuple(e[0] for e in KPoolConfig(topk=1, kpool=1).signature())
_ROWS_GIVEN = {-1: "invalid", 0: "None (every row)", 1: "given"}
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
    (``None`` unless ``balance="causal"`` with several ranks), the bytes counter, and the
    :class:`~sp_kpool.timing.RunRecord` the stages fill (stage times, selector counters)."""

    problem: Problem
    backend: Backend
    options: RunOptions
    chunk: int | None
    pools: int
    partition: CausalPartition | None
    counter: CommStats | None
    check_finite: bool = False
    record: RunRecord = dataclasses.field(default_factory=RunRecord)
    #: ``rows=``: which of this rank's real rows (``seq.real_rows()`` order) are computed,
    #: ``[n_real_local]`` bool CPU; ``None``: all of them
    rows: torch.Tensor | None = None

    @property
    def balanced(self) -> bool:
        """The balance partition is applied (never with ``rows=``: it balances the work of
        every row; the scoring chunk stays the balanced call's, so the bits are the same)."""
        return self.partition is not None and self.partition.applied and self.rows is None


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


def _longest_document(seq: ShardedSequence) -> int:
    """Tokens of the sequence's longest real document (0: none)."""
    cu = seq.real_cu_seq_lens
    return int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0


def _check_output_size(seq: ShardedSequence, config: KPoolConfig) -> None:
    """Refuse, before any allocation, an output that is mostly ``-1`` columns and too large:
    ``topk`` beyond the longest document with more than
    :data:`MAX_PADDED_OUTPUT_ENTRIES` output entries (global quantities: every rank alike)."""
    longest = _longest_document(seq)
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


_LAST_DIM = {"q": 2, "k": 1, "gates": 1, "ape": 1}


def _head_dim(tensors: dict) -> tuple[int, list[str]]:
    """The head dim ``D`` that ``q [S, H, D]``, ``k [S, D]``, ``gates [S, D]`` and
    ``ape [K, D]`` must share, and the arguments that set it: the value most of them have
    (a tie: the first in argument order), so that the error names the odd one out (a ``q``
    of another head dim is a ``q`` error, not a ``k`` error)."""
    dims = {n: t.shape[-1] for n, t in tensors.items()
            if isinstance(t, torch.Tensor) and t.dim() == _LAST_DIM[n] + 1}  # fmt: skip
    votes = list(dims.values())
    D = max(votes, key=lambda d: (votes.count(d), -votes.index(d)))
    return D, [n for n, d in dims.items() if d == D]


def _check_dtypes(q, k, gates, head_weights, ape) -> None:
    """The mixed-dtype rule (``docs/contract.md`` section 11): ``q`` and ``k`` meet in the
    scores and must share one dtype (a BF16 ``q`` with FP32 ``k`` would be scored in FP32
    with ``q`` rounded); ``gates``, ``ape`` (taken in FP32 by the slot softmax) and
    ``head_weights`` (applied in FP32) may have any floating dtype."""
    if k.dtype != q.dtype:
        raise TypeError(f"k: expected dtype {q.dtype} (the dtype of q; q and k meet in the scores: cast one "
                        f"of them), got {k.dtype}")  # fmt: skip


def check_rows(rows, seq: ShardedSequence) -> torch.Tensor | None:
    """``rows=`` of :func:`sp_kpool.kpool_topk` as ``[n_real_local]`` bool CPU over this
    rank's real rows (``seq.real_rows()`` order; padding rows asked for are dropped: their
    output is ``-1`` anyway), or ``None``. Accepted: a bool mask ``[S_local]`` or a 1-D
    integer tensor of storage rows in ``[0, S_local)`` (any order, repeats allowed)."""
    if rows is None:
        return None
    S = seq.shard_size
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"rows: expected a bool mask [S_local = {S}] or a 1-D integer tensor of this rank's "
                        f"storage rows, got {type(rows).__name__}")  # fmt: skip
    if rows.dtype.is_floating_point or rows.dtype.is_complex or rows.dim() != 1:
        raise TypeError(f"rows: expected a bool mask [S_local = {S}] or a 1-D integer tensor of this rank's "
                        f"storage rows, got a {rows.dtype} tensor of shape {list(rows.shape)}")  # fmt: skip
    rows = rows.detach().cpu()
    if rows.dtype == torch.bool:
        if rows.numel() != S:
            raise ValueError(f"rows: expected a bool mask of S_local = {S} rows (seq.shard_size of rank "
                             f"{seq.rank}/{seq.world_size}), got {rows.numel()}")  # fmt: skip
        mask = rows
    else:
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= S):
            bad = rows[(rows < 0) | (rows >= S)][0]
            raise ValueError(f"rows: expected storage rows in [0, {S}) (seq.shard_size of rank "
                             f"{seq.rank}/{seq.world_size}), got {int(bad)}")  # fmt: skip
        mask = torch.zeros(S, dtype=torch.bool)
        mask[rows.to(torch.int64)] = True
    return mask[seq.storage_index()]


def _validate(q, k, gates, head_weights, ape, seq, config, options, keywords, settings, stats, subset=None) -> Call:
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
    D, setters = _head_dim({"q": q, "k": k, "gates": gates, "ape": ape})
    rows = "rows: seq.shard_size"

    def because(name: str) -> str:  # the arguments that set D, but for the one checked
        return "D: " + ", ".join(f"{n}.shape[{_LAST_DIM[n]}]" for n in setters if n != name)

    check_float_tensor("q", q, (S, H, D), why=because("q"))
    check_float_tensor("k", k, (S, D), dev, why=f"{rows}; {because('k')}")
    check_float_tensor("gates", gates, (S, D), dev, why=f"{rows}; {because('gates')}")
    check_float_tensor("head_weights", head_weights, (S, H), dev, why=f"{rows}; H: q.shape[1]")
    check_float_tensor("ape", ape, (config.kpool, D), dev, why=f"rows: kpool; {because('ape')}")
    _check_dtypes(q, k, gates, head_weights, ape)
    _check_output_size(seq, config)
    problem = Problem(q=q, head_weights=head_weights, k=k, gates=gates, ape=ape, seq=seq, config=config,
                      settings=settings)  # fmt: skip
    call = call_of(problem, options, CommStats() if stats is not None else None)
    call.rows = check_rows(subset, seq)
    call.check_finite = settings.check_finite if options.check_finite is None else options.check_finite
    if call.check_finite:
        _check_finite({"q": q, "k": k, "gates": gates, "head_weights": head_weights, "ape": ape}, seq)
    return call


def scoring_chunk_rows(backend: Backend, problem: Problem, num_pools: int) -> int:
    """Rows per scoring chunk, from global quantities only (the same on every rank).

    A chunk of ``C`` rows stores logits for its pool range only, which is at most
    ``w(C) = min(P, (C + L - 1) // kpool + 1)`` pools wide (``L``: the longest real
    document: a row sees pools of its own document, and the chunk's first document starts
    at most ``L - 1`` rows before it). With packed short documents that is far below ``P``,
    so the largest ``C`` (a multiple of 128) whose logits at width ``w(C)`` still fit the
    budget is taken: fewer, larger chunks. With one document ``w(C) = P``: the chunk of
    ``backend.chunk_rows(problem, P)``, whose ``ValueError`` (budget below one row) is
    raised first, alike on every rank. Which rows share a chunk never changes a result.
    Not used with ``balance="causal"`` (world size > 1), whose boundaries are multiples of
    the whole-width chunk: a larger block would coarsen the balance. Kept in the ``chunks``
    section of ``seq.batch`` (a search of about ten ``chunk_rows`` evaluations, once per
    batch, not per layer).
    """
    C0 = backend.chunk_rows(problem, num_pools)  # raises alike when not one row fits (every call)
    key = (backend.name, num_pools, problem.config, problem.settings, problem.heads, problem.head_dim, problem.device)
    return problem.seq.batch.get("chunks", key, lambda: _grow_chunk(backend, problem, num_pools, C0),
                                 cache=problem.settings.table_cache)  # fmt: skip


def _grow_chunk(backend: Backend, problem: Problem, num_pools: int, C0: int) -> int:
    """The largest multiple of 128 rows (at least ``C0``) whose logits at the widest chunk's
    width fit the budget (:func:`scoring_chunk_rows`)."""
    L = _longest_document(problem.seq)
    K = problem.config.kpool

    def fits(C: int) -> bool:
        return backend.chunk_rows(problem, max(1, min(num_pools, (C + L - 1) // K + 1))) >= C

    if C0 < 128 or not fits(C0 + 128):
        return C0
    # fits(128 lo); not fits(128 (hi + 1)): chunk_rows is at most num_real_tokens
    lo, hi = C0 // 128 + 1, max(C0 // 128 + 1, problem.seq.num_real_tokens // 128)
    while lo < hi:  # the largest m with fits(128 m)
        mid = (lo + hi + 1) // 2
        if fits(128 * mid):
            lo = mid
        else:
            hi = mid - 1
    return 128 * lo


def call_of(problem: Problem, options: RunOptions, counter: CommStats | None = None) -> Call:
    """The :class:`Call` of a built ``problem``: the backend, the scoring chunk and the balance partition of ``problem``, from global
    quantities only (the same on every rank)."""
    seq, config = problem.seq, problem.config
    backend = resolve_backend(options.backend, problem)
    P = num_pools(seq, config.kpool)
    # the logits budget against global quantities, here, so that every rank raises alike
    # (a rank whose shard holds only padding never reaches the scoring chunks)
    balancing = options.balance == "causal" and seq.world_size > 1
    # the causal balance aligns its boundaries to the chunk: there the whole-width chunk, as
    # before (a larger one would coarsen the balance)
    if P:
        chunk = backend.chunk_rows(problem, P) if balancing else scoring_chunk_rows(backend, problem, P)
    else:
        chunk = None
    part = None
    if balancing:
        block = options.balance_block
        if block is None:  # global quantities only: the same on every rank
            block = chunk if chunk is not None else backend.chunk_rows(problem, 0)
        row_cost = options.balance_row_cost
        if row_cost is None:
            row_cost = backend.balance_row_cost
        if P >= 2**31:
            raise ValueError(f"balance: at most 2**31 - 1 pools supported, got {P}")
        cache = problem.settings.table_cache  # the row work and the partition: once per batch (seq.batch)
        owned = None if seq.is_contiguous else owned_work(seq, config.kpool, row_cost, cache=cache)
        part = sequence_partition(
            seq, kpool=config.kpool, shard_size=-(-seq.num_real_tokens // seq.world_size) if owned else seq.shard_size,
            block=block, row_cost=row_cost, owned=owned, cache=cache,
        )  # fmt: skip
    return Call(problem, backend, options, chunk, P, part, counter)


LAYOUT_CODES = {name: i for i, name in enumerate(LAYOUTS + ("positions",))}
LAYOUT_NAMES = {-1: "no ShardedSequence", -2: "another layout", **{i: name for name, i in LAYOUT_CODES.items()}}


def _rows_listed(seq: ShardedSequence) -> Listed:
    """The rows every rank owns (``seq.rank_positions``, whose digest is ``seq.layout_crc``)
    as one list for the agreement's message: the row counts of the ranks, then each rank's
    positions; an entry named ``positions of rank r [j]`` (or ``rows of rank r``)."""
    world = seq.world_size

    def values() -> torch.Tensor:
        counts = torch.tensor([p.numel() for p in seq.rank_positions], dtype=torch.int64)
        return torch.cat([counts, *(p.to(torch.int64) for p in seq.rank_positions)])

    def label(first: list[int], i: int) -> str:
        if i < world:
            return f"the number of rows of rank {i}"
        j = i - world
        for r, n in enumerate(first[:world]):
            if j < n:
                return f"positions of rank {r} [{j}]"
            j -= n
        return f"rows entry {i}"

    return Listed("rows", values, label)


def _signature(q, seq, call: Call | None, tensors: dict, rows=None) -> list[tuple]:
    """Integers that must agree on every rank (checked by one small all-gather); the same
    entries, in the same order, whatever the inputs (``-1`` where a value is missing)."""
    is_seq = isinstance(seq, ShardedSequence)
    three = isinstance(q, torch.Tensor) and q.dim() == 3
    sig = tensor_codes(tensors) + [
        ("cu_seq_lens (crc32)", zlib.crc32(seq.cu_seq_lens.numpy().tobytes()) if is_seq else -1,
         Listed("cu_seq_lens", seq.cu_seq_lens if is_seq else None)),
        ("len(cu_seq_lens)", seq.cu_seq_lens.numel() if is_seq else -1),
        ("layout", LAYOUT_CODES.get(seq.layout, -2) if is_seq else -1, LAYOUT_NAMES),
        ("rows per rank (crc32)", seq.layout_crc if is_seq else -1, _rows_listed(seq) if is_seq else Listed("rows", None)),
        ("world_size", seq.world_size if is_seq else -1),
        ("prompt_lens (crc32)", zlib.crc32(repr(seq.prompt_lens).encode()) if is_seq else -1,
         Listed("prompt_lens", seq.prompt_lens if is_seq else None)),
        ("q.shape[1] (H)", q.shape[1] if three else -1),
        ("q.shape[2] (D)", q.shape[2] if three else -1),
        # rows= on every rank or on none (an empty set asks for no row): the ranks must agree
        # on whether the balance partition applies
        ("rows", int(rows is not None), _ROWS_GIVEN),
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
                       keywords: dict, settings: Settings | None, stats: dict | None,
                       rows: torch.Tensor | None = None) -> Call:  # fmt: skip
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
        call = _validate(q, k, gates, head_weights, ape, seq, config, options, keywords, settings, stats, rows)
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it, whatever it is
        error = exc
    tensors = {"q": q, "k": k, "gates": gates, "head_weights": head_weights, "ape": ape}
    _agree(seq, error, _signature(q, seq, call, tensors, rows), settings, call.counter if call is not None else None)
    if stats is not None:  # the stages time themselves (device synchronized) into this dict
        call.record.stage_times = {}
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
    agree_or_raise(ranks, error, signature, stats=counter, timeout=settings.comm_timeout,
                   log_interval=settings.comm_log_interval)  # fmt: skip

