"""``kpool_topk``: the sequence-parallel KPool indexer selection (SPEC 2-5, 7)."""

from __future__ import annotations

import dataclasses
import zlib

import torch

from .backends import Problem, resolve_backend
from .backends.base import default_max_logits_bytes
from .comm import agree_or_raise, all_gather_rows
from .precision import PRECISIONS, resolve_precision
from .selection import ORDERS, TAILS
from .sharding import ShardedSequence

__all__ = ["kpool_topk"]


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


def _validate(q, k, gates, head_weights, ape, seq, topk, kpool, tail, order, alignment, max_logits_bytes, precision):
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


def _signature(q, seq, topk, kpool, tail, order, alignment, max_logits_bytes, precision):
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
        order: ``"ascending"`` pool id or ``"score"`` (descending, ties toward lower id).
        alignment: the output width is rounded up to a multiple of this.
        max_logits_bytes: scratch budget of one scoring chunk (default
            ``$SP_KPOOL_MAX_LOGITS_BYTES`` or 256 MiB). Every rank's rows are bitwise equal
            to world size 1 computed with the same budget.
        precision: ``"bf16"`` (model definition), ``"bf16-serving"`` or ``"fp8"`` (serving
            parity, SPEC 6); default ``$SP_KPOOL_PRECISION`` read once, else ``"bf16"``.
            See :mod:`sp_kpool.precision`. The inputs are used as given: the serving modes
            expect keys and head weights prepared in FP32 (``KPoolIndexer`` does this).

    Raises ``ValueError``/``TypeError`` naming the argument, the expected and the actual
    value; with several ranks every rank raises the same error, before any data moves.
    """
    if max_logits_bytes is None:
        max_logits_bytes = default_max_logits_bytes()
    if precision is None:
        precision = resolve_precision(None)
    args = (q, k, gates, head_weights, ape, seq, topk, kpool, tail, order, alignment, max_logits_bytes, precision)
    error = problem = chosen = None
    try:
        _validate(*args)
        problem = Problem(
            q=q, head_weights=head_weights, k=k, gates=gates, ape=ape, seq=seq, topk=topk, kpool=kpool,
            tail=tail, order=order, alignment=alignment, max_logits_bytes=max_logits_bytes, precision=precision,
        )  # fmt: skip
        chosen = resolve_backend(backend, problem)
    except (TypeError, ValueError) as exc:
        if not isinstance(seq, ShardedSequence) or seq.world_size == 1:
            raise
        error = f"{type(exc).__name__}: {exc}"
    agree_or_raise(seq, error, _signature(q, seq, topk, kpool, tail, order, alignment, max_logits_bytes, precision))

    k_all = all_gather_rows(k, seq)
    gates_all = all_gather_rows(gates, seq)
    problem = dataclasses.replace(problem, k=k_all, gates=gates_all)
    return chosen.run(problem)
