"""Replay a rollout engine's indexer selections in training, in any layout (``docs/contract.md`` §12).

RL stacks replay the rollout's indexer choices instead of recomputing them (as they replay
MoE routing): the engine records, per layer and request, each token's selected ids in
request-local positions. :func:`shard` turns those per-document captures into this rank's
rows exactly as :func:`sp_kpool.kpool_topk` lays them out (stream ids, the tail, the column
layout, padding rows ``-1``), in every layout of :class:`~sp_kpool.ShardedSequence`, after
validating every row it uses; :func:`compare` measures how far two selections differ (the
training/rollout mismatch monitor)::

    ids = replay.shard(captured, seq, config)                 # [S_local, config.width] int32
    ids = replay.shard(captured, seq, config, missing="compute", inputs=indexer.prepare(hidden, q_resid))
    report = replay.compare(ids, kpool_topk(...), seq)        # a collective, JSON-able

The capture's rows are read and validated in :mod:`sp_kpool.replay_rows`, the comparison
lives in :mod:`sp_kpool.replay_compare`; this module lays the rows out and calls the operator
for the rows not covered (every name stays importable from here).

**Capture** (``captured``): one integer array per real document of ``seq`` (a list, in
document order; ``torch.Tensor`` or NumPy), ``[T_d, W_d]``: row ``j`` holds what the row at
document-local position ``j`` selected, ``-1`` in unused columns (anywhere in the row).
Rows ``T_d ..`` of the document are **not covered** (an engine never runs the last
token); ``T_d <= len_d``. With ``ids="tokens"`` the values are document-local token
positions (history ids, and optionally some of the row's own tail ids); with
``ids="pools"`` document-local pool ids (pool ``p`` = tokens ``[p K, p K + K)``).

**Rows** (document-local ``j``, ``n = (j + 1) // K`` complete visible pools):

* history: the pools of the captured history ids, expanded to ``K`` ids each; tail: always
  the row's whole tail ``t - (j + 1) % K + 1 .. t`` (the tail is fixed by the contract, not
  selected: captured tail ids are validated and otherwise ignored).
* ``order="ascending"``: pools by ascending id, exactly as computed. ``order="score"`` (and
  ``"serving"``): replayed ids have no scores, so the pools keep **the capture's order**
  (the order of each pool's first id in the captured row): that is ``kpool_topk``'s score
  order when the capture came from a score-ordered selection (and the rollout engine's
  order otherwise); nothing is re-sorted.
* ``tail``, ``alignment``: as ``kpool_topk`` (:func:`sp_kpool.selection.assemble` lays the
  columns out: the same code as the computed path).

**Validation** of every replayed row before use (any failure is a ``ValueError`` naming
the document, the row, the capture's column and the value, raised alike on every rank
through the operator's agreement: one message naming each failing rank's first problem in
its rows, in real-row order): ids are ``-1`` or ``>= 0`` (inside the row's document); at or
before the row (tokens) or complete pools ending at or before it (pools); no id twice; the
history ids come in whole pools (tokens: all ``K`` tokens of a pool); at most ``topk // K``
pools.

**Rows not covered** (``missing=``): ``"compute"`` (default) computes them with
:func:`sp_kpool.kpool_topk` from ``inputs`` (the operator's tensors of the local rows: a
dict with exactly the keys ``q, k, gates, head_weights, ape``, as ``KPoolIndexer.prepare``
returns it, or a tuple in that order, the operator's argument order, or a callable returning
either, called only when some row of the sequence is not covered; a missing, unknown or
non-tensor entry is an error naming ``inputs[...]``); as
``kpool_topk`` is a collective, every rank computes when any rank has such a row (the
coverage is global, so every rank decides alike); ``"fail"`` raises naming the first such
document and row; ``"empty"`` gives such a row no history (all ``-1``) but its tail (what
attention can use without the engine's choice).
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, Sequence

import torch

from ._device import to_device
from .agreement import LAYOUT_CODES, LAYOUT_NAMES, _agree, _check_seq, fail_on_every_rank
from .checks import check_choice
from .config import KPoolConfig, RunOptions, split_keywords
from .pooling import pool_table
from .replay_compare import _local_real, compare
from .replay_rows import (
    ReplayError,
    _captures,
    _first_problem,
    _reason,
    captured_rows,
    narrow_dtype,
    select_rows,
)
from .selection import assemble, row_meta
from .settings import Settings
from .sharding import ShardedSequence

__all__ = ["IDS", "MISSING", "INPUTS", "shard", "shard_local", "documents", "compare", "captured_rows", "ReplayError",
           "sample_rows"]

#: ``ids=``: document-local token positions, or document-local pool ids.
IDS = ("tokens", "pools")
#: ``missing=``: rows the capture does not cover are computed, refused, or get only the tail.
MISSING = ("compute", "fail", "empty")

#: captured entries ``[rows, columns]`` validated at once: the scratch of a chunk is about
#: ``_CHUNK_ENTRIES * replay_rows.SCRATCH_BYTES_PER_ENTRY`` = 128 MiB, whatever the sequence's length
_CHUNK_ENTRIES = 1 << 22

_CONFIG_SIGNATURE = tuple(e[0] for e in KPoolConfig(topk=1, kpool=1).signature())


# --------------------------------------------------------------------------- shard


def _signature(seq, config: KPoolConfig | None, captures, ids: str, missing: str) -> list[tuple]:
    is_seq = isinstance(seq, ShardedSequence)
    shapes = [(int(c.shape[0]), int(c.shape[1])) for c in captures] if captures is not None else None
    sig = [
        ("replay: captured documents", len(shapes) if shapes is not None else -1),
        ("replay: captured rows and widths (crc32)", zlib.crc32(repr(shapes).encode()) if shapes is not None else -1),
        ("replay: ids", IDS.index(ids) if ids in IDS else -1, {-1: "invalid", **dict(enumerate(IDS))}),
        ("replay: missing", MISSING.index(missing) if missing in MISSING else -1,
         {-1: "invalid", **dict(enumerate(MISSING))}),
        ("cu_seq_lens (crc32)", zlib.crc32(seq.cu_seq_lens.numpy().tobytes()) if is_seq else -1),
        ("layout", LAYOUT_CODES.get(seq.layout, -2) if is_seq else -1, LAYOUT_NAMES),
        ("rows per rank (crc32)", seq.layout_crc if is_seq else -1),
        ("world_size", seq.world_size if is_seq else -1),
    ]  # fmt: skip
    if config is None:
        return sig + [(name, -1) for name in _CONFIG_SIGNATURE]
    return sig + config.signature()


#: ``inputs=``: the operator's tensors, in its argument order (``kpool_topk(q, k, gates, head_weights, ape, ...)``)
INPUTS = ("q", "k", "gates", "head_weights", "ape")


def _operator_inputs(inputs: Any) -> dict[str, torch.Tensor]:
    """``inputs=`` (a dict with the keys :data:`INPUTS` or a tuple in that order) as
    ``kpool_topk``'s keyword arguments; errors name ``inputs[...]``."""
    expected = ", ".join(INPUTS)
    if isinstance(inputs, (tuple, list)):
        if len(inputs) != len(INPUTS):
            raise ValueError(f"inputs: expected {len(INPUTS)} tensors in the operator's order ({expected}), "
                             f"got {len(inputs)}")  # fmt: skip
        inputs = dict(zip(INPUTS, inputs))
        names = {k: f"inputs[{i}] ({k})" for i, k in enumerate(INPUTS)}
    elif isinstance(inputs, dict):
        for key in inputs:
            if key not in INPUTS:
                raise ValueError(f"inputs[{key!r}]: unknown key (expected the keys {expected})")
        for key in INPUTS:
            if key not in inputs:
                raise ValueError(f"inputs[{key!r}]: missing (expected the keys {expected})")
        names = {k: f"inputs[{k!r}]" for k in INPUTS}
    else:
        raise TypeError(f"inputs: expected a dict of tensors ({expected}), a tuple in that order or a callable "
                        f"returning either, got {type(inputs).__name__}")  # fmt: skip
    for key in INPUTS:
        if not isinstance(inputs[key], torch.Tensor):
            raise TypeError(f"{names[key]}: expected a tensor, got {type(inputs[key]).__name__}")
    return {k: inputs[k] for k in INPUTS}


