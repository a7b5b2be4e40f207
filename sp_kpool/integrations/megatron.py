"""Megatron-LM: a :class:`ShardedSequence` from ``PackedSeqParams`` and the context-parallel group.

Megatron's context parallelism (``cp_comm_type="allgather"`` for DSA) lays tokens out in zigzag:

* packed THD (``PackedSeqParams.qkv_format == "thd"``): every sequence padded by the data
  pipeline to a multiple of ``2 * cp_size`` (``cu_seqlens_q_padded``), cut into ``2 * cp_size``
  chunks; rank ``r`` holds chunks ``r`` and ``2 * cp_size - 1 - r`` of each, sequence by
  sequence (Transformer Engine's ``thd_get_partitioned_indices``; Megatron's
  ``dsa_layout.build_packed_allgather_cp_local_positions``);
* non-packed (``packed_seq_params=None``): the whole ``seq_len`` cut into ``2 * cp_size`` chunks
  (``get_batch_on_this_cp_rank``; ``dsa_layout.build_zigzag_cp_local_positions``).

:func:`sharded_sequence` gives the same rows: ``seq.positions`` equals Megatron's local
positions, the stream is the padded THD stream (``cu_seqlens_q_padded``), every sequence's
padding ``cu_seqlens_q_padded[d + 1] - cu_seqlens_q_padded[d] - (cu_seqlens_q[d + 1] -
cu_seqlens_q[d])`` a padding document right after it (its rows return all ``-1``, no id points
into it).

**Which K/V order the ids index.** Our ids are stream positions: positions in the padded THD
stream. Megatron's ``DSAttention.forward`` all-gathers K/V (and the indexer's ``k``) rank by rank
(rank 0's local rows, then rank 1's, ...) and then restores stream order with
``key.index_select(0, kv_reorder_idx)``, ``kv_reorder_idx`` from
``build_packed_allgather_cp_query_positions_and_key_reorder`` /
``build_zigzag_allgather_cp_key_reorder`` (``= argsort(cat(positions of every rank)))``, which is
:func:`key_reorder`). The top-k indices its sparse attention consumes index that **reordered**
K/V, so our ids can be used as they are. A caller that keeps the gathered K/V in rank order
(without the reorder) maps them with :func:`gathered_ids`.

**Column order.** The columns are :func:`~sp_kpool.kpool_topk`'s (``order``, ``tail``; default
the selected pools by ascending id, ``-1`` after them, the tail at ``[topk, topk + K - 1)``).
Megatron-LM's DSA attention (megatron-core 0.19.2, which has no KPool indexer of its own) takes
``-1`` in any column: its cuDNN/FlashMLA path first moves the valid ids left and sorts them by
index (``_prepare_attention_topk_indices`` -> ``dsa_masking.sort_topk_by_index``), which is
exactly ``order="ascending", tail="compact"`` (the tail ids follow every pool of the row), so
with those options its preparation leaves our ids unchanged; its unfused paths mask ``-1`` per
column (the absorbed one scatters the ids into a dense mask, order-free; ``unfused_dsa_fn``
accumulates an online softmax over chunks of 1024 columns, so there the column order changes
the rounding, not the set). Its own token indexer emits best first (``torch.topk``):
``order="score"`` follows that convention.

Calling us from Megatron's DSA indexer (GLM-5.3 KPool port; batch 1 packed THD, or one call per
batch element for non-packed ``[s, b, ...]``)::

    from sp_kpool import kpool_topk
    from sp_kpool.integrations.megatron import sharded_sequence

    seq = sharded_sequence(packed_seq_params, cp_group)     # once per micro-batch, reuse per layer
    # local rows, before any CP gather: q [sq, 1, H, D], k [sq, 1, D], gates [sq, 1, D],
    # weights [sq, 1, H] the raw linear_weights_proj output (not the scaled one)
    ids = kpool_topk(q[:, 0], k[:, 0], gates[:, 0], weights[:, 0], ape, seq,
                     topk=index_topk, kpool=index_kpool)   # [sq, width] int32, stream ids
    topk_indices = ids.unsqueeze(0)                        # [b=1, sq, width], indexes the
                                                           # reordered (stream-order) K/V

We all-gather ``k`` and the gates over ``seq.group`` ourselves: pass the local rows, not the
gathered ones. Megatron's ``forward_before_topk`` returns ``weights`` already multiplied by
``index_n_heads ** -0.5 * softmax_scale``; we apply ``H ** -0.5`` (and ``D ** -0.5`` to the dot
product) ourselves, so pass the raw projection (a positive rescale does not change the
selection, but it changes rounding).
"""

