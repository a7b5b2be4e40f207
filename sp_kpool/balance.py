"""Causal load balance: which rank scores which query rows (``balance="causal"``).

With contiguous equal shards, the rows late in a long document see the most pools, so the
last rank of a causal sequence does most of the scoring. Here the *compute* ranges of the
query rows are re-cut so that every rank gets about the same causal work, while every
rank still *owns* (receives inputs for, and returns output for) its contiguous shard::

    one document, 4 ranks, work of row t ~ t / K

    owned (shards)     [ 0      | 1      | 2      | 3      ]
    computed           [ 0               | 1   | 2  | 3 ]      (equal areas under t / K)
    moved              queries + head weights: owner -> computer (point to point)
                       selected pool ids:      computer -> owner (point to point)
    owner              expands the pools, adds the tail, lays out its own rows

Work of a row (contract, causality): its number of visible pools ``(j + 1) // K`` (zero in the padding
document), plus a per-row constant ``row_cost`` (:data:`ROW_COST` unless the backend sets
``balance_row_cost`` or the caller passes ``balance_row_cost``), counted per document. The
constant is the backend's fixed cost of a row in units of one (row, pool) score: small for
the CPU torch backend, thousands where chunks carry fixed overheads (fit it from a run
with ``python -m sp_kpool.bench e2e``, which reports it). Compute boundaries are multiples
of ``block`` (by default the scoring chunk of the backend, so no chunk of the global grid is
scored by two ranks) except the last, which is the number of real rows.

The partition is a pure function of global quantities (``cu_seq_lens``, ``kpool``, world
size, shard size, block), so every rank computes the same partition and the same decision
without communicating. It is declined (the contiguous split is kept, nothing moves) when it
would not lower the maximum work of a rank. The pipeline keeps it, and the row work it is
cut from, in the sequence's per-batch object (:func:`sequence_partition`, ``seq.batch``):
the later layers of a batch look them up.

Bitwise equality: the pipeline scores on a global chunk grid (:mod:`sp_kpool.plan`), so a row's selection does not depend on which rank computes it;
the owner expands and lays out exactly as the unbalanced path does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import check_int
from ._device import to_device
from .comm import exchange_rows, pack_rows, take_rows, unpack_rows
from .config import ROW_COST

__all__ = [
    "ROW_COST",
    "CausalPartition",
    "causal_partition",
    "contiguous_partition",
    "sequence_partition",
    "row_work_prefix",
    "row_work",
    "owned_work",
    "move_queries",
    "route_pools",
]


@dataclass(frozen=True)
class CausalPartition:
    """Compute ranges of the real query rows, one per rank, and the work they carry.

    bounds: ``R + 1`` global row ids, ``bounds[r] .. bounds[r + 1]`` scored by rank ``r``
        (``bounds[0] = 0``, ``bounds[R] = N`` real rows; empty ranges allowed).
    work: causal work of each compute range. contiguous_work: the same for the plain
        (owned) split. total: work of all rows. block: alignment of the boundaries.
    max_block_work: work of the heaviest aligned block (the bound on the imbalance).
    applied: ``False`` when declined; ``bounds``/``work`` are then the contiguous split.
    """

    bounds: tuple[int, ...]
    work: tuple[int, ...]
    contiguous_work: tuple[int, ...]
    total: int
    block: int
    max_block_work: int
    applied: bool
    row_cost: int = ROW_COST

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """Per rank, the ``(lo, hi)`` real rows it computes."""
        return list(zip(self.bounds, self.bounds[1:]))

    @property
    def mean_work(self) -> float:
        return self.total / len(self.work)

    def imbalance(self, contiguous: bool = False) -> float:
        """Max over mean work of the compute ranges (of the contiguous split if asked)."""
        work = self.contiguous_work if contiguous else self.work
        return max(work) / self.mean_work if self.total else 1.0

    def as_dict(self) -> dict:
        return {
            "applied": self.applied,
            "bounds": list(self.bounds),
            "work": list(self.work),
            "contiguous_work": list(self.contiguous_work),
            "total": self.total,
            "block": self.block,
            "row_cost": self.row_cost,
            "max_block_work": self.max_block_work,
            "imbalance": self.imbalance(),
            "contiguous_imbalance": self.imbalance(contiguous=True),
        }


def row_work_prefix(real_cu_seq_lens: torch.Tensor, kpool: int, row_cost: int = ROW_COST) -> torch.Tensor:
    """``W [N + 1]`` int64: ``W[b]`` is the work of rows ``[0, b)`` of the real rows.

    Work of the row at document-local position ``j``: ``(j + 1) // kpool + row_cost``.
    """
    cu = real_cu_seq_lens.to(torch.int64)
    n = int(cu[-1])
    rows = torch.arange(n, dtype=torch.int64)
    doc = torch.searchsorted(cu, rows, right=True) - 1
    per_row = (rows - cu[doc] + 1) // kpool + row_cost
    prefix = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(per_row, 0, out=prefix[1:])
    return prefix


def row_work(seq, kpool: int, row_cost: int = ROW_COST, *, cache: bool = True) -> torch.Tensor:
    """:func:`row_work_prefix` of ``seq``'s real rows (``[N + 1]`` int64 CPU), kept in the
    ``row_work`` section of ``seq.batch`` when ``cache`` (``Settings.table_cache``)."""
    def build() -> torch.Tensor:
        return row_work_prefix(seq.real_cu_seq_lens, kpool, row_cost)

    return seq.batch.get("row_work", (kpool, row_cost), build, cache=cache)  # the boundaries are the sequence's


def _works(prefix: torch.Tensor, bounds) -> tuple[int, ...]:
    return tuple(int(prefix[b]) - int(prefix[a]) for a, b in zip(bounds, bounds[1:]))


def _contiguous_bounds(n: int, world_size: int, shard_size: int) -> tuple[int, ...]:
    return tuple(min(r * shard_size, n) for r in range(world_size)) + (n,)


def _partition(prefix: torch.Tensor, world_size: int, shard_size: int, block: int, row_cost: int,
               owned: tuple[int, ...] | None = None) -> CausalPartition:  # fmt: skip
    """:func:`causal_partition` of the real rows whose row work prefix is ``prefix``."""
    n = prefix.numel() - 1
    total = int(prefix[-1])
    R = world_size
    contiguous = _contiguous_bounds(n, R, shard_size)
    cands = torch.arange(0, n, block, dtype=torch.int64)
    cands = torch.cat([cands, torch.tensor([n])])  # aligned boundaries, then the end
    wc = prefix[cands]
    block_work = int((wc[1:] - wc[:-1]).max()) if cands.numel() > 1 else 0
    # Boundary r: the aligned boundary whose prefix work is nearest r * total / R (exact
    # integer comparison of R * W against r * total; ties to the lower row).
    scaled = wc * R
    bounds = [0]
    for r in range(1, R):
        target = r * total
        i = int(torch.searchsorted(scaled, torch.tensor([target]))[0])
        best = min(
            (c for c in (i - 1, i) if 0 <= c < cands.numel()),
            key=lambda c: (abs(int(scaled[c]) - target), c),
        )
        bounds.append(max(bounds[-1], int(cands[best])))
    bounds.append(n)
    balanced, plain = _works(prefix, bounds), owned if owned is not None else _works(prefix, contiguous)
    applied = R > 1 and max(balanced) < max(plain)
    return CausalPartition(
        bounds=tuple(bounds) if applied else contiguous,
        work=balanced if applied else plain,
        contiguous_work=plain,
        total=total,
        block=block,
        max_block_work=block_work,
        applied=applied,
        row_cost=row_cost,
    )


def _check_args(cu_seq_lens, **ints) -> tuple[int, ...]:
    for name, (v, lo) in ints.items():
        check_int(name, v, lo)
    cu = tuple(int(v) for v in torch.as_tensor(cu_seq_lens).tolist())
    world_size, shard_size = ints["world_size"][0], ints["shard_size"][0]
    if cu[-1] > world_size * shard_size:
        raise ValueError(f"shard_size: {world_size} shards of {shard_size} rows cannot hold {cu[-1]} real rows")
    return cu


def contiguous_partition(
    real_cu_seq_lens: torch.Tensor, *, kpool: int, world_size: int, shard_size: int, row_cost: int = ROW_COST
) -> CausalPartition:
    """The plain split (compute range = owned range) as a not-applied partition."""
    cu = _check_args(real_cu_seq_lens, kpool=(kpool, 1), world_size=(world_size, 1),
                     shard_size=(shard_size, 1), row_cost=(row_cost, 0))  # fmt: skip
    prefix = row_work_prefix(torch.tensor(cu, dtype=torch.int64), kpool, row_cost)
    n = prefix.numel() - 1
    bounds = _contiguous_bounds(n, world_size, shard_size)
    work = _works(prefix, bounds)
    return CausalPartition(
        bounds=bounds, work=work, contiguous_work=work, total=int(prefix[-1]), block=shard_size,
        max_block_work=max(work), applied=False, row_cost=row_cost,
    )  # fmt: skip


def causal_partition(
    real_cu_seq_lens: torch.Tensor,
    *,
    kpool: int,
    world_size: int,
    shard_size: int,
    block: int,
    row_cost: int = ROW_COST,
    owned: tuple[int, ...] | None = None,
) -> CausalPartition:
    """Balance the causal work of the real rows over ``world_size`` ranks (pure).

    Args:
        real_cu_seq_lens: ``[num_docs + 1]`` int, real documents only (no padding).
        kpool: pool size ``K``.
        world_size, shard_size: the contiguous split being balanced (rank ``r`` owns rows
            ``[r * shard_size, (r + 1) * shard_size)``).
        block: boundaries are multiples of it or the number of real rows (the last one,
            and those of trailing ranks left without rows).
        row_cost: the per-row constant of the work model.
        owned: the work each rank owns in place when the layout is not the contiguous
            split (:func:`owned_work`); the partition is applied only when it lowers the
            largest of these (``contiguous_work`` then reports them).

    Every boundary is the aligned row whose prefix work is nearest its ideal
    ``r * total / R``, so each range's work is within ``max_block_work`` of the ideal
    ``total / R``. Declined (``applied=False``) when it does not lower the maximum work.
    Pure and not cached: :func:`sequence_partition` keeps it once per batch.
    """
    cu = _check_args(real_cu_seq_lens, kpool=(kpool, 1), world_size=(world_size, 1),
                     shard_size=(shard_size, 1), block=(block, 1), row_cost=(row_cost, 0))  # fmt: skip
    prefix = row_work_prefix(torch.tensor(cu, dtype=torch.int64), kpool, row_cost)
    return _partition(prefix, world_size, shard_size, block, row_cost, owned)


def sequence_partition(seq, *, kpool: int, shard_size: int, block: int, row_cost: int = ROW_COST,
                       owned: tuple[int, ...] | None = None, cache: bool = True) -> CausalPartition:  # fmt: skip
    """:func:`causal_partition` of ``seq``'s real rows over its ``world_size`` ranks (the
    other arguments as there), kept in the ``partitions`` section of ``seq.batch`` when
    ``cache`` (``Settings.table_cache``): every layer after the first costs a dictionary
    lookup. Its row work comes from :func:`row_work` (the same batch)."""
    _check_args(seq.real_cu_seq_lens, kpool=(kpool, 1), world_size=(seq.world_size, 1),
                shard_size=(shard_size, 1), block=(block, 1), row_cost=(row_cost, 0))  # fmt: skip

    def build() -> CausalPartition:
        prefix = row_work(seq, kpool, row_cost, cache=cache)
        return _partition(prefix, seq.world_size, shard_size, block, row_cost, owned)

    key = (kpool, shard_size, block, row_cost, owned)  # the boundaries and world size are the sequence's
    return seq.batch.get("partitions", key, build, cache=cache)


def owned_work(seq, kpool: int, row_cost: int = ROW_COST, *, cache: bool = True) -> tuple[int, ...]:
    """Causal work of the real rows each rank owns (its in-place work), per rank (ints),
    kept in the ``owned_work`` section of ``seq.batch`` when ``cache``."""

    def build() -> tuple[int, ...]:
        prefix = row_work(seq, kpool, row_cost, cache=cache)
        per_row = prefix[1:] - prefix[:-1]
        return tuple(int(per_row[seq.real_rows(r)].sum()) for r in range(seq.world_size))

    return seq.batch.get("owned_work", (kpool, row_cost), build, cache=cache)


def _within(rows: torch.Tensor, rng: tuple[int, int]) -> tuple[int, int]:
    """``(i0, i1)``: the entries of the ascending ``rows`` in ``[lo, hi)``."""
    i0, i1 = torch.searchsorted(rows, torch.tensor(list(rng), dtype=rows.dtype)).tolist()
    return i0, i1


def _place(parts: list[tuple[torch.Tensor, torch.Tensor]], lo: int, n: int, like: torch.Tensor) -> torch.Tensor:
    """``[n, ...]``: each ``(rows, x)`` of ``parts`` written at ``rows - lo``; together the
    parts' rows are exactly ``[lo, lo + n)`` (every real row has one owner)."""
    parts = sorted(((r, x) for r, x in parts if r.numel()), key=lambda p: int(p[0][0]))
    if all(int(r[-1]) - int(r[0]) + 1 == r.numel() for r, _ in parts):  # runs: they tile the range
        return torch.cat([x for _, x in parts]) if parts else like[:0]
    out = like.new_empty((n, *like.shape[1:]))
    for rows, x in parts:
        out.index_copy_(0, to_device(rows - lo, out.device), x)
    return out