def _device_of(device, inputs, captures) -> torch.device:
    if device is not None:
        return torch.device(device)
    if isinstance(inputs, dict):
        return inputs["q"].device
    for c in captures:
        return c.device
    return torch.device("cpu")


@torch.no_grad()
def shard(
    captured: Sequence[Any],
    seq: ShardedSequence,
    config: KPoolConfig | None = None,
    *,
    ids: str = "tokens",
    missing: str = "compute",
    inputs: dict[str, torch.Tensor] | Sequence[torch.Tensor] | Callable[[], Any] | None = None,
    options: RunOptions | None = None,
    settings: Settings | None = None,
    device: torch.device | str | None = None,
    **keywords: Any,
) -> torch.Tensor:
    """This rank's ``[S_local, config.width]`` int32 ids from per-document captures.

    Args:
        captured: one ``[T_d, W_d]`` integer array per real document of ``seq`` (see the
            module docstring), the same on every rank (each rank reads only its rows).
        seq: the sharding, any layout; ids are stream positions, padding rows ``-1``.
        config: the :class:`~sp_kpool.config.KPoolConfig` (``topk``, ``kpool``, ``tail``,
            ``order``, ``alignment``), or ``None`` and keywords (``topk=2048, kpool=4``).
        ids: ``"tokens"`` (document-local token positions) or ``"pools"`` (pool ids).
        missing: ``"compute"``, ``"fail"`` or ``"empty"`` for rows the capture does not cover.
        inputs: ``missing="compute"``: ``kpool_topk``'s tensors of the local rows, a dict
            with exactly the keys ``q, k, gates, head_weights, ape`` (:data:`INPUTS`) or a
            tuple in that order (the operator's argument order), or a callable returning
            either (called only when some row is not covered). A missing, unknown or
            non-tensor entry raises naming ``inputs[...]``.
        options, settings: for that ``kpool_topk`` call (and the agreement's timeout).
        device: of the output (default: the device of ``inputs["q"]``, else of the captures).

    Returns ``[S_local, align(topk + K - 1, alignment)]`` int32: for a capture of a
    ``kpool_topk`` call's own ids (as document positions), bit for bit that call's output.

    Raises ``TypeError``/``ValueError`` naming the argument; a bad capture is a
    ``ValueError`` naming the document, row, column and value. With several ranks every
    rank raises the same error (one small all-gather, before anything is computed).
    """
    error: Exception | None = None
    captures = cfg = opts = None
    out = None
    try:
        _check_seq(seq)
        cfg, opts = split_keywords(config, options, keywords)
        check_choice("ids", ids, IDS)
        check_choice("missing", missing, MISSING)
        captures = _captures(captured, seq)
        if missing == "compute" and inputs is None:
            raise ValueError("inputs: missing='compute' needs the operator's inputs (a dict of q, k, gates, "
                             "head_weights, ape, or a callable returning it), got None")  # fmt: skip
        if inputs is not None and not callable(inputs):
            inputs = _operator_inputs(inputs)
        dev = _device_of(device, inputs, captures)
        out = _replay_local(captures, seq, cfg, ids == "pools", missing, dev)
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it
        error = exc
    _agree(seq, error, _signature(seq, cfg, captures, ids, missing), settings, None)
    ids_out, uncovered = out
    if missing == "compute" and _uncovered_anywhere(captures, seq):
        try:
            given = _operator_inputs(inputs()) if callable(inputs) else inputs
        except Exception as exc:  # noqa: BLE001 - the other ranks are in kpool_topk's agreement
            fail_on_every_rank(seq, exc, settings)
        from .api import kpool_topk

        # exactly the uncovered rows (every rank calls, each with its own, possibly none)
        computed = kpool_topk(**given, seq=seq, config=cfg, options=opts, settings=settings, rows=uncovered)
        if uncovered.numel():
            at = to_device(uncovered, ids_out.device)
            ids_out[at] = computed[at.to(computed.device)].to(ids_out.device)
    return ids_out