from __future__ import annotations

from typing import Any

import torch

from ..checks import check_int
from ..layouts import zigzag_chunks
from ..sharding import ShardedSequence

__all__ = ["sharded_sequence", "key_reorder", "gathered_ids", "replayed_ids"]


def _cu(name: str, value: Any) -> torch.Tensor:
    t = torch.as_tensor(value)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() != 1 or t.numel() < 2:
        raise ValueError(f"PackedSeqParams.{name}: expected a 1-D integer tensor [num_seqs + 1], "
                         f"got {t.dtype} shape {list(t.shape)}")  # fmt: skip
    t = t.detach().to("cpu", torch.int64)
    if int(t[0]) != 0 or bool((t.diff() < 0).any()):
        raise ValueError(f"PackedSeqParams.{name}: expected non-decreasing values from 0, got {t.tolist()}")
    return t


def _group_size_rank(cp_group: Any, world_size: int | None, rank: int | None) -> tuple[int, int]:
    if cp_group is not None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("cp_group: a process group was given but torch.distributed is not initialized")
        size, r = dist.get_world_size(cp_group), dist.get_rank(cp_group)
        if world_size is not None and int(world_size) != size:
            raise ValueError(f"world_size: expected the size of cp_group ({size}), got {world_size}")
        if rank is not None and int(rank) != r:
            raise ValueError(f"rank: expected this rank in cp_group ({r}), got {rank}")
        return size, r
    size = 1 if world_size is None else check_int("world_size", world_size, 1)
    r = 0 if rank is None else check_int("rank", rank)
    if not 0 <= r < size:
        raise ValueError(f"rank: expected 0 <= rank < world_size = {size}, got {r}")
    return size, r


