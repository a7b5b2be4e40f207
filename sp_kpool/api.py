"""``kpool_topk``: the sequence-parallel KPool indexer selection (SPEC 2-5, 7)."""

from __future__ import annotations

import dataclasses
import zlib

import torch

from ._device import to_device
from .backends import Problem, resolve_backend
from .backends.base import default_max_logits_bytes, stage
from .balance import ROW_COST, balanced_select, causal_partition, row_work_prefix
from .comm import CommStats, agree_or_raise, all_gather_rows
from .pooling import pool_table
from .precision import PRECISIONS, resolve_precision
from .seams import gather_pools, pool_shards
from .selection import ORDERS, TAILS
from .sharding import ShardedSequence

__all__ = ["kpool_topk", "GATHERS", "BALANCES"]

#: ``gather=``: all-gather keys and gates, then pool (``keys``), or pool per shard with a
#: seam exchange, then all-gather the pooled keys (``pools``).
GATHERS = ("keys", "pools")
#: ``balance=``: keep the contiguous split (``none``) or balance the causal work (``causal``).
BALANCES = ("none", "causal")


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected int, got {value!r} of type {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected >= {minimum}, got {value}")


def _check_tensor(name: str, x, shape: tuple, device: torch.device | None = None) -> None:
    """``shape`` entries: int (exact) or None (any)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name}: expected a floating-point dtype, got {x.dtype}")
    want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    if x.dim() != len(shape) or any(s is not None and s != a for s, a in zip(shape, x.shape)):
        raise ValueError(f"{name}: expected shape {want}, got {list(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: expected device {device} (the device of q), got {x.device}")


def _validate(
    q, k, gates, head_weights, ape, seq, topk, kpool, tail, order, alignment, max_logits_bytes, precision,
    gather, balance, balance_block, balance_row_cost, stats,
):  # fmt: skip
    """Local checks, in argument order; raises on the first problem found."""
    if not isinstance(seq, ShardedSequence):
        raise TypeError(f"seq: expected a ShardedSequence, got {type(seq).__name__}")
    _check_int("kpool", kpool, 1)
    _check_int("topk", topk, 1)
    if topk % kpool:
        raise ValueError(f"topk: expected a multiple of kpool = {kpool}, got {topk} (topk % kpool = {topk % kpool})")
    _check_int("alignment", alignment, 1)
    _check_int("max_logits_bytes", max_logits_bytes, 1)
    if tail not in TAILS:
        raise ValueError(f"tail: expected one of {list(TAILS)}, got {tail!r}")
    if order not in ORDERS:
        raise ValueError(f"order: expected one of {list(ORDERS)}, got {order!r}")
    resolve_precision(precision)
    if gather not in GATHERS:
        raise ValueError(f"gather: expected one of {list(GATHERS)}, got {gather!r}")
    if balance not in BALANCES:
        raise ValueError(f"balance: expected one of {list(BALANCES)}, got {balance!r}")
    if balance_block is not None:
        _check_int("balance_block", balance_block, 1)
    if balance_row_cost is not None:
        _check_int("balance_row_cost", balance_row_cost, 0)
    if stats is not None and not isinstance(stats, dict):
        raise TypeError(f"stats: expected a dict or None, got {type(stats).__name__}")
    _check_tensor("q", q, (None, None, None))
    S, H, D = q.shape
    if S != seq.shard_size:
        raise ValueError(
            f"q: expected {seq.shard_size} local rows (seq.shard_size of rank {seq.rank}/{seq.world_size}), got {S}"
        )
    if H < 1 or D < 1:
        raise ValueError(f"q: expected H >= 1 and D >= 1, got shape {list(q.shape)}")
    dev = q.device
    _check_tensor("k", k, (S, D), dev)
    _check_tensor("gates", gates, (S, D), dev)
    _check_tensor("head_weights", head_weights, (S, H), dev)
    _check_tensor("ape", ape, (kpool, D), dev)


def _signature(
    q, seq, topk, kpool, tail, order, alignment, max_logits_bytes, precision, gather, balance, balance_block,
    balance_row_cost,
):  # fmt: skip
    """Integers that must agree on every rank (checked by one small all-gather)."""
    cu = seq.cu_seq_lens.numpy().tobytes()
    return [
        ("cu_seq_lens (crc32)", zlib.crc32(cu)),
        ("len(cu_seq_lens)", seq.cu_seq_lens.numel()),
        ("shard_size", seq.shard_size),
        ("world_size", seq.world_size),
        ("q.shape[1] (H)", q.shape[1] if isinstance(q, torch.Tensor) and q.dim() == 3 else -1),
        ("q.shape[2] (D)", q.shape[2] if isinstance(q, torch.Tensor) and q.dim() == 3 else -1),
        ("topk", topk if isinstance(topk, int) else -1),
        ("kpool", kpool if isinstance(kpool, int) else -1),
        ("tail", TAILS.index(tail) if tail in TAILS else -1),
        ("order", ORDERS.index(order) if order in ORDERS else -1),
        ("alignment", alignment if isinstance(alignment, int) else -1),
        ("max_logits_bytes", max_logits_bytes if isinstance(max_logits_bytes, int) else -1),
        ("precision", PRECISIONS.index(precision) if precision in PRECISIONS else -1),
        ("gather", GATHERS.index(gather) if gather in GATHERS else -1),
        ("balance", BALANCES.index(balance) if balance in BALANCES else -1),
        ("balance_block", balance_block if isinstance(balance_block, int) else -1),
        ("balance_row_cost", balance_row_cost if isinstance(balance_row_cost, int) else -1),
    ]


@torch.no_grad()
def kpool_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    gates: torch.Tensor,
    head_weights: torch.Tensor,
    ape: torch.Tensor,
    seq: ShardedSequence,
    *,
    topk: int,
    kpool: int = 4,
    backend: str = "torch",
    tail: str = "fixed",
    order: str = "ascending",
    alignment: int = 1,
    max_logits_bytes: int | None = None,
    precision: str | None = None,
    gather: str = "keys",
    balance: str = "none",
    balance_block: int | None = None,
    balance_row_cost: int | None = None,
    stats: dict | None = None,
) -> torch.Tensor:
    """Select pools of keys for every local query row; return global token ids.

    Shapes (``S_local = seq.shard_size``; ``H`` heads, ``D`` head dim, ``K = kpool``):

    ==============  ======================  =============================================
    q               ``[S_local, H, D]``     index queries, float (BF16 in the model)
    k               ``[S_local, D]``        layer-normed index keys of the local rows
    gates           ``[S_local, D]``        per-channel pool gate logits ``x @ gate.T``
    head_weights    ``[S_local, H]``        raw ``weights_proj`` output (``H^-0.5`` applied here)
    ape             ``[K, D]``              ``index_kpool_compress_ape``
    returns         ``[S_local, W]`` int32  global packed token ids, ``-1`` unused
    ==============  ======================  =============================================

    ``W = align(topk + kpool - 1, alignment)``. Keys and gates are all-gathered over
    ``seq.group`` before pooling (pools may straddle shard seams); queries and head
    weights stay local. A row at document-local position ``j`` selects the
    ``min(topk // K, (j + 1) // K)`` best complete pools of its own document that end at
    or before it (ties toward the lower pool id), expanded to ``K`` token ids each, plus
    the ``(j + 1) % K`` most recent tokens as its tail. Rows of the padding document are
    all ``-1``.

    Args:
        seq: the sharding (:class:`ShardedSequence`); world size 1 needs no process group.
        topk: token budget ``T`` (a multiple of ``kpool``); ``topk // kpool`` pools.
        kpool: pool size ``K`` >= 1.
        backend: ``"torch"`` or ``"auto"`` (see ``python -m sp_kpool info``).
        tail: ``"fixed"`` (history in ``[0, T)``, tail in ``[T, T + K - 1)``) or
            ``"compact"`` (tail right after the history).
        order: ``"ascending"`` pool id or ``"score"`` (descending, ties toward lower id),
            both deterministic and identical for every sharding; or ``"serving"``: the set
            and order LMDeploy's ``sparse_index_topk`` returns (CUDA, lmdeploy installed,
            ``topk // kpool`` in {512, 2048}; meant with ``tail="compact"``). Its order is
            **not deterministic** between calls; use it only for parity with the rollout.
        alignment: the output width is rounded up to a multiple of this.
        max_logits_bytes: scratch budget of one scoring chunk (default
            ``$SP_KPOOL_MAX_LOGITS_BYTES``, else 2 GiB on CUDA and 256 MiB elsewhere). Every rank's rows are bitwise equal
            to world size 1 computed with the same budget.
        precision: ``"bf16"`` (model definition), ``"bf16-serving"`` or ``"fp8"`` (serving
            parity, SPEC 6); default ``$SP_KPOOL_PRECISION`` read once, else ``"bf16"``.
            See :mod:`sp_kpool.precision`. The inputs are used as given: the serving modes
            expect keys and head weights prepared in FP32 (``KPoolIndexer`` does this).
        gather: ``"keys"`` (default): all-gather ``k`` and ``gates`` (``2 * S * D`` values),
            every rank pools everything. ``"pools"``: every rank pools the pools starting
            in its shard (after receiving from the right the at most ``K - 1`` keys and
            gates that complete a pool straddling the seam), then the pooled keys are
            all-gathered (BF16, or FP8 values and scales): about ``1 / (2K)`` of the bytes.
            Pools, hence outputs, are bitwise identical (:mod:`sp_kpool.seams`).
        balance: ``"none"`` (default) or ``"causal"``: query rows are re-cut so that every
            rank scores about the same causal work (visible pools per row, plus a per-row
            constant); queries and head weights move to the computing rank, the selected
            pools come back, the owner expands. Declined (same decision on every rank) when
            it would not lower the maximum work. Outputs are bitwise identical
            (:mod:`sp_kpool.balance`).
        balance_block: boundaries of the balanced split are multiples of this many rows
            (default: the scoring chunk of the backend, so no chunk is scored twice).
        balance_row_cost: the per-row constant of the work model, in (row, pool) scores
            (default: the backend's ``balance_row_cost`` attribute if it has one, else
            :data:`sp_kpool.balance.ROW_COST`). ``scripts/bench.py`` fits it from a run.
        stats: if a dict, it is filled with this rank's instrumented communication bytes
            (``bytes``: ``sent``, ``received``, ``by_tag``), per-stage wall seconds
            (``time_s``: gather, seam, pool, balance_exchange, score, select,
            balance_route, expand; the device is synchronized around each stage, so the
            call is slower),
            the partition (``partition``) and the rows this rank scored. Never compared
            across ranks; only this rank's view.

    Raises ``ValueError``/``TypeError`` naming the argument, the expected and the actual
    value; with several ranks every rank raises the same error, before any data moves.
    """
    if max_logits_bytes is None:
        max_logits_bytes = default_max_logits_bytes(q.device if isinstance(q, torch.Tensor) else None)
    if precision is None:
        precision = resolve_precision(None)
    options = (
        topk, kpool, tail, order, alignment, max_logits_bytes, precision, gather, balance, balance_block,
        balance_row_cost,
    )  # fmt: skip
    error = problem = chosen = part = None
    try:
        _validate(q, k, gates, head_weights, ape, seq, *options, stats)
        problem = Problem(
            q=q, head_weights=head_weights, k=k, gates=gates, ape=ape, seq=seq, topk=topk, kpool=kpool,
            tail=tail, order=order, alignment=alignment, max_logits_bytes=max_logits_bytes, precision=precision,
        )  # fmt: skip
        chosen = resolve_backend(backend, problem)
        tables = pool_table(seq.real_cu_seq_lens, kpool)
        # the logits budget against global quantities, here, so that every rank raises alike
        # (a rank whose shard holds only padding never reaches the scoring chunks)
        chunk = chosen.chunk_rows(problem, tables[0].numel()) if tables[0].numel() else None
        if balance == "causal" and seq.world_size > 1:
            block = balance_block
            if block is None:  # global quantities only: the same on every rank
                block = chunk if chunk is not None else chosen.chunk_rows(problem, 0)
            row_cost = balance_row_cost
            if row_cost is None:
                row_cost = getattr(chosen, "balance_row_cost", ROW_COST)
            part = causal_partition(
                seq.real_cu_seq_lens, kpool=kpool, world_size=seq.world_size, shard_size=seq.shard_size,
                block=block, row_cost=row_cost,
            )  # fmt: skip
    except (TypeError, ValueError) as exc:
        if not isinstance(seq, ShardedSequence) or seq.world_size == 1:
            raise
        error = f"{type(exc).__name__}: {exc}"
    counter = CommStats() if stats is not None else None
    resolved = [("backend (resolved, crc32)", zlib.crc32(chosen.name.encode()) if chosen is not None else -1)]
    agree_or_raise(seq, error, _signature(q, seq, *options) + resolved, stats=counter)
    if stats is not None:  # the driver times its stages (device synchronized) into this dict
        problem = dataclasses.replace(problem, stage_times={})

    pts = tables[0]
    applied = part is not None and part.applied
    if gather == "keys":
        with stage(problem, "gather"):
            k_all = all_gather_rows(k, seq, stats=counter, tag="gather_keys")
            gates_all = all_gather_rows(gates, seq, stats=counter, tag="gather_keys")
        problem = dataclasses.replace(problem, k=k_all, gates=gates_all)
        pooled = None  # the driver pools, from the pool table it builds on the device
        if applied and pts.numel():  # the balanced path needs them here
            with stage(problem, "pool"):
                pooled = chosen.pool(problem, to_device(pts, problem.device))
    else:
        # problem.k / gates stay this rank's shards: with pooled given, nothing reads them.
        pooled = gather_pools(chosen, problem, pts, stats=counter)

    if applied:
        out = balanced_select(chosen, problem, pooled, tables, part, stats=counter)
    else:
        out = chosen.run(problem, pooled)
    if stats is not None:
        _fill_stats(stats, problem, gather, balance, part, pts, counter)
    return out


def _fill_stats(stats, problem, gather, balance, part, pts, counter) -> None:
    seq, kpool = problem.seq, problem.kpool
    applied = part is not None and part.applied
    n = seq.num_real_tokens
    if applied:
        lo, hi = part.bounds[seq.rank], part.bounds[seq.rank + 1]
    else:
        lo, hi = min(seq.shard_start, n), min(seq.shard_end, n)
    pairs = row_work_prefix(seq.real_cu_seq_lens, kpool, row_cost=0)
    stats.update(
        gather=gather,
        balance=balance,
        balance_applied=applied,
        bytes=counter.as_dict(),
        time_s=dict(problem.stage_times),
        partition=part.as_dict() if balance == "causal" and seq.world_size > 1 else None,
        rows_scored=(lo, hi),
        causal_pairs=int(pairs[hi] - pairs[lo]),
        pools=int(pts.numel()),
        pools_built=(
            pool_shards(pts, shard_size=seq.shard_size, world_size=seq.world_size, kpool=kpool).counts[seq.rank]
            if gather == "pools" else int(pts.numel())
        ),
    )  # fmt: skip
