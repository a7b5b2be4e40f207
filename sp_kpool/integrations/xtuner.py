"""XTuner: a drop-in ``kpool_topk_indices`` and ``SequenceContext`` -> :class:`ShardedSequence`.

XTuner (``xtuner/v1/ops/sparse_mla/kpool.py``) calls its KPool indexer as::

    topk_ids = kpool_topk_indices(q, k, gate_scores, weights, kpool_ape, seq_ctx,
                                  index_head_dim=..., index_topk=..., index_kpool=...,
                                  always_select_tail=..., alignment=..., query_chunk_size=...)

:func:`kpool_topk_indices` takes the same arguments and returns the same tensor (shape,
dtype, ``-1`` padding, the same selected set for every row, in XTuner's column order: the
pools ascending with the unused slots first, the tail at ``index_topk``), so swapping the import
(or the function ``KPoolIndexer._topk_indices_fn`` resolves) is the whole integration.

The ``SequenceContext`` is read by its attributes only (XTuner is not imported):

* ``cu_seq_lens_q``: the **global** document boundaries (``SequenceContext.split`` keeps them
  global and appends its sequence-parallel padding as a document of its own);
* ``shard_start`` (or XTuner's private ``_shard_start``): the global position of this rank's
  first row; ``shard_size`` (``_shard_size``) its row count;
* ``sequence_parallel_mesh``: a 1-D ``DeviceMesh`` (``size()``, ``get_local_rank()``,
  ``get_group()``), a ``ProcessGroup`` (``size()``, ``rank()``) or ``None`` (no sequence
  parallelism).

XTuner's shards are contiguous and equal (``split_for_sequence_parallel`` is a ``narrow``),
which is our ``layout="contiguous"``; its padding document is a document like any other for
XTuner's indexer (its rows select among the padding tokens), and it stays one here, so the
padding rows' ids match XTuner's too. Ids are global token positions: they index the key
states XTuner gathers over the mesh (``gather_for_sequence_parallel``), in that order.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..api import kpool_topk
from ..sharding import ShardedSequence

__all__ = ["kpool_topk_indices", "from_sequence_context"]

_SEQ_CACHE: "weakref.WeakKeyDictionary[Any, tuple[tuple, ShardedSequence]]" = weakref.WeakKeyDictionary()


def _attr(obj: Any, *names: str) -> Any:
    for name in names:
        if hasattr(obj, name):
            return getattr(obj, name)
    return None


def _mesh_rank(mesh: Any) -> tuple[int, int, Any]:
    """``(world_size, rank, process group)`` of ``SequenceContext.sequence_parallel_mesh``."""
    if mesh is None:
        return 1, 0, None
    if hasattr(mesh, "get_local_rank") and hasattr(mesh, "size"):  # a DeviceMesh
        if getattr(mesh, "ndim", 1) != 1:
            raise ValueError(f"SequenceContext.sequence_parallel_mesh: expected a 1-D DeviceMesh, got {mesh.ndim} dims")
        world_size, rank = int(mesh.size()), int(mesh.get_local_rank())
        return world_size, rank, (mesh.get_group() if world_size > 1 else None)
    if callable(getattr(mesh, "size", None)) and callable(getattr(mesh, "rank", None)):  # a ProcessGroup
        return int(mesh.size()), int(mesh.rank()), mesh
    raise TypeError("SequenceContext.sequence_parallel_mesh: expected a DeviceMesh, a ProcessGroup or None, "
                    f"got {type(mesh).__name__}")  # fmt: skip


def _as_int(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"SequenceContext.{name}: expected an integer, got a tensor of shape {list(value.shape)}")
        value = value.item()
    return int(value)


def from_sequence_context(seq_ctx: Any, *, rows: int | None = None) -> ShardedSequence:
    """The :class:`ShardedSequence` of an XTuner ``SequenceContext`` (read by attribute).

    Args:
        seq_ctx: an XTuner ``SequenceContext`` (or any object with its fields): after
            ``SequenceContext.split(mesh)`` on every rank of the mesh, or unsplit without a
            mesh (world size 1).
        rows: this rank's row count (``S`` of ``q [1, S, H, D]``); default
            ``shard_size`` if set, else ``input_ids.shape[1]``, else ``cu_seq_lens_q[-1] / W``.

    Returns:
        ``ShardedSequence`` with ``layout="contiguous"``, ``cu_seq_lens = cu_seq_lens_q``
        (int64 CPU; XTuner's padding document stays a document), rank ``r`` owning rows
        ``[shard_start, shard_start + S)``, ``group`` the mesh's process group. No
        communication.

    Raises ``ValueError``/``TypeError`` naming the ``SequenceContext`` field: no
    ``cu_seq_lens_q``, lengths that are not global (``cu_seq_lens_q[-1] != W * S``: a context
    that was not split, or split ``cu_seq_lens_q``), a ``shard_start`` that is not
    ``rank * S``, a mesh that is not 1-D.
    """
    cu = _attr(seq_ctx, "cu_seq_lens_q")
    if cu is None:
        raise TypeError(f"SequenceContext.cu_seq_lens_q: missing on {type(seq_ctx).__name__} "
                        "(expected the global cumulative document lengths [num_docs + 1])")  # fmt: skip
    cu = torch.as_tensor(cu)
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"SequenceContext.cu_seq_lens_q: expected a 1-D tensor [num_docs + 1], got shape {list(cu.shape)}")
    world_size, rank, group = _mesh_rank(_attr(seq_ctx, "sequence_parallel_mesh"))
    total = int(cu[-1])
    shard_start = _as_int("shard_start", _attr(seq_ctx, "shard_start", "_shard_start"))
    if rows is None:
        rows = _as_int("shard_size", _attr(seq_ctx, "shard_size", "_shard_size")) or None
    if rows is None:
        ids = _attr(seq_ctx, "input_ids")
        rows = int(ids.shape[-1]) if isinstance(ids, torch.Tensor) and ids.dim() >= 1 else total // world_size
    rows = int(rows)
    if total != world_size * rows:
        raise ValueError(
            f"SequenceContext.cu_seq_lens_q: expected the global document boundaries, "
            f"cu_seq_lens_q[-1] == sequence-parallel size {world_size} x local rows {rows} = {world_size * rows}, "
            f"got cu_seq_lens_q[-1] = {total} (pass the context SequenceContext.split(sequence_parallel_mesh) "
            "returns: it keeps cu_seq_lens_q global and records the shard in shard_start)")  # fmt: skip
    if shard_start is None:
        if world_size > 1:
            raise ValueError("SequenceContext.shard_start: missing (expected this rank's first global row, "
                             "as SequenceContext.split records it)")  # fmt: skip
        shard_start = 0
    if shard_start != rank * rows:
        raise ValueError(f"SequenceContext.shard_start: expected rank {rank} x local rows {rows} = {rank * rows} "
                         f"(XTuner's contiguous equal shards), got {shard_start}")  # fmt: skip
    return ShardedSequence.split(cu, world_size, rank, group, layout="contiguous")


def _cached_sequence(seq_ctx: Any, rows: int) -> ShardedSequence:
    """:func:`from_sequence_context`, cached on the context (one per micro-batch, every layer
    reuses it and with it the pipeline's tables)."""
    cu = _attr(seq_ctx, "cu_seq_lens_q")
    mesh = _attr(seq_ctx, "sequence_parallel_mesh")
    key = (id(cu), None if cu is None else getattr(cu, "_version", None), id(mesh), rows,
           _attr(seq_ctx, "shard_start", "_shard_start"))  # fmt: skip
    try:
        hit = _SEQ_CACHE.get(seq_ctx)
    except TypeError:  # not weak-referenceable or unhashable: no cache
        return from_sequence_context(seq_ctx, rows=rows)
    if hit is not None and hit[0] == key:
        return hit[1]
    seq = from_sequence_context(seq_ctx, rows=rows)
    try:
        _SEQ_CACHE[seq_ctx] = (key, seq)
    except TypeError:
        pass
    return seq


def _check_shape(name: str, t: Any, dims: int, expected: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor {expected} (XTuner's layout), got {type(t).__name__}")
    if t.dim() != dims or t.shape[0] != 1:
        raise ValueError(f"{name}: expected XTuner's {expected} (batch 1, packed), got shape {list(t.shape)}")


@torch.no_grad()
def kpool_topk_indices(
    q: torch.Tensor,
    k: torch.Tensor,
    gate_scores: torch.Tensor,
    weights: torch.Tensor,
    kpool_ape: torch.Tensor,
    seq_ctx: Any,
    *,
    index_head_dim: int,
    index_topk: int,
    index_kpool: int = 4,
    always_select_tail: bool = True,
    alignment: int = 512,
    query_chunk_size: int | None = None,
    replay: Any = None,
    replay_ids: str = "tokens",
    replay_missing: str = "compute",
    **options: Any,
) -> torch.Tensor:
    """XTuner's ``kpool_topk_indices``, computed by :func:`sp_kpool.kpool_topk`.

    Shapes (``S`` local rows, ``H = index_n_heads``, ``D = index_head_dim``):

    ===========  ==================  ===============================================
    q            ``[1, S, H, D]``    index queries (BF16 in XTuner), local rows
    k            ``[1, S, D]``       ``k_norm(wk(hidden))``, local rows
    gate_scores  ``[1, S, D]``       ``hidden @ index_kpool_compress_gate.T``
    weights      ``[1, S, H]``       raw ``weights_proj(hidden)`` (FP32 in XTuner)
    kpool_ape    ``[K, D]``          ``index_kpool_compress_ape``, ``K = index_kpool``
    returns      ``[S, 1, width]``   int32 global token ids, ``-1`` unused
    ===========  ==================  ===============================================

    ``width = ceil((index_topk + K - 1) / alignment) * alignment``. **Column order: XTuner's,
    bit for bit.** Slots ``[0, index_topk)``: the selected pools (the
    ``min(index_topk / K, (j + 1) // K)`` best complete pools of the row's document that end
    at or before it), ``K`` ids each, in XTuner's canonical order (``expand_pools_and_tail``
    sorts the selected pool ids ascending before expanding them: the
    ``index_topk / K - n`` unused slots, ``-1``, first, then the ``n`` pools by ascending id,
    so the last pool ends at column ``index_topk``: ``order="ascending-unused-first"``);
    slots ``[index_topk, index_topk + K - 1)``: the ``(j + 1) % K`` most recent tokens (the
    incomplete pool), oldest first, then ``-1`` (all ``-1`` with ``always_select_tail=False``);
    the rest ``-1``. Row ``i`` is the token at global position ``shard_start + i``.

    Keys and gates are all-gathered over the mesh's group inside (as XTuner does); with
    several ranks every rank of the mesh must call. ``query_chunk_size`` (XTuner's kernel
    chunking) is accepted and ignored: it does not change the selection, and our scoring
    scratch is bounded by ``max_logits_bytes``. ``options`` go to :func:`sp_kpool.kpool_topk`
    (``backend``, ``gather``, ``balance``, ``max_logits_bytes``, ``order`` (default
    ``"ascending-unused-first"``, XTuner's columns; ``"score"``: best first, the unused slots
    last: the same sets, another reduction order in XTuner's sparse attention), ...).

    ``replay``: the rollout's selection of this layer (one ``[T_d, W_d]`` array per real
    document, request-local token positions, or pool ids with ``replay_ids="pools"``):
    returned in the same layout instead of computed (:func:`sp_kpool.replay.shard`; rows
    the capture does not cover as ``replay_missing`` says, computed by default). One array
    per document of ``cu_seq_lens_q``: XTuner's padding document (appended by
    ``SequenceContext.split``) is a document like the others, give it an empty ``[0, W]``
    array (its rows are then computed, as XTuner computes them, or get only their tail).

    Raises ``ValueError``/``TypeError`` naming the argument (XTuner's names) or the
    ``SequenceContext`` field (:func:`from_sequence_context`).
    """
    del query_chunk_size
    _check_shape("q", q, 4, "[1, S, index_n_heads, index_head_dim]")
    _check_shape("k", k, 3, "[1, S, index_head_dim]")
    _check_shape("gate_scores", gate_scores, 3, "[1, S, index_head_dim]")
    _check_shape("weights", weights, 3, "[1, S, index_n_heads]")
    S, H, D = q.shape[1], q.shape[2], q.shape[3]
    if int(index_head_dim) != D:
        raise ValueError(f"index_head_dim: expected q.shape[-1] = {D}, got {index_head_dim}")
    for name, t, want in (("k", k, [1, S, D]), ("gate_scores", gate_scores, [1, S, D]), ("weights", weights, [1, S, H])):
        if list(t.shape) != want:
            raise ValueError(f"{name}: expected shape {want} (from q [1, {S}, {H}, {D}]), got {list(t.shape)}")
    if not isinstance(kpool_ape, torch.Tensor) or list(kpool_ape.shape) != [int(index_kpool), D]:
        got = list(kpool_ape.shape) if isinstance(kpool_ape, torch.Tensor) else type(kpool_ape).__name__
        raise ValueError(f"kpool_ape: expected shape [index_kpool, index_head_dim] = [{index_kpool}, {D}], got {got}")
    if int(index_topk) % int(index_kpool):
        raise ValueError(f"index_topk: expected a multiple of index_kpool = {index_kpool}, got {index_topk}")
    seq = _cached_sequence(seq_ctx, S)
    options.setdefault("order", "ascending-unused-first")
    if replay is not None:
        from ..replay import shard

        inputs = {"q": q[0], "k": k[0], "gates": gate_scores[0], "head_weights": weights[0], "ape": kpool_ape}
        ids = shard(replay, seq, topk=int(index_topk), kpool=int(index_kpool),
                    tail="fixed", alignment=int(alignment), ids=replay_ids, missing=replay_missing,
                    inputs=inputs, device=q.device, **options)  # fmt: skip
    else:
        ids = kpool_topk(q[0], k[0], gate_scores[0], weights[0], kpool_ape, seq, topk=int(index_topk),
                         kpool=int(index_kpool), tail="fixed", alignment=int(alignment), **options)  # fmt: skip
    if not always_select_tail:
        ids[:, int(index_topk) : int(index_topk) + int(index_kpool) - 1] = -1
    return ids.unsqueeze(1)
