"""Ownership layouts: which positions of the packed stream each rank holds (pure functions).

A layout turns the user's documents into a **stream** (the documents with any padding
documents the layout adds) and gives every rank the stream positions of its rows, in its
storage order. Ids the operator returns are stream positions.

=======================  ====================================================================
layout                   rank ``r`` of ``W`` holds
=======================  ====================================================================
``contiguous``           the total padded at the end to a multiple of ``W`` (one padding
                         document); shard ``r`` of ``W`` equal shards (XTuner
                         ``SequenceContext.split``)
``zigzag``               the total padded at the end to a multiple of ``2W`` (one padding
                         document), cut into ``2W`` equal chunks; chunks ``r`` and
                         ``2W - 1 - r``, in that order (Megatron-LM non-packed context
                         parallelism, ring-flash-attn ``zigzag``, torchtitan head-tail)
``zigzag-per-document``  every document padded to a multiple of ``2W`` (or of
                         ``pad_multiple``), its padding a document of its own right after
                         it; every padded document cut into ``2W`` chunks, chunks ``r`` and
                         ``2W - 1 - r`` of each, document by document (Megatron-LM packed
                         THD: Transformer Engine's ``thd_get_partitioned_indices`` over
                         ``cu_seqlens_q_padded``)
``positions``            any distinct positions (:meth:`ShardedSequence.from_positions
                         <sp_kpool.sharding.ShardedSequence.from_positions>`); no padding
=======================  ====================================================================

Picture (one document of 10 tokens, ``W = 2``, ``zigzag``: padded to 12, chunks of 3)::

    stream     0 1 2 | 3 4 5 | 6 7 8 | 9 (10 11)      (10, 11: the padding document)
    chunk      0       1       2       3
    rank 0     chunks 0 and 3: positions 0 1 2 9 10 11
    rank 1     chunks 1 and 2: positions 3 4 5 6 7 8
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import check_int

__all__ = ["LAYOUTS", "StreamLayout", "stream_layout", "zigzag_chunks"]

#: Layout names accepted by :meth:`sp_kpool.ShardedSequence.split`.
LAYOUTS = ("contiguous", "zigzag", "zigzag-per-document")


@dataclass(frozen=True)
class StreamLayout:
    """A layout of a packed sequence over ``W`` ranks.

    cu_seq_lens: ``[docs + 1]`` int64 CPU, the stream's document boundaries (padding
        documents included). padding_docs: indices of the stream documents that are
        padding. positions: per rank, int64 CPU ``[S_r]``, the stream positions of its
        rows in storage order.
    """

    cu_seq_lens: torch.Tensor
    padding_docs: tuple[int, ...]
    positions: tuple[torch.Tensor, ...]


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def zigzag_chunks(start: int, length: int, world_size: int, rank: int) -> torch.Tensor:
    """Positions of chunks ``rank`` and ``2W - 1 - rank`` of the ``2W`` equal chunks of
    ``[start, start + length)`` (``length`` a multiple of ``2W``), in that order."""
    c = length // (2 * world_size)
    a = start + rank * c
    b = start + (2 * world_size - 1 - rank) * c
    return torch.cat([torch.arange(a, a + c), torch.arange(b, b + c)])


def stream_layout(cu: torch.Tensor, world_size: int, layout: str = "contiguous",
                  pad_multiple: int | None = None) -> StreamLayout:  # fmt: skip
    """The :class:`StreamLayout` of the documents ``cu`` (validated int64 CPU
    ``[docs + 1]``) over ``world_size`` ranks.

    ``pad_multiple`` (``zigzag-per-document`` only): pad each document to a multiple of it
    instead of ``2W`` (a multiple of ``2W``, as pipelines that pad to larger multiples do).
    """
    W = world_size
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {list(LAYOUTS)}, got {layout!r}")
    if pad_multiple is not None:
        if layout != "zigzag-per-document":
            raise ValueError(f"pad_multiple: only for layout 'zigzag-per-document', got layout {layout!r}")
        pad_multiple = check_int("pad_multiple", pad_multiple, 1)
        if pad_multiple % (2 * W):
            raise ValueError(f"pad_multiple: expected a multiple of 2 * world_size = {2 * W}, got {pad_multiple}")
    bounds = [int(v) for v in cu.tolist()]
    total = bounds[-1]
    if layout in ("contiguous", "zigzag"):
        padded = _round_up(total, W if layout == "contiguous" else 2 * W)
        padding = (len(bounds) - 1,) if padded > total else ()
        stream = bounds + [padded] if padding else bounds
        if layout == "contiguous":
            s = padded // W
            positions = tuple(torch.arange(r * s, (r + 1) * s) for r in range(W))
        else:
            positions = tuple(zigzag_chunks(0, padded, W, r) for r in range(W))
        return StreamLayout(torch.tensor(stream, dtype=torch.int64), padding, positions)
    m = pad_multiple or 2 * W
    stream, padding, docs = [0], [], []  # docs: (stream start, padded length) per real document
    for a, b in zip(bounds, bounds[1:]):
        n = b - a
        docs.append((stream[-1], _round_up(n, m)))
        stream.append(stream[-1] + n)
        if _round_up(n, m) > n:
            padding.append(len(stream) - 1)
            stream.append(stream[-1] + _round_up(n, m) - n)
    positions = tuple(
        torch.cat([zigzag_chunks(s, n, W, r) for s, n in docs]) if docs else torch.zeros(0, dtype=torch.int64)
        for r in range(W)
    )
    return StreamLayout(torch.tensor(stream, dtype=torch.int64), tuple(padding), positions)
