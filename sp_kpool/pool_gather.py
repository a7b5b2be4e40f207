"""``gather="pools"``: pool, then gather: each rank pools the pools that start in its shard.

The gather-keys path all-gathers ``k`` and ``gates`` (``2 * S * D`` values) and every rank
pools the whole sequence. Here every rank pools only the pools whose first token lies in
its shard; a pool that straddles the seam to the right needs at most ``K - 1`` more keys
and gates, which come from the rank(s) to the right (point to point). Then the pooled keys
(``P ~ S / K`` rows: BF16, or FP8 values plus FP32 scales) are all-gathered::

    K = 4, shard_size = 6, one document of 14 tokens (padded to 18)
    token      0 1 2 3 4 5 | 6 7 8 9 10 11 | 12 13 (pad)
    pool       0 0 0 0 1 1 | 1 1 2 2  2  2 | -  -        (12, 13: partial, never built)
    rank 0     builds pools 0, 1; receives k, gates of tokens 6, 7 from rank 1
    rank 1     builds pool 2;  rank 2 builds none
    all-gather of the pooled rows [2 | 1 | 0 pools] -> pools 0, 1, 2 on every rank

Other layouts (:mod:`sp_kpool.layouts`) follow the same rule: a pool is built by the rank
that owns its first token, which receives the pool's other tokens from whichever ranks own
them (:func:`pool_owners`; in the zigzag layouts only the pools that straddle a chunk's
end), and the gathered pools are put back in pool order.

Pools are bitwise identical to the gather-keys path: every pool is built by the same
backend call from the same key and gate rows (pooling is independent per pool). Which
pools a rank builds, and which seam rows it needs, are pure functions of the global
``cu_seq_lens`` and the layout (:func:`pool_shards`, :func:`pool_owners`), so no sizes
are exchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ._device import to_device
from .backends.base import PoolInputs, Pools
from .comm import (
    CommStats,
    all_gather_uneven_rows,
    exchange_rows,
    pack_rows,
    take_rows,
    unpack_rows,
)
from .pooling import extend_pools
from .timing import RunRecord, stage

__all__ = ["PoolShards", "pool_shards", "PoolOwners", "pool_owners", "gather_pools"]


@dataclass(frozen=True)
class PoolShards:
    """Which pools each rank builds, and the seam rows it needs (same on every rank).

    first: ``R + 1`` pool ids; rank ``r`` builds pools ``[first[r], first[r + 1])`` (those
        whose first token lies in its shard).
    halo: per rank, the global token range ``[shard_end, need_end)`` beyond its shard that
        its last pool needs (empty when no pool straddles its right seam; at most
        ``K - 1`` tokens, possibly from several ranks when shards are shorter than that).
    """

    first: tuple[int, ...]
    halo: tuple[tuple[int, int], ...]

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.first, self.first[1:]))


def pool_shards(pool_tok_start: torch.Tensor, *, shard_size: int, world_size: int, kpool: int) -> PoolShards:
    """Split the pool table ``[P]`` (int64, ascending first tokens) by shard."""
    pts = pool_tok_start.cpu()
    starts = torch.arange(world_size + 1, dtype=torch.int64) * shard_size
    first = torch.searchsorted(pts, starts).tolist()
    halo = []
    for r in range(world_size):
        end = (r + 1) * shard_size
        need = end
        if first[r + 1] > first[r]:
            need = max(end, int(pts[first[r + 1] - 1]) + kpool)
        halo.append((end, need))
    return PoolShards(first=tuple(first), halo=tuple(halo))


@dataclass(frozen=True)
class PoolOwners:
    """Which pools each rank builds in any layout (the same on every rank).

    pools: per rank, the ids of the pools whose first token it owns (ascending, int64 CPU).
    tokens: per rank, the real rows those pools read, pool by pool (``K`` each, ascending).
    """

    pools: tuple[torch.Tensor, ...]
    tokens: tuple[torch.Tensor, ...]

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(p.numel() for p in self.pools)


def pool_owners(pool_tok_start: torch.Tensor, seq, kpool: int) -> PoolOwners:
    """Split the pool table ``[P]`` (int64 CPU) of ``seq`` by the owner of each pool's
    first token."""
    pts = pool_tok_start.cpu()
    builder = seq.owner_of_real[pts]
    pools = tuple(torch.nonzero(builder == r).flatten() for r in range(seq.world_size))
    slots = torch.arange(kpool)
    tokens = tuple((pts[p][:, None] + slots[None]).flatten() for p in pools)
    return PoolOwners(pools, tokens)


def _halo_rows(problem: Any, owners: PoolOwners, stats: CommStats | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and gate rows of this rank's pools' tokens, pool by pool: its own rows and
    those received from their owners; sends the rows other ranks' pools need from it (one
    ``batch_isend_irecv``)."""
    seq, device = problem.seq, problem.device
    me, k, gates = seq.rank, problem.k, problem.gates
    owner, where = seq.owner_of_real, seq.storage_of_real
    _, layout = pack_rows([k[:0], gates[:0]])
    row_bytes = k.shape[1] * k.element_size() + gates.shape[1] * gates.element_size()
    need = owners.tokens[me]
    sends, recvs = {}, {}
    for peer in range(seq.world_size):
        if peer == me:
            continue
        theirs = owners.tokens[peer]
        mine = theirs[owner[theirs] == me]
        if mine.numel():
            idx = where[mine]
            sends[peer] = pack_rows([take_rows(k, idx), take_rows(gates, idx)])[0]
        n = int((owner[need] == peer).sum())
        if n:
            recvs[peer] = (n, row_bytes)
    got = exchange_rows(sends, recvs, seq, dtype=torch.uint8, device=device, stats=stats, tag="seam",
                        timeout=problem.settings.comm_timeout)
    local = owner[need] == me
    k_ext = k.new_empty((need.numel(), k.shape[1]))
    g_ext = gates.new_empty((need.numel(), gates.shape[1]))
    at = torch.nonzero(local).flatten()
    k_ext.index_copy_(0, to_device(at, device), take_rows(k, where[need[local]]))
    g_ext.index_copy_(0, to_device(at, device), take_rows(gates, where[need[local]]))
    for peer, buf in got.items():
        at = to_device(torch.nonzero(owner[need] == peer).flatten(), device)
        kp, gp = unpack_rows(buf, layout)
        k_ext.index_copy_(0, at, kp)
        g_ext.index_copy_(0, at, gp)
    return k_ext, g_ext


