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

One cohesive concept over 500 lines, so one module: a rollout selection replayed, whose
validation, layout and comparison all apply the row rules below.

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
:func:`sp_kpool.kpool_topk` from ``inputs`` (the operator's tensors ``q, k, gates,
head_weights, ape`` of the local rows, as a dict such as ``KPoolIndexer.prepare`` returns,
or a callable returning it, called only when some row of the sequence is not covered); as
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
from .selection import assemble, row_meta
from .settings import Settings
from .sharding import ShardedSequence

__all__ = ["IDS", "MISSING", "shard", "shard_local", "documents", "compare", "captured_rows", "ReplayError",
           "sample_rows"]

#: ``ids=``: document-local token positions, or document-local pool ids.
IDS = ("tokens", "pools")
#: ``missing=``: rows the capture does not cover are computed, refused, or get only the tail.
MISSING = ("compute", "fail", "empty")

# per-entry validation codes, in the order a row's problems are reported
_OK, _NEGATIVE, _NOT_CAUSAL, _DUPLICATE, _PARTIAL_POOL, _TOO_MANY = range(6)
_BIG = torch.iinfo(torch.int64).max
#: entries ``[rows, columns]`` validated at once (bounds the scratch memory)
_CHUNK_ENTRIES = 1 << 22

_CONFIG_SIGNATURE = tuple(e[0] for e in KPoolConfig(topk=1, kpool=1).signature())


class ReplayError(ValueError):
    """A capture that cannot be replayed (the message names the document, row, column and value)."""


# --------------------------------------------------------------------------- capture access


def _as_capture(d: int, a: Any) -> torch.Tensor:
    """Document ``d``'s capture as a 2-D integer tensor (NumPy arrays are wrapped, not copied)."""
    if type(a).__module__ == "numpy" and hasattr(a, "dtype"):
        if a.dtype.kind not in "iu":
            raise TypeError(f"captured[{d}]: expected an integer array, got dtype {a.dtype}")
        wide = a.dtype.kind == "u" and a.dtype.itemsize > 1  # torch has few ops on uint16..uint64
        a = torch.from_numpy(a.astype("int64" if wide else a.dtype.newbyteorder("="), copy=False))
    if not isinstance(a, torch.Tensor):
        raise TypeError(f"captured[{d}]: expected a 2-D integer tensor or NumPy array [T_doc, width], "
                        f"got {type(a).__name__}")  # fmt: skip
    if a.dtype.is_floating_point or a.dtype.is_complex or a.dtype == torch.bool:
        raise TypeError(f"captured[{d}]: expected an integer dtype, got {a.dtype}")
    if a.dim() != 2:
        raise ValueError(f"captured[{d}]: expected a 2-D array [T_doc, width], got shape {list(a.shape)}")
    if a.dtype in (torch.uint16, torch.uint32, torch.uint64):
        a = a.to(torch.int64)
    return a


def _captures(captured: Any, seq: ShardedSequence) -> list[torch.Tensor]:
    """The per-document captures, checked against the real documents of ``seq``."""
    if isinstance(captured, torch.Tensor) or not isinstance(captured, (list, tuple)):
        raise TypeError(f"captured: expected a list of [T_doc, width] integer arrays, one per real document, "
                        f"got {type(captured).__name__}")  # fmt: skip
    cu = seq.real_cu_seq_lens.tolist()
    n_docs = len(cu) - 1
    if len(captured) != n_docs:
        raise ValueError(f"captured: expected {n_docs} arrays (one per real document of seq), got {len(captured)}")
    out = []
    for d, a in enumerate(captured):
        t = _as_capture(d, a)
        length = cu[d + 1] - cu[d]
        if t.shape[0] > length:
            raise ValueError(f"captured[{d}]: expected at most {length} rows (the document's length), "
                             f"got {t.shape[0]}")  # fmt: skip
        out.append(t)
    return out