def sample_rows(seq: ShardedSequence, fraction: float, seed: int) -> torch.Tensor:
    """This rank's storage rows of a verification sample (int64 CPU, ascending): ``round(fraction
    * n)`` of its ``n`` real rows, those of lowest priority in one random permutation of every
    real row of the sequence drawn from ``seed`` (the same on every rank, so a row's fate does
    not depend on the layout; another seed, e.g. the step, samples other rows). ``fraction``
    in ``[0, 1]``; ``1.0``: every real row."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"verify_rows: expected a fraction in [0, 1], got {fraction!r}")
    storage = seq.storage_index()
    n = storage.numel()
    if fraction >= 1.0:
        return torch.sort(storage).values
    g = torch.Generator().manual_seed(int(seed))
    priority = torch.randperm(seq.num_real_tokens, generator=g)[seq.real_rows()]
    keep = torch.argsort(priority)[: int(round(fraction * n))]
    return torch.sort(storage[keep]).values


@torch.no_grad()
def shard_local(captured: Sequence[Any], seq: ShardedSequence, config: KPoolConfig, *, ids: str = "tokens",
                missing: str = "empty", device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`shard`'s work on this rank alone: no agreement, no communication, nothing computed.

    For in-process simulations of several ranks and callers that agree themselves. Returns
    ``(ids [S_local, width] int32, uncovered [u] int64 CPU)``: the replayed rows and the
    storage rows the capture does not cover (their history ``-1``, their tail kept, as
    ``missing="empty"``; ``missing="fail"`` raises instead). Errors are raised on this rank only.
    """
    if not isinstance(seq, ShardedSequence):
        raise TypeError(f"seq: expected a ShardedSequence, got {type(seq).__name__}")
    if not isinstance(config, KPoolConfig):
        raise TypeError(f"config: expected a KPoolConfig, got {type(config).__name__}")
    check_choice("ids", ids, IDS)
    check_choice("missing", missing, ("fail", "empty"))
    captures = _captures(captured, seq)
    return _replay_local(captures, seq, config, ids == "pools", missing, _device_of(device, None, captures))