def sharded_sequence(
    packed_seq_params: Any,
    cp_group: Any = None,
    *,
    world_size: int | None = None,
    rank: int | None = None,
    seq_len: int | None = None,
    local_rows: int | None = None,
) -> ShardedSequence:
    """The :class:`ShardedSequence` of Megatron's context-parallel zigzag layout.

    Args:
        packed_seq_params: Megatron's ``PackedSeqParams`` (or any object with its fields),
            read by attribute: ``cu_seqlens_q`` (``[n + 1]`` int, real tokens) and
            ``cu_seqlens_q_padded`` (``[n + 1]`` int, every sequence padded to a multiple of
            ``2 * cp_size``; ``None``: no padding, ``cu_seqlens_q`` must itself be so padded);
            ``qkv_format`` (``"thd"`` or absent), ``cu_seqlens_kv``/``cu_seqlens_kv_padded``
            (absent, ``None`` or equal to the query's: self-attention). ``None``: non-packed
            zigzag of one sequence of ``seq_len`` tokens.
        cp_group: the context-parallel process group (``pg_collection.cp``); its size and this
            rank's rank in it are read (``torch.distributed`` initialized). ``None``: the sizes
            come from ``world_size``/``rank`` (default 1 and 0), and collectives then use the
            default group.
        world_size, rank: explicit CP size and rank (checked against ``cp_group`` if given).
        seq_len: non-packed only: the global sequence length (a multiple of ``2 * cp_size``).
        local_rows: packed only, optional: this rank's row count when the local THD tensors
            carry rows beyond ``cu_seqlens_q_padded[-1] / cp_size`` (Megatron then places them
            after every real token, rank by rank: a trailing padding document here).

    Returns:
        ``ShardedSequence`` (``layout="zigzag-per-document"`` for packed THD, ``"zigzag"`` for
        non-packed) whose ``positions`` (``[S_local]`` int64 CPU) are Megatron's local
        positions on this rank and whose ids are positions in the padded stream
        (``cu_seqlens_q_padded``), the order of Megatron's reordered gathered K/V.

    Raises ``ValueError``/``TypeError`` naming the ``PackedSeqParams`` field or argument: a
    ``cu_seqlens_q_padded`` whose sequences are not multiples of ``2 * cp_size`` or shorter
    than ``cu_seqlens_q``'s, mismatched counts, a ``qkv_format`` other than ``"thd"``, a key
    layout different from the query's, a ``seq_len`` not a multiple of ``2 * cp_size``.
    """
    W, r = _group_size_rank(cp_group, world_size, rank)
    if packed_seq_params is None:
        if seq_len is None:
            raise ValueError("seq_len: required for non-packed zigzag (packed_seq_params=None)")
        seq_len = check_int("seq_len", seq_len, 1)
        if W > 1 and seq_len % (2 * W):
            raise ValueError(f"seq_len: expected a multiple of 2 * cp_size = {2 * W} (Megatron's "
                             f"get_batch_on_this_cp_rank cuts the sequence into 2 * cp_size chunks), got {seq_len}")  # fmt: skip
        if local_rows is not None and check_int("local_rows", local_rows) * W != seq_len:
            raise ValueError(f"local_rows: expected seq_len / cp_size = {seq_len // W}, got {local_rows}")
        return ShardedSequence.split([0, seq_len], W, r, cp_group, layout="zigzag")
    if seq_len is not None:
        raise ValueError("seq_len: only for non-packed zigzag (packed_seq_params=None); packed lengths come from "
                         "PackedSeqParams.cu_seqlens_q_padded")  # fmt: skip
    fmt = getattr(packed_seq_params, "qkv_format", None)
    if fmt is not None and fmt != "thd":
        raise ValueError(f"PackedSeqParams.qkv_format: expected 'thd' (packed), got {fmt!r}; for a non-packed "
                         "batch pass packed_seq_params=None and seq_len=")  # fmt: skip
    if getattr(packed_seq_params, "cu_seqlens_q", None) is None:
        raise ValueError("PackedSeqParams.cu_seqlens_q: required (the real tokens of every packed sequence)")
    real = _cu("cu_seqlens_q", packed_seq_params.cu_seqlens_q)
    padded_in = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    padded = real if padded_in is None else _cu("cu_seqlens_q_padded", padded_in)
    pad_name = "cu_seqlens_q" if padded_in is None else "cu_seqlens_q_padded"
    if padded.numel() != real.numel():
        raise ValueError(f"PackedSeqParams.cu_seqlens_q_padded: expected {real.numel()} entries like cu_seqlens_q, "
                         f"got {padded.numel()}")  # fmt: skip
    for kv_name, q_value in (("cu_seqlens_kv", real), ("cu_seqlens_kv_padded", padded)):
        kv = getattr(packed_seq_params, kv_name, None)
        if kv is not None and not torch.equal(_cu(kv_name, kv), q_value):
            raise ValueError(f"PackedSeqParams.{kv_name}: expected the query's boundaries (self-attention), "
                             f"got {torch.as_tensor(kv).tolist()} vs {q_value.tolist()}")  # fmt: skip
    n_real, n_pad = real.diff().tolist(), padded.diff().tolist()
    for d, (n, m) in enumerate(zip(n_real, n_pad)):
        if m < n:
            raise ValueError(f"PackedSeqParams.{pad_name}: sequence {d} is padded to {m} tokens, fewer than its "
                             f"{n} real tokens (cu_seqlens_q)")  # fmt: skip
        if W > 1 and m % (2 * W):
            raise ValueError(f"PackedSeqParams.{pad_name}: sequence {d} is padded to {m} tokens, not a multiple of "
                             f"2 * cp_size = {2 * W} (Megatron's THD context parallelism pads every sequence so)")  # fmt: skip
    stream, padding_docs = [0], []
    for d, (n, m) in enumerate(zip(n_real, n_pad)):
        start = int(padded[d])
        stream.append(start + n)
        if m > n:
            padding_docs.append(len(stream) - 1)
            stream.append(start + m)
    total = int(padded[-1])
    if W == 1:  # no context parallelism: the stream in order (any lengths)
        positions = [torch.arange(total)]
    else:
        positions = [torch.cat([zigzag_chunks(int(padded[d]), m, W, q) for d, m in enumerate(n_pad)]
                               + [torch.zeros(0, dtype=torch.int64)]) for q in range(W)]  # fmt: skip
    if local_rows is not None:
        local_rows = check_int("local_rows", local_rows)
        extra = local_rows - total // W
        if extra < 0:
            raise ValueError(f"local_rows: expected at least cu_seqlens_q_padded[-1] / cp_size = {total // W}, "
                             f"got {local_rows}")  # fmt: skip
        if extra:
            padding_docs.append(len(stream) - 1)
            stream.append(total + W * extra)
            positions = [torch.cat([p, torch.arange(total + q * extra, total + (q + 1) * extra)])
                         for q, p in enumerate(positions)]  # fmt: skip
    if stream[-1] < 1:
        raise ValueError("PackedSeqParams.cu_seqlens_q: expected at least one token, got none")
    num_padding = sum(stream[d + 1] - stream[d] for d in padding_docs)
    return ShardedSequence(cu_seq_lens=torch.tensor(stream, dtype=torch.int64), shard_start=None,
                           shard_size=positions[r].numel(), rank=r, world_size=W, group=cp_group,
                           num_padding=num_padding, layout="zigzag-per-document",
                           padding_docs=tuple(padding_docs), rank_positions=tuple(positions))  # fmt: skip