def move_queries(problem, comp, stats=None):
    """Queries and raw head weights of this rank's compute range, from their owners.

    ``comp``: per rank, the computed ``(lo, hi)`` real rows. Each owner sends the rows it
    owns (:meth:`~sp_kpool.ShardedSequence.real_rows`, any layout) that another rank
    computes, packed as bytes (one message per pair of ranks, all in one
    ``batch_isend_irecv``)."""
    seq, device = problem.seq, problem.device
    R, me = seq.world_size, seq.rank
    q, w = problem.q, problem.head_weights
    H, D = problem.heads, problem.head_dim
    mine, where = seq.real_rows(), seq.storage_index()
    _, layout = pack_rows([q[:0], w[:0]])
    row_bytes = H * D * q.element_size() + H * w.element_size()
    sends, recvs = {}, {}
    for peer in range(R):
        if peer == me:
            continue
        i0, i1 = _within(mine, comp[peer])
        if i1 > i0:
            idx = where[i0:i1]
            sends[peer] = pack_rows([take_rows(q, idx), take_rows(w, idx)])[0]
        j0, j1 = _within(seq.real_rows(peer), comp[me])
        if j1 > j0:
            recvs[peer] = (j1 - j0, row_bytes)
    got = exchange_rows(sends, recvs, seq, dtype=torch.uint8, device=device, stats=stats, tag="balance_queries",
                        timeout=problem.settings.comm_timeout)
    lo, hi = comp[me]
    q_parts, w_parts = [], []
    for peer in range(R):
        rows = seq.real_rows(peer)
        j0, j1 = _within(rows, comp[me])
        if j1 <= j0:
            continue
        if peer == me:
            idx = where[j0:j1]
            qp, wp = take_rows(q, idx), take_rows(w, idx)
        else:
            qp, wp = unpack_rows(got[peer], layout)
        q_parts.append((rows[j0:j1], qp))
        w_parts.append((rows[j0:j1], wp))
    return _place(q_parts, lo, hi - lo, q), _place(w_parts, lo, hi - lo, w)