def _uncovered_anywhere(captures, seq: ShardedSequence) -> bool:
    cu = seq.real_cu_seq_lens.tolist()
    return any(int(c.shape[0]) < cu[d + 1] - cu[d] for d, c in enumerate(captures))


def _replay_local(captures, seq: ShardedSequence, cfg: KPoolConfig, pools: bool, missing: str, dev):
    """``(ids [S_local, width] int32, uncovered storage rows [u] int64 CPU)`` of this rank, or
    raises :class:`ReplayError` on the first bad row (in real-row order)."""
    K, T = cfg.kpool, cfg.topk
    cu = seq.real_cu_seq_lens
    rows = seq.real_rows()
    R, W = rows.numel(), max((int(c.shape[1]) for c in captures), default=0)
    k_sel = max(1, min(T // K, W))
    covered = torch.zeros(R, dtype=torch.bool, device=dev)
    doc = torch.searchsorted(cu, rows, right=True) - 1
    j_all = (rows - cu[doc]).to(dev)
    length_all = (cu[doc + 1] - cu[doc]).to(dev)
    selected = torch.full((R, k_sel), -1, dtype=torch.int32, device=dev)
    step = max(1, _CHUNK_ENTRIES // max(W, 1))
    capture_order = cfg.order != "ascending"
    first_bad = None
    for a in range(0, R, step):
        b = min(R, a + step)
        vals, covered[a:b] = captured_rows(captures, cu, rows[a:b], dev, W, narrow_dtype(captures) if pools else
                                           torch.int32)  # fmt: skip
        bad, selected[a:b] = select_rows(vals, j_all[a:b], K, T, pools, capture_order, k_sel)
        if first_bad is None and bool(bad.any()):  # the first bad row (real-row order) and its captured row
            i = int(torch.nonzero(bad)[0])
            first_bad = (a + i, vals[i].to(torch.int32))
    if first_bad is not None:
        i, row = first_bad
        d, j, length = int(doc[i]), int(j_all[i]), int(length_all[i])
        code, col = _first_problem(row, j_all[i], K, T, pools)
        value = int(row[col])
        raise ReplayError(f"captured: document {d}, row {j}, column {col}: value {value}: "
                          f"{_reason(code, value, j, length, K, T, pools, d)}")  # fmt: skip
    uncovered_local = torch.nonzero(~covered.cpu()).flatten()
    if missing == "fail" and uncovered_local.numel():
        i = int(uncovered_local[0])
        d = int(doc[i])
        raise ReplayError(f"captured: document {d}, row {int(j_all[i])}: not covered by the capture "
                          f"(captured[{d}] has {int(captures[d].shape[0])} rows, the document "
                          f"{int(length_all[i])}; missing='fail')")  # fmt: skip
    pool_tok_start, doc_pool_offset = pool_table(cu, K)
    if cu.numel() > 2:  # global pool ids (one document: they are its own)
        offs = to_device(doc_pool_offset, dev).to(torch.int32)[to_device(doc, dev)]
        selected = torch.where(selected >= 0, selected + offs[:, None], -1)
    meta = row_meta(to_device(rows, dev), cu, doc_pool_offset, K)
    storage = seq.storage_index()
    if not R:
        return torch.full((seq.shard_size, cfg.width), -1, dtype=torch.int32, device=dev), storage[uncovered_local]
    expanded = seq.stream_ids(assemble(selected, meta, to_device(pool_tok_start, dev), topk=T, kpool=K, tail=cfg.tail,
                                       order=cfg.order, alignment=cfg.alignment, presorted=cfg.order == "ascending"))  # fmt: skip
    if R == seq.shard_size and bool((storage == torch.arange(R)).all()):  # every row real, in real-row order
        return expanded, storage[uncovered_local]
    out = torch.full((seq.shard_size, cfg.width), -1, dtype=torch.int32, device=dev)
    out[to_device(storage, dev)] = expanded
    return out, storage[uncovered_local]


def documents(ids: torch.Tensor, seq: ShardedSequence, *, as_pools: bool = False,
              kpool: int | None = None) -> list[torch.Tensor]:  # fmt: skip
    """A world-size-1 selection as a capture: the inverse of :func:`shard`.

    ``ids``: ``[S, W]`` (stream ids, ``-1`` unused) of a ``seq`` with ``world_size == 1``,
    e.g. ``kpool_topk``'s output. Returns one int32 ``[len_d, W']`` CPU tensor per real
    document: its rows' ids as document-local token positions (``W' = W``), or with
    ``as_pools`` (``kpool`` needed) its history pools as document-local pool ids in column
    order (``W' = W // kpool``, the tail dropped), ``-1`` unused.
    """
    if not isinstance(seq, ShardedSequence) or seq.world_size != 1:
        raise ValueError(f"seq: expected a ShardedSequence of world size 1, got {seq!r}")
    if as_pools and kpool is None:
        raise ValueError("kpool: needed with as_pools=True, got None")
    real = _local_real(ids.cpu(), seq)  # [N, W] real-row ids, real-row order
    cu = seq.real_cu_seq_lens
    out = []
    for d in range(cu.numel() - 1):
        a, b = int(cu[d]), int(cu[d + 1])
        v = real[a:b]
        local = torch.where(v >= 0, v - a, -1)
        if as_pools:
            j = torch.arange(b - a)[:, None]
            start = (local >= 0) & (local % kpool == 0) & (local < ((j + 1) // kpool) * kpool)
            pools = torch.where(start, local // kpool, -1)
            keep = torch.sort((~start).to(torch.int8), dim=1, stable=True).indices
            local = pools.gather(1, keep)[:, : max(1, v.shape[1] // kpool)]
        out.append(local.to(torch.int32))
    return out