def captured_rows(captures: Sequence[torch.Tensor], cu: torch.Tensor, rows: torch.Tensor, device,
                  width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The captured rows of real rows ``rows`` (ascending int64 CPU; ``cu`` the real documents'
    boundaries): ``(values [R, W] int32, covered [R] bool)`` on ``device``, ``W`` the widest
    capture (or ``width``), ``-1`` past a document's width and in rows the capture does not
    cover."""
    if width is None:
        width = max((int(c.shape[1]) for c in captures), default=0)
    R = rows.numel()
    vals = torch.full((R, width), -1, dtype=torch.int32, device=device)
    covered = torch.zeros(R, dtype=torch.bool)
    if R == 0:
        return vals, covered.to(device)

    def int32(x: torch.Tensor) -> torch.Tensor:  # int64 values saturate (and then fail validation)
        if x.dtype == torch.int64:
            return x.to(device).clamp(-2, _BIG32 - 1).to(torch.int32)
        return x.to(device, torch.int32)  # int32 and narrower

    doc = torch.searchsorted(cu, rows, right=True) - 1
    d_lo, d_hi = int(doc[0]), int(doc[-1]) + 1
    bounds = torch.searchsorted(doc, torch.arange(d_lo, d_hi + 1), right=False).tolist()
    for d in range(d_lo, d_hi):
        a, b = bounds[d - d_lo], bounds[d - d_lo + 1]
        if a == b:
            continue
        cap = captures[d]
        j = rows[a:b] - cu[d]
        n = int(cap.shape[0])
        if int(j[-1]) < n:  # every row covered
            vals[a:b, : cap.shape[1]] = int32(cap.index_select(0, j.to(cap.device)))
            covered[a:b] = True
            continue
        sel = torch.nonzero(j < n).flatten()
        if sel.numel():
            vals[a + sel.to(device), : cap.shape[1]] = int32(cap.index_select(0, j[sel].to(cap.device)))
            covered[a + sel] = True
    return vals, covered.to(device)


# --------------------------------------------------------------------------- validation


_BIG32 = torch.iinfo(torch.int32).max


def _sorted_live(v: torch.Tensor, limit: torch.Tensor):
    """``v`` with invalid entries (``< 0`` or ``>= limit``) as a large value, sorted per row:
    ``(sorted [r, W] int32, perm [r, W] int64, live-and-sorted mask)``."""
    live = (v >= 0) & (v < limit[:, None])
    s, perm = torch.sort(torch.where(live, v, _BIG32), dim=1, stable=True)
    return s, perm, s != _BIG32


def _check_rows(v: torch.Tensor, j: torch.Tensor, kpool: int, topk: int, pools: bool, capture_order: bool):
    """Validate ``v [r, W]`` int32 (the captured rows; ``j [r]`` their document-local
    positions) and select: ``(bad [r] bool, pools [r, W] int64, first [r, W] int64 or None)``:
    the rows with a problem (:func:`_first_problem` names it), each row's document-local
    pools ascending (``-1`` after them) and, with ``capture_order``, for each the first
    captured column holding one of its ids (a large value after them)."""
    r, W = v.shape
    dev = v.device
    n_vis = ((j + 1) // kpool).to(torch.int32)
    limit = n_vis if pools else (j + 1).to(torch.int32)  # exclusive bound of a valid (causal) value
    bad = ((v < -1) | (v >= limit[:, None])).any(1)
    s, perm, ok = _sorted_live(v, limit)
    if W > 1:
        bad |= ((s[:, 1:] == s[:, :-1]) & ok[:, 1:]).any(1)  # an id twice
    hist = ok if pools else ok & (s < (n_vis * kpool)[:, None])
    pool = s if pools else torch.div(s, kpool, rounding_mode="floor")
    start = hist.clone()
    if W > 1:
        start[:, 1:] &= pool[:, 1:] != pool[:, :-1]
    n_pools = start.sum(1)
    if not pools:
        bad |= hist.sum(1) != n_pools * kpool  # some pool not whole
    bad |= n_pools > topk // kpool
    gid = torch.where(start, torch.cumsum(start, dim=1, dtype=torch.int64) - 1, W)  # column W: a dump
    pool_ids = torch.full((r, W + 1), -1, dtype=torch.int64, device=dev)
    pool_ids.scatter_(1, gid, pool.to(torch.int64).masked_fill_(~start, -1))
    first = None
    if capture_order:  # each pool's first captured column: its ids are consecutive in sorted order
        member = torch.where(hist, torch.cumsum(start, dim=1, dtype=torch.int64) - 1, W)
        first = torch.full((r, W + 1), _BIG, dtype=torch.int64, device=dev)
        first.scatter_reduce_(1, member, perm, "amin")
        first = first[:, :W]
    return bad, pool_ids[:, :W], first


def _first_problem(v: torch.Tensor, j: torch.Tensor, kpool: int, topk: int, pools: bool) -> tuple[int, int]:
    """``(code, column)`` of the first problem of one bad captured row ``v [W]`` int32 (the
    lowest code, then the lowest column)."""
    W = v.numel()
    v, j = v[None], j.reshape(1)
    n_vis = (j + 1) // kpool
    limit = n_vis if pools else j + 1
    code = torch.zeros((1, W), dtype=torch.int64, device=v.device)
    code.masked_fill_(v < -1, _NEGATIVE)
    code.masked_fill_(v >= limit[:, None], _NOT_CAUSAL)
    s, perm, ok = _sorted_live(v, limit)
    dup = torch.zeros_like(ok)
    if W > 1:
        dup[:, 1:] = (s[:, 1:] == s[:, :-1]) & ok[:, 1:]
    hist = ok & ~dup
    if not pools:
        hist &= s < (n_vis * kpool)[:, None]
    partial = torch.zeros_like(ok)
    if not pools and kpool > 1:
        slot = torch.where(hist, s % kpool, 0)
        pos = torch.arange(W, device=v.device)[None]
        lo, hi, base = pos - slot, pos - slot + kpool - 1, s - slot
        whole = (lo >= 0) & (s.gather(1, lo.clamp(0, W - 1)) == base)
        whole &= (hi < W) & (s.gather(1, hi.clamp(0, W - 1)) == base + kpool - 1)
        partial = hist & ~whole
    start = hist & ~partial & ((s % kpool == 0) if not pools else torch.ones_like(hist))
    too_many = start & (torch.cumsum(start.to(torch.int64), dim=1) > topk // kpool)
    in_sorted = torch.zeros_like(code)
    in_sorted.masked_fill_(too_many, _TOO_MANY).masked_fill_(partial, _PARTIAL_POOL).masked_fill_(dup, _DUPLICATE)
    code = torch.where(code > 0, code, torch.zeros_like(code).scatter_(1, perm, in_sorted))[0].tolist()
    c = min(x for x in code if x > 0)
    return c, code.index(c)


def _reason(code: int, value: int, j: int, length: int, kpool: int, topk: int, pools: bool, d: int) -> str:
    if code == _NEGATIVE:
        return f"expected a {'pool id' if pools else 'token position'} >= 0 (inside the document) or -1 (unused)"
    if code == _NOT_CAUSAL:
        if pools:
            n = (j + 1) // kpool
            where = "outside the document" if value >= length // kpool else "not causal"
            return (f"{where}: expected a complete pool ending at or before the row, pool ids < (j + 1) // K = {n} "
                    f"(document {d} has {length // kpool} pools)")  # fmt: skip
        if value >= length:
            return f"outside document {d} of {length} tokens (expected a position <= {j}, the row)"
        return f"after the row (not causal): expected a position <= {j}"
    if code == _DUPLICATE:
        return "selected twice in the row"
    if code == _PARTIAL_POOL:
        p = value // kpool
        return (f"pool {p} (positions {p * kpool}..{p * kpool + kpool - 1}) is not whole: history ids must come in "
                f"whole pools of K = {kpool}")  # fmt: skip
    return f"more than topk // K = {topk // kpool} history pools in the row"


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


def _device_of(device, inputs, captures) -> torch.device:
    if device is not None:
        return torch.device(device)
    if isinstance(inputs, dict) and isinstance(inputs.get("q"), torch.Tensor):
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
    inputs: dict[str, torch.Tensor] | Callable[[], dict[str, torch.Tensor]] | None = None,
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
        inputs: ``missing="compute"``: ``{"q", "k", "gates", "head_weights", "ape"}`` of the
            local rows (``kpool_topk``'s tensors) or a callable returning them.
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
        if inputs is not None and not (isinstance(inputs, dict) or callable(inputs)):
            raise TypeError(f"inputs: expected a dict of tensors or a callable, got {type(inputs).__name__}")
        dev = _device_of(device, inputs, captures)
        out = _replay_local(captures, seq, cfg, ids == "pools", missing, dev)
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it
        error = exc
    _agree(seq, error, _signature(seq, cfg, captures, ids, missing), settings, None)
    ids_out, uncovered = out
    if missing == "compute" and _uncovered_anywhere(captures, seq):
        try:
            given = inputs() if callable(inputs) else inputs
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
    bad_rows = torch.zeros(R, dtype=torch.bool, device=dev)
    selected = torch.full((R, k_sel), -1, dtype=torch.int64, device=dev)
    step = max(1, _CHUNK_ENTRIES // max(W, 1))
    capture_order = cfg.order != "ascending"
    first_bad = None
    for a in range(0, R, step):
        b = min(R, a + step)
        vals, covered[a:b] = captured_rows(captures, cu, rows[a:b], dev, W)
        bad, pids, first = _check_rows(vals, j_all[a:b], K, T, pools, capture_order)
        if first_bad is None and bool(bad.any()):  # the first bad row (real-row order) and its captured row
            i = int(torch.nonzero(bad)[0])
            first_bad = (a + i, vals[i].clone())
        if capture_order:  # the capture's order: by each pool's first captured column
            pids = pids.gather(1, torch.sort(first, dim=1, stable=True).indices)
        selected[a:b, : min(k_sel, W)] = pids[:, :k_sel]
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
    offs = to_device(doc_pool_offset, dev)[to_device(doc, dev)]
    selected = torch.where(selected >= 0, selected + offs[:, None], -1)
    meta = row_meta(to_device(rows, dev), cu, doc_pool_offset, K)
    out = torch.full((seq.shard_size, cfg.width), -1, dtype=torch.int32, device=dev)
    storage = seq.storage_index()
    if R:
        expanded = assemble(selected, meta, to_device(pool_tok_start, dev), topk=T, kpool=K, tail=cfg.tail,
                            order=cfg.order, alignment=cfg.alignment, presorted=cfg.order == "ascending")  # fmt: skip
        out[to_device(storage, dev)] = seq.stream_ids(expanded)
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


# --------------------------------------------------------------------------- compare


def _local_real(ids: torch.Tensor, seq: ShardedSequence) -> torch.Tensor:
    """This rank's real rows of ``ids`` (storage order -> real-row order), as real-row ids int64."""
    rows = ids.index_select(0, to_device(seq.storage_index(), ids.device)).to(torch.int64)
    return seq.real_ids(rows)


def _pool_of(ids: torch.Tensor, meta, cu: torch.Tensor, kpool: int, doc: torch.Tensor) -> torch.Tensor:
    """Global pool ids of history ids (real rows) of each row, ``-2`` for tail ids, ``-1`` unused."""
    start = cu.to(ids.device)[doc][:, None]
    local = ids - start
    hist = (ids >= 0) & (local < (meta.n_visible[:, None] * kpool))
    pool = meta.pool_lo[:, None] + torch.div(local, kpool, rounding_mode="floor")
    return torch.where(hist, pool, torch.where(ids >= 0, -2, -1))


@torch.no_grad()
def compare(
    replayed: torch.Tensor,
    computed: torch.Tensor,
    seq: ShardedSequence,
    *,
    scores: torch.Tensor | None = None,
    kpool: int | None = None,
    rel_tol: float = 1e-4,
    settings: Settings | None = None,
    rows: torch.Tensor | None = None,
) -> dict[str, Any]:
    """How far two selections of this rank's rows differ, totalled over every rank (a collective).

    Args:
        replayed, computed: ``[S_local, W]`` integer ids (stream positions, ``-1`` unused),
            e.g. :func:`shard`'s and ``kpool_topk``'s; compared per row as **sets** (the
            column layout does not matter), padding rows excluded.
        seq: the sharding of both.
        scores: optional ``[S_local, P]`` float scores of every (real, global) pool for the
            local rows (storage order; ``P`` the real documents' complete pools); with it,
            ``kpool`` is needed and differing rows are classified as near-ties when every
            pool in the symmetric difference scores within ``rel_tol * max|score|`` (over
            the pools of both sets, ``+ 1e-9``) of the boundary, the lowest score among
            ``computed``'s pools; a differing tail is never a tie.
        settings: the agreement's timeout (:class:`~sp_kpool.settings.Settings`).
        rows: compare only these storage rows (1-D integer tensor, e.g. :func:`sample_rows`);
            ``None``: every real row.

    Returns (equal on every rank, JSON-able): ``rows`` (real rows compared), ``rows_differing``,
    ``fraction_differing``, ``jaccard_mean``, ``jaccard_min`` (1.0 without rows),
    ``ids_only_replayed``, ``ids_only_computed`` (totals), ``first_difference`` (``None``,
    or the lowest differing real row: ``{"real_row", "document", "row", "stream_position",
    "rank", "only_replayed", "only_computed"}`` with up to 8 ids of each, stream positions),
    and with ``scores``: ``rows_near_ties`` and ``rows_beyond_ties``.
    """
    error = a = b = None
    try:
        _check_seq(seq)
        for name, t in (("replayed", replayed), ("computed", computed)):
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != seq.shard_size:
                got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name}: expected a [S_local = {seq.shard_size}, W] tensor, got {got}")
            if t.dtype.is_floating_point or t.dtype == torch.bool:
                raise TypeError(f"{name}: expected integer ids, got {t.dtype}")
        if scores is not None:
            if kpool is None:
                raise ValueError("kpool: needed with scores (to map ids to pools), got None")
            if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or scores.shape[0] != seq.shard_size:
                got = list(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
                raise ValueError(f"scores: expected a [S_local = {seq.shard_size}, P] tensor, got {got}")
        dev = replayed.device
        for name, t in (("replayed", replayed), ("computed", computed)):
            try:
                mapped = _local_real(t.to(dev), seq)
            except ValueError:
                raise ValueError(f"{name}: an id is the stream position of a padding token") from None
            a, b = (mapped, b) if name == "replayed" else (a, mapped)
    except Exception as exc:  # noqa: BLE001
        error = exc
    sig = [("compare: scores given", int(scores is not None))]
    _agree(seq, error, sig, settings, None)
    subset, rows, storage = rows, seq.real_rows(), seq.storage_index()
    if subset is not None:  # the sample only: its rows in real-row order
        keep = torch.isin(storage, subset.cpu())
        rows, storage = rows[keep], storage[keep]
        a, b = a[to_device(keep, a.device)], b[to_device(keep, b.device)]
    R = rows.numel()
    sa = torch.sort(torch.where(a >= 0, a, _BIG), dim=1).values
    sb = torch.sort(torch.where(b >= 0, b, _BIG), dim=1).values
    na, nb = (sa != _BIG).sum(1), (sb != _BIG).sum(1)
    if sa.shape[1] and R:
        idx = torch.searchsorted(sa, sb).clamp_max_(sa.shape[1] - 1)
        inter = ((sa.gather(1, idx) == sb) & (sb != _BIG)).sum(1)
    else:
        inter = torch.zeros(R, dtype=torch.int64, device=dev)
    union = na + nb - inter
    jac = torch.where(union > 0, inter.double() / union.clamp_min(1).double(), 1.0)
    differ = (inter != na) | (inter != nb)
    n_diff = int(differ.sum())
    first = int(torch.nonzero(differ).flatten()[0]) if n_diff else -1
    local = {
        "rows": R, "rows_differing": n_diff, "jaccard_sum": float(jac.sum()) if R else 0.0,
        "jaccard_min": float(jac.min()) if R else 1.0, "only_replayed": int((na - inter).sum()),
        "only_computed": int((nb - inter).sum()), "first_row": int(rows[first]) if first >= 0 else -1,
    }  # fmt: skip
    if first >= 0:
        ra, rb = set(sa[first][sa[first] != _BIG].tolist()), set(sb[first][sb[first] != _BIG].tolist())
        to_stream = seq.stream_ids
        local["first_only_replayed"] = to_stream(torch.tensor(sorted(ra - rb)[:8], dtype=torch.int64)).tolist()
        local["first_only_computed"] = to_stream(torch.tensor(sorted(rb - ra)[:8], dtype=torch.int64)).tolist()
    if scores is not None:
        ties = 0
        if n_diff:
            cu = seq.real_cu_seq_lens
            doc = (torch.searchsorted(cu, rows, right=True) - 1).to(dev)
            meta = row_meta(to_device(rows, dev), cu, pool_table(cu, kpool)[1], kpool)
            pa, pb = _pool_of(a, meta, cu, kpool, doc), _pool_of(b, meta, cu, kpool, doc)
            local_scores = scores.index_select(0, to_device(storage, scores.device)).to(dev).double()
            ties = _near_ties(pa[differ], pb[differ], local_scores[differ], rel_tol)
        local["rows_near_ties"] = ties
    totals = _gather_json(local, seq, settings)
    rows_all = sum(t["rows"] for t in totals)
    diff_all = sum(t["rows_differing"] for t in totals)
    report: dict[str, Any] = {
        "rows": rows_all,
        "rows_differing": diff_all,
        "fraction_differing": diff_all / rows_all if rows_all else 0.0,
        "jaccard_mean": sum(t["jaccard_sum"] for t in totals) / rows_all if rows_all else 1.0,
        "jaccard_min": min(t["jaccard_min"] for t in totals),
        "ids_only_replayed": sum(t["only_replayed"] for t in totals),
        "ids_only_computed": sum(t["only_computed"] for t in totals),
        "first_difference": None,
    }
    firsts = [(t["first_row"], r) for r, t in enumerate(totals) if t["first_row"] >= 0]
    if firsts:
        real_row, r = min(firsts)
        cu = seq.real_cu_seq_lens
        d = int(torch.searchsorted(cu, torch.tensor([real_row]), right=True)[0]) - 1
        report["first_difference"] = {
            "real_row": real_row, "document": d, "row": real_row - int(cu[d]),
            "stream_position": int(seq.stream_ids(torch.tensor([real_row]))[0]), "rank": r,
            "only_replayed": totals[r]["first_only_replayed"], "only_computed": totals[r]["first_only_computed"],
        }  # fmt: skip
    if scores is not None:
        near = sum(t["rows_near_ties"] for t in totals)
        report["rows_near_ties"] = near
        report["rows_beyond_ties"] = diff_all - near
    return report


def _near_ties(pa: torch.Tensor, pb: torch.Tensor, scores: torch.Tensor, rel_tol: float) -> int:
    """Rows (of differing rows) whose symmetric difference lies within the tolerance of the boundary."""
    count = 0
    for ra, rb, s in zip(pa.tolist(), pb.tolist(), scores):
        A, B = {p for p in ra if p != -1}, {p for p in rb if p != -1}
        if -2 in A ^ B or (-2 in A) != (-2 in B):
            continue
        A.discard(-2)
        B.discard(-2)
        diff = A ^ B
        if not B or not diff or max(diff | B) >= s.numel():
            continue
        boundary = min(float(s[p]) for p in B)
        tol = rel_tol * max(abs(float(s[p])) for p in A | B) + 1e-9
        if all(abs(float(s[p]) - boundary) <= tol for p in diff):
            count += 1
    return count


def _gather_json(local: dict, seq: ShardedSequence, settings: Settings | None) -> list[dict]:
    """Every rank's ``local`` dict, in rank order (world size 1 or no group: ``[local]``)."""
    from .agreement import _ranks_of

    ranks = _ranks_of(seq)
    if ranks is None:
        return [local]
    import json

    from .comm import _all_gather_timed, comm_device
    from .settings import current_settings

    timeout = (settings if isinstance(settings, Settings) else current_settings()).comm_timeout
    data = json.dumps(local, sort_keys=True).encode()
    dev = comm_device(seq)
    n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    sizes = _all_gather_timed(n, ranks, timeout, "replay.compare").cpu().flatten().tolist()
    buf = torch.zeros(max(sizes), dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    allb = _all_gather_timed(buf.to(dev), ranks, timeout, "replay.compare").cpu()
    return [json.loads(bytes(allb[r, : sizes[r]].tolist()).decode()) for r in range(len(sizes))]
