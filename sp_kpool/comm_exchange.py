"""Point-to-point row exchanges over the ``ShardedSequence`` process group.

The gather-pools path (:mod:`sp_kpool.pool_gather`), the causal balance
(:mod:`sp_kpool.balance`) and the training's backward route rows between pairs of ranks:
:func:`exchange_rows` (one ``batch_isend_irecv``, counted in a :class:`~sp_kpool.comm.CommStats`,
timed as every collective, :mod:`sp_kpool.comm_wait`), with tensors of any dtypes packed
into one byte buffer per row range (:func:`pack_rows`, :func:`unpack_rows`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from .comm_wait import CommStats, _finish, _nbytes, comm_device

if TYPE_CHECKING:  # the collectives take the sequence; it sits below them
    from .sharding import ShardedSequence

__all__ = ["exchange_rows", "pack_rows", "unpack_rows"]


def exchange_rows(
    sends: dict[int, torch.Tensor],
    recvs: dict[int, tuple[int, ...]],
    seq: ShardedSequence,
    *,
    dtype: torch.dtype,
    device: torch.device,
    stats: CommStats | None = None,
    tag: str = "exchange",
    timeout: float | None = None,
) -> dict[int, torch.Tensor]:
    """Point-to-point exchange in one ``batch_isend_irecv``: returns ``{peer: tensor}``.

    ``sends``: ``{peer: tensor}`` to send (peers are ranks of ``seq.group``, never this
    rank; empty tensors are skipped); ``recvs``: ``{peer: shape}`` to receive, of
    ``dtype``, returned on ``device``. Both sides must agree on every shape (callers derive
    them from the same global layout). Ranks without any transfer do not call anything.
    """
    import torch.distributed as dist

    out: dict[int, torch.Tensor] = {}
    ops = []
    dev = comm_device(seq) if seq.world_size > 1 else device

    def global_rank(peer: int) -> int:
        return peer if seq.group is None else dist.get_global_rank(seq.group, peer)

    sent = received = 0
    for peer, shape in sorted(recvs.items()):
        if peer == seq.rank:
            raise ValueError(f"recvs: a rank cannot receive from itself (rank {peer})")
        buf = torch.empty(shape, dtype=dtype, device=dev)
        out[peer] = buf
        if buf.numel():
            ops.append(dist.P2POp(dist.irecv, buf, global_rank(peer), seq.group))
            received += _nbytes(buf)
    for peer, x in sorted(sends.items()):
        if peer == seq.rank:
            raise ValueError(f"sends: a rank cannot send to itself (rank {peer})")
        if x.numel():
            src = x.contiguous().to(dev)
            ops.append(dist.P2POp(dist.isend, src, global_rank(peer), seq.group))
            sent += _nbytes(src)
    if ops:
        _finish(dist.batch_isend_irecv(ops), seq, timeout, f"point-to-point exchange ({tag})")
    if stats is not None and (sent or received):
        stats.add(tag, sent, received)
    return {peer: buf.to(device) for peer, buf in out.items()}


def pack_rows(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[torch.dtype, tuple[int, ...]]]]:
    """Concatenate tensors with the same leading dim ``n`` into one ``uint8 [n, B]`` buffer.

    Each row holds the bytes of that row of every tensor, in order, so a row range of the
    buffer is the same row range of every tensor (any dtype: FP8 included, which gloo
    cannot reduce but can move as bytes). Returns the buffer and the layout for
    :func:`unpack_rows`.
    """
    n = tensors[0].shape[0]
    parts, layout = [], []
    for t in tensors:
        if t.shape[0] != n:
            raise ValueError(f"pack_rows: expected leading dim {n} for every tensor, got {t.shape[0]}")
        layout.append((t.dtype, tuple(t.shape[1:])))
        per_row = torch.Size(t.shape[1:]).numel()
        parts.append(t.contiguous().reshape(n, per_row).view(torch.uint8))
    return torch.cat(parts, dim=1), layout


def unpack_rows(buf: torch.Tensor, layout: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """Inverse of :func:`pack_rows` for ``buf [m, B]`` (any row count ``m``)."""
    out, col = [], 0
    m = buf.shape[0]
    for dtype, tail in layout:
        per_row = torch.Size(tail).numel() * torch.empty((), dtype=dtype).element_size()
        if m == 0:
            out.append(torch.empty((0, *tail), dtype=dtype, device=buf.device))
        else:
            chunk = buf[:, col : col + per_row].contiguous()
            if chunk.storage_offset() % torch.empty((), dtype=dtype).element_size():
                chunk = chunk.clone()  # a view as a wider dtype needs an aligned start
            out.append(chunk.view(dtype).reshape(m, *tail))
        col += per_row
    if col != buf.shape[1]:
        raise ValueError(f"unpack_rows: layout covers {col} bytes per row, buffer has {buf.shape[1]}")
    return out