def _gather_pools_any_layout(backend: Any, problem: Any, pool_tok_start: torch.Tensor, stats: CommStats | None,
                             record: RunRecord | None) -> Pools:  # fmt: skip
    """:func:`gather_pools` for a layout other than the contiguous split."""
    seq, K = problem.seq, problem.kpool
    owners = pool_owners(pool_tok_start, seq, K)
    with stage(record, "seam", problem.device):
        k_ext, g_ext = _halo_rows(problem, owners, stats)
    with stage(record, "pool", problem.device):
        mine = owners.pools[seq.rank]
        local = torch.arange(mine.numel(), device=problem.device) * K  # pool i's tokens: rows [i K, (i + 1) K)
        extend = None
        if seq.has_prompts:
            ext = extend_pools(seq.real_cu_seq_lens, seq.prompt_lens, K)
            extend = to_device(ext[mine], problem.device) if bool(ext.any()) else None
        pooled = _pool_local(backend, problem, k_ext, g_ext, local, extend)
    with stage(record, "gather", problem.device):
        buf, layout = pack_rows(pooled.parts())
        full = all_gather_uneven_rows(buf, owners.counts, seq, stats=stats, tag="gather_pools",
                                      timeout=problem.settings.comm_timeout)
        order = torch.argsort(torch.cat(owners.pools))  # rank order -> pool order
        return Pools.from_parts(unpack_rows(full.index_select(0, to_device(order, full.device)), layout))


