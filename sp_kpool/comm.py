"""Collectives over the ``ShardedSequence`` process group: the gathers here, the rest beside.

Only two things cross ranks in the gather-keys path: the keys and gates (all-gathered
before pooling, because a pool may straddle rows of two ranks) and a tiny validation vector
(so that bad input fails on every rank alike, before any data collective, never hangs).
The gather-pools path (:mod:`sp_kpool.pool_gather`) and the causal balance
(:mod:`sp_kpool.balance`) add point-to-point row exchanges (:func:`exchange_rows`) and an
all-gather of unequal row counts (:func:`all_gather_uneven_rows`).

Every collective takes an optional :class:`CommStats` and adds to it the bytes this rank
actually handed to and received from the other ranks, under a tag: counted from the
tensors the collective moves (padding included), not estimated.

In the contiguous layout shards are equal by construction (``ShardedSequence`` pads), so
the keys go through one even, concatenated (dim-0) all-gather, on gloo and NCCL alike; in
the other layouts (:mod:`sp_kpool.layouts`) counts may differ, and :func:`gather_keys` pads
to the largest count, gathers once and puts the rows in real-row order. The process group
is always passed in explicitly; nothing is kept in module globals except the resolved
gather function.

The collectives by what a reader looks for (every name below is importable from here):

- this module: the gathers (:func:`all_gather_rows`, :func:`all_gather_uneven_rows`,
  :func:`gather_keys`, :func:`real_order`, :func:`take_rows`) and the sequence's own two
  collectives, :func:`gather_positions` (``ShardedSequence.from_positions``) and
  :func:`global_rows` (``seq.global_rows``), which it gives the sequence at its import
  (:func:`sp_kpool.sharding.register_collectives`: the sequence sits below its collectives);
- :mod:`sp_kpool.comm_exchange`: point-to-point row exchanges (:func:`exchange_rows`,
  :func:`pack_rows`, :func:`unpack_rows`);
- :mod:`sp_kpool.comm_agree`: the agreement that makes every rank raise alike
  (:func:`agree_or_raise`, :class:`Listed`, :func:`tensor_codes`);
- :mod:`sp_kpool.comm_wait`: timeouts and failures (:func:`wait_or_raise`), and what every
  collective shares: the group's device (:func:`comm_device`) and :class:`CommStats`.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import torch

from ._device import to_device
from .comm_agree import Listed, agree_or_raise, tensor_codes
from .comm_exchange import exchange_rows, pack_rows, unpack_rows  # noqa: F401 - importable from here
from .comm_wait import (  # noqa: F401 - _all_gather_timed, wait_or_raise: importable from here
    CommStats,
    _all_gather_timed,
    _finish,
    _gather_into_tensor,
    _group_device,
    _nbytes,
    comm_device,
    wait_or_raise,
)
from .settings import current_settings
from .sharding import ShardedSequence, register_collectives

__all__ = [
    "CommStats",
    "Listed",
    "comm_device",
    "all_gather_rows",
    "all_gather_uneven_rows",
    "exchange_rows",
    "pack_rows",
    "unpack_rows",
    "agree_or_raise",
    "tensor_codes",
    "gather_positions",
    "global_rows",
    "gather_keys",
    "real_order",
    "take_rows",
    "wait_or_raise",
]


def all_gather_rows(
    x: torch.Tensor, seq: ShardedSequence, *, stats: CommStats | None = None, tag: str = "all_gather",
    timeout: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """All-gather equal row shards: ``x_shard [S / R, *F]`` -> ``x [S, *F]`` (rank order).

    With world size 1 the input is returned as is. The result is on ``x.device``.
    ``timeout``: seconds to wait on gloo (see :func:`_finish`).
    """
    if seq.world_size == 1:
        return x
    dev = comm_device(seq)
    src = x.contiguous().to(dev)
    out = torch.empty((seq.world_size * src.shape[0], *src.shape[1:]), dtype=src.dtype, device=dev)
    _finish([_gather_into_tensor()(out, src, group=seq.group, async_op=True)], seq, timeout, f"all-gather ({tag})")
    if stats is not None:
        moved = (seq.world_size - 1) * _nbytes(src)
        stats.add(tag, moved, moved)
    return out.to(x.device)


def take_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` (int64 CPU) of ``x``: a view when they are a contiguous ascending
    range (the contiguous layout), else one ``index_select``."""
    n = index.numel()
    if n == 0:
        return x[:0]
    a = int(index[0])
    if int(index[-1]) - a + 1 == n and torch.equal(index, torch.arange(a, a + n)):
        return x[a : a + n]
    return x.index_select(0, to_device(index, x.device))


def gather_keys(x: torch.Tensor, seq: ShardedSequence, stats: CommStats | None = None,
                timeout: float | None = None) -> torch.Tensor:  # fmt: skip
    """Every rank's rows of ``x [S_local, *F]`` in real-row order: ``[N, *F]`` (``N`` real
    rows; in the contiguous layout ``[S, *F]``, the padding rows last). One all-gather
    (of rows padded to the largest rank's count when counts differ), then, unless the
    layout is contiguous, one ``index_select`` into real-row order."""
    if seq.is_contiguous:
        return all_gather_rows(x, seq, stats=stats, tag="gather_keys", timeout=timeout)
    counts = [p.numel() for p in seq.rank_positions]
    return real_order(all_gather_uneven_rows(x, counts, seq, stats=stats, tag="gather_keys", timeout=timeout), seq)