def key_reorder(seq: ShardedSequence) -> torch.Tensor:
    """``[S]`` int64 CPU: Megatron's ``kv_reorder_idx``: ``gathered.index_select(0, key_reorder(seq))``
    turns K/V all-gathered rank by rank (every rank's local rows, in rank order) into stream
    order, the order our ids index."""
    return torch.argsort(torch.cat(list(seq.rank_positions)))


def gathered_ids(seq: ShardedSequence, ids: torch.Tensor) -> torch.Tensor:
    """Our stream ids (any shape, int, ``-1`` kept) as rows of the rank-order all-gather
    (K/V gathered rank by rank, **not** reordered): ``gathered[gathered_ids(seq, ids)] ==
    stream_order[ids]``. Same dtype and device as ``ids``."""
    order = torch.cat(list(seq.rank_positions))
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    table = inverse.to(ids.device)
    flat = ids.to(torch.int64)
    return torch.where(flat >= 0, table[flat.clamp(min=0)], flat).to(ids.dtype)


def replayed_ids(captured, seq: ShardedSequence, config=None, **keywords) -> torch.Tensor:
    """The rollout's selection of one layer as this CP rank's ``[sq, width]`` int32 ids, laid
    out as :func:`sp_kpool.kpool_topk` returns them for ``seq`` (stream ids: they index the
    reordered K/V, as computed ids do; ``.unsqueeze(0)`` for ``topk_indices``).

    ``captured``: one ``[T_d, W_d]`` array per **real** sequence (``cu_seqlens_q``'s; the THD
    padding of ``cu_seqlens_q_padded`` is no document of the capture), request-local token
    positions (or pool ids with ``ids="pools"``), as SGLang returns them per request.
    ``keywords``: those of :func:`sp_kpool.replay.shard` (``topk``, ``kpool``, ``missing``,
    ``inputs`` = the local ``q, k, gates, head_weights, ape`` for rows the capture does not
    cover, ...).
    """
    from ..replay import shard

    return shard(captured, seq, config, **keywords)