def _seam_rows(problem: Any, shards: PoolShards, stats: CommStats | None) -> tuple[torch.Tensor, torch.Tensor]:
    """This shard's keys and gates followed by the seam rows its last pool needs from the
    right; sends the rows other ranks need from this shard (one ``batch_isend_irecv``)."""
    seq, device = problem.seq, problem.device
    R, me, ss = seq.world_size, seq.rank, seq.shard_size
    lo = me * ss
    k, gates = problem.k, problem.gates
    _, layout = pack_rows([k[:0], gates[:0]])
    row_bytes = k.shape[1] * k.element_size() + gates.shape[1] * gates.element_size()
    sends, recvs = {}, {}
    for peer in range(R):
        if peer == me:
            continue
        a, b = max(lo, shards.halo[peer][0]), min(lo + ss, shards.halo[peer][1])
        if b > a:
            sends[peer] = pack_rows([k[a - lo : b - lo], gates[a - lo : b - lo]])[0]
        a, b = max(peer * ss, shards.halo[me][0]), min((peer + 1) * ss, shards.halo[me][1])
        if b > a:
            recvs[peer] = (b - a, row_bytes)
    got = exchange_rows(sends, recvs, seq, dtype=torch.uint8, device=device, stats=stats, tag="seam",
                        timeout=problem.settings.comm_timeout)
    if not got:
        return k, gates
    k_parts, g_parts = [k], [gates]
    for peer in sorted(got):  # peers to the right, in token order
        kp, gp = unpack_rows(got[peer], layout)
        k_parts.append(kp)
        g_parts.append(gp)
    return torch.cat(k_parts), torch.cat(g_parts)


def _pool_local(backend: Any, problem: Any, k_ext, g_ext, local: torch.Tensor, extend: torch.Tensor | None) -> Pools:
    """The pools at rows ``local`` of ``k_ext``/``g_ext`` (``extend``: their compression
    orders, or ``None``). With no pool here, one zero pool is built for the representation
    (dtypes, widths) and dropped, so that every rank contributes rows of the same layout to
    the all-gather."""
    if local.numel():
        return backend.prepare(problem, PoolInputs(k_ext, g_ext, local, extend), None)[0]
    kpool, device = problem.kpool, problem.device
    zk = k_ext.new_zeros((kpool, k_ext.shape[1]))
    zg = g_ext.new_zeros((kpool, g_ext.shape[1]))
    one = torch.zeros(1, dtype=torch.int64, device=device)
    return backend.prepare(problem, PoolInputs(zk, zg, one), None)[0][:0]


def gather_pools(
    backend: Any,
    problem: Any,
    pool_tok_start: torch.Tensor,
    *,
    stats: CommStats | None = None,
    record: RunRecord | None = None,
) -> Pools | None:
    """Pooled keys of all ``P`` pools, built per shard and all-gathered.

    Args:
        backend: the resolved backend (its ``prepare`` builds the local pools).
        problem: the call, with ``k``/``gates`` this rank's ``[S_local, D]`` shards.
        pool_tok_start: ``[P]`` int64 (CPU), the global pool table.
        stats: bytes counter (tags ``seam`` and ``gather_pools``).
        record: the call's :class:`~sp_kpool.timing.RunRecord`: the stages ``seam``,
            ``pool`` and ``gather`` are timed into it when its ``stage_times`` is a dict.

    Returns the :class:`~sp_kpool.backends.base.Pools` of all ``P`` pools on
    ``problem.device``, or ``None`` when there is no complete pool at all.
    """
    seq = problem.seq
    if pool_tok_start.numel() == 0:
        return None
    if not seq.is_contiguous:
        return _gather_pools_any_layout(backend, problem, pool_tok_start, stats, record)
    R, me, ss = seq.world_size, seq.rank, seq.shard_size
    shards = pool_shards(pool_tok_start, shard_size=ss, world_size=R, kpool=problem.kpool)
    with stage(record, "seam", problem.device):
        k_ext, g_ext = _seam_rows(problem, shards, stats)
    with stage(record, "pool", problem.device):
        a, b = shards.first[me], shards.first[me + 1]
        local = to_device(pool_tok_start[a:b] - me * ss, problem.device)
        extend = None
        if seq.has_prompts:  # the compression order of each pool built here
            ext = extend_pools(seq.real_cu_seq_lens, seq.prompt_lens, problem.kpool)
            extend = to_device(ext[a:b], problem.device) if bool(ext.any()) else None
        pooled = _pool_local(backend, problem, k_ext, g_ext, local, extend)
    if R == 1:
        return pooled
    with stage(record, "gather", problem.device):
        buf, layout = pack_rows(pooled.parts())  # one collective for values and scales
        full = all_gather_uneven_rows(buf, shards.counts, seq, stats=stats, tag="gather_pools",
                                      timeout=problem.settings.comm_timeout)
        return Pools.from_parts(unpack_rows(full, layout))