def real_order(full: torch.Tensor, seq: ShardedSequence) -> torch.Tensor:
    """The concatenation of every rank's rows (rank order, each in storage order) in
    real-row order (``[N, *F]``; the contiguous layout's concatenation already is, and is
    returned as is)."""
    if seq.is_contiguous:
        return full
    return full.index_select(0, to_device(seq.gathered_index, full.device))


def all_gather_uneven_rows(
    x: torch.Tensor,
    counts: Sequence[int],
    seq: ShardedSequence,
    *,
    stats: CommStats | None = None,
    tag: str = "all_gather_uneven",
    timeout: float | None = None,
) -> torch.Tensor:
    """All-gather row blocks of known, unequal sizes: ``x [counts[rank], *F]`` ->
    ``[sum(counts), *F]`` in rank order.

    ``counts`` (one per rank) must be known on every rank (no size exchange happens here).
    Portable on gloo and NCCL: pad every block to ``max(counts)`` rows, one even
    all-gather, slice. The padding is moved (and counted). With world size 1, ``x``.
    """
    if len(counts) != seq.world_size or int(counts[seq.rank]) != x.shape[0]:
        raise ValueError(
            f"counts: expected {seq.world_size} entries with counts[{seq.rank}] = {x.shape[0]} "
            f"(rows of x), got {list(counts)}"
        )
    if seq.world_size == 1:
        return x
    width = max(int(c) for c in counts)
    if width == 0:
        return x.new_empty((0, *x.shape[1:]))
    padded = x.new_zeros((width, *x.shape[1:]))
    padded[: x.shape[0]] = x
    full = all_gather_rows(padded, seq, stats=stats, tag=tag, timeout=timeout)
    return torch.cat([full[r * width : r * width + int(c)] for r, c in enumerate(counts)])


def gather_positions(positions: torch.Tensor, error: str | None, *, world_size: int, rank: int, group=None
                     ) -> list[torch.Tensor]:  # fmt: skip
    """Every rank's ``positions`` (int64 CPU, sizes may differ), for
    :meth:`sp_kpool.ShardedSequence.from_positions`: one small all-gather of the sizes and
    error flags, then one of the positions (padded to the largest size). A rank's local
    ``error`` (or a world size / rank that does not match ``group``) makes every rank
    raise the same ``ValueError`` naming the rank(s), before the positions move."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"world_size: {world_size} ranks need an initialized torch.distributed process group")
    actual = (dist.get_world_size(group), dist.get_rank(group))
    if actual[0] != world_size:  # every rank of the group sees the same size: raised alike
        raise ValueError(f"world_size: expected dist.get_world_size(group) = {actual[0]}, got {world_size}")
    if error is None and actual[1] != rank:
        error = f"ValueError: rank: expected dist.get_rank(group) = {actual[1]}, got {rank}"
    dev = _group_device(group)
    head = torch.tensor([[1 if error else 0, positions.numel()]], dtype=torch.int64, device=dev)
    heads = torch.empty((world_size, 2), dtype=torch.int64, device=dev)
    timeout = current_settings().comm_timeout
    wait_or_raise(_gather_into_tensor()(heads, head, group=group, async_op=True), timeout, "from_positions")
    heads = heads.cpu()
    failed = [r for r in range(world_size) if int(heads[r, 0])]
    if failed:
        texts: list = [None] * world_size
        dist.all_gather_object(texts, error, group=group)
        raise ValueError("invalid input on rank(s) %s:\n  %s" % (failed, "\n  ".join(f"rank {r}: {texts[r]}" for r in failed)))
    counts = heads[:, 1].tolist()
    width = max(counts)
    buf = torch.full((width,), -1, dtype=torch.int64, device=dev)
    buf[: positions.numel()] = positions.to(dev)
    full = torch.empty((world_size * width,), dtype=torch.int64, device=dev)
    wait_or_raise(_gather_into_tensor()(full, buf, group=group, async_op=True), timeout, "from_positions")
    full = full.cpu()
    return [full[r * width : r * width + c].clone() for r, c in enumerate(counts)]


def global_rows(seq: ShardedSequence, rows: torch.Tensor, *, timeout: float | None = None) -> torch.Tensor:
    """:meth:`sp_kpool.ShardedSequence.global_rows` (documented there): every rank's rows
    back in real-token order, after an agreement on the rows' dtype, device type and
    trailing shape (local with world size 1 and no group)."""
    error = None
    if not isinstance(rows, torch.Tensor):
        error = TypeError(f"rows: expected a torch.Tensor [S_local, ...], got {type(rows).__name__}")
    elif rows.dim() < 1 or rows.shape[0] != seq.shard_size:
        error = ValueError(f"rows: expected shape [{seq.shard_size}, ...] (seq.shard_size of rank "
                           f"{seq.rank}/{seq.world_size}), got {list(rows.shape)}")  # fmt: skip
    ok = isinstance(rows, torch.Tensor) and rows.dim() >= 1
    trailing = zlib.crc32(repr(list(rows.shape[1:])).encode()) if ok else -1
    shape = Listed("rows.shape[1:]", list(rows.shape[1:]) if ok else None)
    signature = tensor_codes({"rows": rows}) + [("rows.shape[1:] (crc32)", trailing, shape)]
    if timeout is None:
        timeout = current_settings().comm_timeout
    if seq.world_size == 1 and seq.group is None:
        if error is not None:
            raise error
    else:
        agree_or_raise(seq, error, signature, timeout=timeout)
    return gather_keys(rows, seq, timeout=timeout)[: seq.num_real_tokens]


# the sequence's two collectives live here, above it: given to it at this module's import
register_collectives(gather_positions=gather_positions, global_rows=global_rows)