def route_pools(problem, pools, comp, stats=None):
    """The selected pools ``[n, topk // K]`` of this rank's own real rows (ascending), from
    their computers (sent as int32, in one ``batch_isend_irecv``); ``pools`` are those of
    this rank's compute range."""
    seq, device = problem.seq, problem.device
    R, me = seq.world_size, seq.rank
    c_lo = comp[me][0]
    k_sel = problem.topk // problem.kpool
    sends, recvs = {}, {}
    for peer in range(R):
        if peer == me:
            continue
        rows = seq.real_rows(peer)
        j0, j1 = _within(rows, comp[me])
        if j1 > j0:
            sends[peer] = take_rows(pools, rows[j0:j1] - c_lo).to(torch.int32)
        i0, i1 = _within(seq.real_rows(), comp[peer])
        if i1 > i0:
            recvs[peer] = (i1 - i0, k_sel)
    got = exchange_rows(sends, recvs, seq, dtype=torch.int32, device=device, stats=stats, tag="balance_pools",
                        timeout=problem.settings.comm_timeout)
    mine, out = seq.real_rows(), [pools[:0]]
    for peer in range(R):  # compute ranges ascend with the rank: pieces in row order
        i0, i1 = _within(mine, comp[peer])
        if i1 > i0:
            out.append(take_rows(pools, mine[i0:i1] - c_lo) if peer == me else got[peer].to(pools.dtype))
    return torch.cat(out)
