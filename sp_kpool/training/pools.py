"""Pooled keys for the training path, and the collective pair that moves them.

Forward (:func:`gather_pools_for_training`): every rank gets the pooled keys of all ``P``
complete pools, identical on every rank, gathered **before** pooling as the frozen operator
does (``gather="keys"``: keys and gates all-gathered, every rank pools everything;
``gather="pools"``: the owner of a pool's first token pools it from its rows and the at most
``K - 1`` halo rows of the next rank(s), then the pooled keys are all-gathered). Each rank
keeps only the key and gate rows of the pools it owns (its pools' tokens, halo included).

Backward (:func:`pool_grads_to_owners`), the adjoint side by side: each rank's partial
gradient of the pooled keys (``dPool``, its rows' terms only) goes to the pools' owners
(point to point, only the pools its rows can see), and the owner adds the partials **in rank
order** (float, or int64 fixed point in the exact mode); the owner then runs the pooling's
backward on its own pools and sends the halo tokens' gradients back to the ranks that own
them. Every token lies in exactly one pool, so each key and gate row gets its gradient from
one owner, with no sum across ranks; tokens of no complete pool and padding rows get zeros.

Arithmetic (:func:`pool_keys`): the model definition of ``docs/contract.md`` section 2 in
``max(FP32, k.dtype)``: the slot softmax in that type, the probabilities cast to ``k.dtype``,
the weighted sum in ``k.dtype`` (the operations of :func:`sp_kpool.pooling.compress_pools_bf16`;
float64 keys give float64 pools), on a global grid of pool blocks (:data:`POOL_BLOCK`).
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch

from .._device import to_device
from ..comm import CommStats, all_gather_uneven_rows, exchange_rows, gather_keys, pack_rows, unpack_rows
from ..pool_gather import PoolOwners, _halo_rows, pool_owners

__all__ = ["compute_dtype", "pool_keys", "pool_blocks", "pool_block_grads", "OwnedPools", "gather_pools_for_training",
           "pool_grads_to_owners", "token_grads_to_owners", "POOL_BLOCK"]

#: Pools are built (and their backward run) in blocks of this many pools of one global grid.
#: PyTorch's CPU kernels round some elements differently with the tensor's size (vectorised
#: bodies and scalar tails: an ``exp`` of the same value can differ in its last bit), so a
#: pool's bits would depend on how many pools its owner builds at once; on the grid a pool
#: sits at the same place of a tensor of the same shape whichever rank builds it.
POOL_BLOCK = 256


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """``max(FP32, dtype)``: the type the training path computes in."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def pool_keys(k_tok: torch.Tensor, g_tok: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """Pooled keys of pools given slot by slot (differentiable).

    Args:
        k_tok: ``[n, K, D]`` float: the keys of each pool's ``K`` tokens.
        g_tok: ``[n, K, D]`` float: their gate logits.
        ape: ``[K, D]`` or ``[n, K, D]`` float: the per-slot bias (per pool when expanded).

    Returns ``[n, D]`` in ``k_tok.dtype``.
    """
    ct = compute_dtype(k_tok.dtype)
    probs = (g_tok.to(ct) + ape.to(ct)).softmax(dim=1).to(k_tok.dtype)
    return (probs * k_tok).sum(dim=1)


def _grid(mine: torch.Tensor, total: int):
    """``(start, length, at, part)`` per block of the pool grid holding pools ``mine``
    (ascending ids): the block's first pool and size, the positions of ``mine[part]`` in it."""
    if mine.numel() == 0:
        return
    blocks, counts = torch.unique_consecutive(mine // POOL_BLOCK, return_counts=True)
    a = 0
    for b, n in zip(blocks.tolist(), counts.tolist()):
        start = b * POOL_BLOCK
        yield start, min(POOL_BLOCK, total - start), mine[a : a + n] - start, slice(a, a + n)
        a += n


def _block(x: torch.Tensor, length: int, at: torch.Tensor, part: slice) -> torch.Tensor:
    out = x.new_zeros((length, *x.shape[1:]))
    out[to_device(at, x.device)] = x[part]
    return out


def pool_blocks(k_tok: torch.Tensor, g_tok: torch.Tensor, ape: torch.Tensor, mine: torch.Tensor, total: int) -> torch.Tensor:
    """:func:`pool_keys` of the pools ``mine`` (ascending ids of ``total``), given slot by slot
    (``[n, K, D]``), computed on the global grid of :data:`POOL_BLOCK` pools: ``[n, D]``."""
    out = k_tok.new_empty((k_tok.shape[0], k_tok.shape[2]))
    for _, length, at, part in _grid(mine, total):
        at_d = to_device(at, out.device)
        out[part] = pool_keys(_block(k_tok, length, at, part), _block(g_tok, length, at, part), ape)[at_d]
    return out


def pool_block_grads(k_tok, g_tok, ape, d_pools, mine: torch.Tensor, total: int):
    """The pooling's backward for the pools ``mine`` (as :func:`pool_blocks`), given their
    gradients ``d_pools [n, D]``: ``dk [n, K, D]``, ``dgates [n, K, D]`` and ``ape``'s
    gradient per pool ``[n, K, D]``."""
    dk, dg = torch.zeros_like(k_tok), torch.zeros_like(g_tok)
    da = ape.new_zeros((k_tok.shape[0], *ape.shape))
    for _, length, at, part in _grid(mine, total):
        at_d = to_device(at, dk.device)
        with torch.enable_grad():
            kb = _block(k_tok, length, at, part).requires_grad_()
            gb = _block(g_tok, length, at, part).requires_grad_()
            ab = ape.detach().expand(length, *ape.shape).clone().requires_grad_()
            out = pool_keys(kb, gb, ab)
            grads = torch.autograd.grad(out, (kb, gb, ab), _block(d_pools.to(out.dtype), length, at, part))
        dk[part], dg[part], da[part] = (t[at_d] for t in grads)
    return dk, dg, da


@dataclass
class OwnedPools:
    """What one rank keeps of the forward for the pooling's backward.

    owners: which rank owns (pools) each pool (:class:`~sp_kpool.pool_gather.PoolOwners`).
    k_own, g_own: ``[n_own, K, D]``: the key and gate rows of this rank's pools (halo
        rows of the next ranks included), pool by pool.
    """

    owners: PoolOwners
    k_own: torch.Tensor
    g_own: torch.Tensor


def gather_pools_for_training(k, gates, ape, seq, pool_tok_start: torch.Tensor, gather: str, *, timeout: float,
                              stats: CommStats | None = None) -> tuple[torch.Tensor, OwnedPools]:  # fmt: skip
    """All ``P`` pooled keys ``[P, D]`` (``k.dtype``, the same bits on every rank) and this
    rank's :class:`OwnedPools`.

    ``k``, ``gates``: this rank's ``[S_local, D]`` rows (storage order); ``pool_tok_start``:
    ``[P]`` int64 CPU (:func:`sp_kpool.pooling.pool_table`); ``gather``: ``"keys"`` or
    ``"pools"``. A collective over ``seq.group``.
    """
    K, D, device = ape.shape[0], k.shape[1], k.device
    owners = pool_owners(pool_tok_start, seq, K)
    me = seq.rank
    if gather == "keys":
        k_all, g_all = gather_keys(k, seq, stats, timeout), gather_keys(gates, seq, stats, timeout)
        idx = to_device(pool_tok_start[:, None] + torch.arange(K), device)
        P = pool_tok_start.numel()
        pools = pool_blocks(k_all[idx], g_all[idx], ape, torch.arange(P), P)
        mine = to_device(owners.tokens[me], device)
        return pools, OwnedPools(owners, k_all[mine].view(-1, K, D), g_all[mine].view(-1, K, D))
    problem = types.SimpleNamespace(seq=seq, device=device, k=k, gates=gates,
                                    settings=types.SimpleNamespace(comm_timeout=timeout))  # fmt: skip
    k_ext, g_ext = _halo_rows(problem, owners, stats)
    k_own, g_own = k_ext.view(-1, K, D), g_ext.view(-1, K, D)
    own = pool_blocks(k_own, g_own, ape, owners.pools[me], pool_tok_start.numel())
    full = all_gather_uneven_rows(own, owners.counts, seq, stats=stats, tag="gather_pools", timeout=timeout)
    order = torch.argsort(torch.cat(owners.pools))  # rank order -> pool order
    return full.index_select(0, to_device(order, full.device)), OwnedPools(owners, k_own, g_own)


def _touched(seq, vis_lo: torch.Tensor, vis_hi: torch.Tensor, ranges=None) -> list[tuple[int, int]]:
    """Per rank, the pool range ``[lo, hi)`` its rows can see (``vis_lo``/``vis_hi``: each
    real row's visible pools, ``[N]`` int64 CPU): the only pools it sends gradients for.
    ``ranges``: per rank the ``(lo, hi)`` real rows it computed (``balance="causal"``;
    default: the rows it owns)."""
    out = []
    for r in range(seq.world_size):
        rows = seq.real_rows(r) if ranges is None else torch.arange(*ranges[r])
        seen = rows[vis_hi[rows] > vis_lo[rows]] if rows.numel() else rows
        out.append((int(vis_lo[seen].min()), int(vis_hi[seen].max())) if seen.numel() else (0, 0))
    return out


def pool_grads_to_owners(d_pools: torch.Tensor, seq, owned: OwnedPools, vis_lo, vis_hi, *, timeout: float,
                         stats: CommStats | None = None, ranges=None) -> torch.Tensor:  # fmt: skip
    """Sum every rank's partial ``d_pools [P, D]`` at the pools' owners, in rank order.

    Returns ``[n_own, D]`` (``d_pools.dtype``: float, or int64 in the exact mode) for this
    rank's pools (``owned.owners.pools[rank]``, ascending). Rank ``r`` sends only the rows of
    the pools its rows can see (``vis_lo``/``vis_hi``); both sides derive the sizes from
    the global layout, so no sizes are exchanged. ``ranges``: the rows each rank computed
    when they are not the rows it owns (``balance="causal"``).
    """
    me, W = seq.rank, seq.world_size
    mine = owned.owners.pools[me]
    if W == 1:
        return d_pools[to_device(mine, d_pools.device)]
    seen = _touched(seq, vis_lo, vis_hi, ranges)

    def sent(r: int, o: int) -> torch.Tensor:  # the pools of owner o that rank r sends
        p = owned.owners.pools[o]
        lo, hi = seen[r]
        return p[(p >= lo) & (p < hi)]

    sends, recvs = {}, {}
    for peer in range(W):
        if peer == me:
            continue
        rows = sent(me, peer)
        if rows.numel():
            sends[peer] = d_pools[to_device(rows, d_pools.device)]
        n = sent(peer, me).numel()
        if n:
            recvs[peer] = (n, d_pools.shape[1])
    got = exchange_rows(sends, recvs, seq, dtype=d_pools.dtype, device=d_pools.device, stats=stats,
                        tag="pool_grads", timeout=timeout)  # fmt: skip
    where = torch.full((int(mine.max()) + 1 if mine.numel() else 0,), -1, dtype=torch.int64)
    where[mine] = torch.arange(mine.numel())
    out = d_pools.new_zeros((mine.numel(), d_pools.shape[1]))
    for r in range(W):  # rank order: a fixed association of the cross-rank sum
        if r == me:
            rows = sent(me, me)
            part = d_pools[to_device(rows, d_pools.device)]
        elif r in got:
            rows, part = sent(r, me), got[r]
        else:
            continue
        out.index_add_(0, to_device(where[rows], out.device), part)
    return out


def token_grads_to_owners(dk_own: torch.Tensor, dg_own: torch.Tensor, seq, owned: OwnedPools, shape,
                          *, timeout: float, stats: CommStats | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The pooling backward's key and gate gradients of this rank's pools' tokens
    (``[n_own * K, D]`` each, pool by pool) placed at their owners' storage rows: the
    reverse of the seam exchange. Returns this rank's ``dk``, ``dgates`` of ``shape``
    ``[S_local, D]`` (zeros where no complete pool reads the row)."""
    me, W = seq.rank, seq.world_size
    owner, where = seq.owner_of_real, seq.storage_of_real
    tokens = owned.owners.tokens
    dk = dk_own.new_zeros(shape)
    dg = dg_own.new_zeros(shape)
    need = tokens[me]
    local = owner[need] == me
    at = to_device(where[need[local]], dk.device)
    pick = to_device(torch.nonzero(local).flatten(), dk.device)
    dk.index_copy_(0, at, dk_own.index_select(0, pick))
    dg.index_copy_(0, at, dg_own.index_select(0, pick))
    if W == 1:
        return dk, dg
    _, layout = pack_rows([dk_own[:0], dg_own[:0]])
    row_bytes = dk_own.shape[1] * dk_own.element_size() + dg_own.shape[1] * dg_own.element_size()
    sends, recvs = {}, {}
    for peer in range(W):
        if peer == me:
            continue
        out = torch.nonzero(owner[need] == peer).flatten()
        if out.numel():
            sel = to_device(out, dk_own.device)
            sends[peer] = pack_rows([dk_own.index_select(0, sel), dg_own.index_select(0, sel)])[0]
        theirs = tokens[peer]
        n = int((owner[theirs] == me).sum())
        if n:
            recvs[peer] = (n, row_bytes)
    got = exchange_rows(sends, recvs, seq, dtype=torch.uint8, device=dk.device, stats=stats, tag="token_grads",
                        timeout=timeout)  # fmt: skip
    for peer, buf in got.items():
        theirs = tokens[peer]
        rows = theirs[owner[theirs] == me]
        kp, gp = unpack_rows(buf, layout)
        at = to_device(where[rows], dk.device)
        dk.index_copy_(0, at, kp)
        dg.index_copy_(0, at, gp)
    return dk, dg
