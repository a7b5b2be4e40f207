"""The lean row selection of :mod:`sp_kpool.replay_rows` against the sort-everything
implementation it replaced (kept here, only as the reference): the same bad rows and, for
every good row, the same pools in the same order, on random captures with every rule broken
somewhere; and the capture-order rule (a pool's place is its *first* captured column)."""

from __future__ import annotations

import random

import pytest
import torch

from sp_kpool import KPoolConfig, ShardedSequence, replay
from sp_kpool.replay_rows import select_rows

_BIG = torch.iinfo(torch.int64).max
_BIG32 = torch.iinfo(torch.int32).max


# --------------------------------------------------------------------------- the reference


def _sorted_live(v, limit):
    live = (v >= 0) & (v < limit[:, None])
    s, perm = torch.sort(torch.where(live, v, _BIG32), dim=1, stable=True)
    return s, perm, s != _BIG32


def _reference(v, j, kpool, topk, pools, capture_order, k_sel):
    """``replay._check_rows`` and its caller's ordering before the lean path (commit 91559a6)."""
    r, W = v.shape
    n_vis = ((j + 1) // kpool).to(torch.int32)
    limit = n_vis if pools else (j + 1).to(torch.int32)
    bad = ((v < -1) | (v >= limit[:, None])).any(1)
    s, perm, ok = _sorted_live(v, limit)
    if W > 1:
        bad |= ((s[:, 1:] == s[:, :-1]) & ok[:, 1:]).any(1)
    hist = ok if pools else ok & (s < (n_vis * kpool)[:, None])
    pool = s if pools else torch.div(s, kpool, rounding_mode="floor")
    start = hist.clone()
    if W > 1:
        start[:, 1:] &= pool[:, 1:] != pool[:, :-1]
    n_pools = start.sum(1)
    if not pools:
        bad |= hist.sum(1) != n_pools * kpool
    bad |= n_pools > topk // kpool
    gid = torch.where(start, torch.cumsum(start, dim=1, dtype=torch.int64) - 1, W)
    pool_ids = torch.full((r, W + 1), -1, dtype=torch.int64)
    pool_ids.scatter_(1, gid, pool.to(torch.int64).masked_fill_(~start, -1))
    pids = pool_ids[:, :W]
    if capture_order:
        member = torch.where(hist, torch.cumsum(start, dim=1, dtype=torch.int64) - 1, W)
        first = torch.full((r, W + 1), _BIG, dtype=torch.int64)
        first.scatter_reduce_(1, member, perm, "amin")
        pids = pids.gather(1, torch.sort(first[:, :W], dim=1, stable=True).indices)
    out = torch.full((r, k_sel), -1, dtype=torch.int64)
    out[:, : min(k_sel, W)] = pids[:, :k_sel]
    return bad, out


# --------------------------------------------------------------------------- random captures


def _row(rng: random.Random, j: int, K: int, T: int, W: int, pools: bool) -> list[int]:
    """One captured row of width ``W`` for document-local row ``j``: valid, then perhaps broken."""
    n_vis = (j + 1) // K
    hist_end = n_vis * K
    cap = min(n_vis, T // K, W if pools else W // K)
    chosen = rng.sample(range(n_vis), rng.randint(0, cap)) if cap else []
    if pools:
        vals = list(chosen)
    elif rng.random() < 0.5:  # kpool_topk's layout: whole consecutive blocks
        vals = [p * K + i for p in chosen for i in range(K)]
    else:
        vals = [p * K + i for p in chosen for i in range(K)]
        rng.shuffle(vals)
    if not pools and hist_end <= j and rng.random() < 0.5:  # some of the row's own tail ids
        vals += rng.sample(range(hist_end, j + 1), rng.randint(1, j + 1 - hist_end))
    vals = vals[:W]
    row = vals + [-1] * (W - len(vals))
    if rng.random() < 0.3:  # -1s anywhere
        if rng.random() < 0.5:
            rng.shuffle(row)
        elif not pools and len(vals) >= K and K > 1:  # whole blocks, blocks of -1 between them
            blocks = [row[i : i + K] for i in range(0, W - W % K, K)]
            rng.shuffle(blocks)
            row = [x for b in blocks for x in b] + row[W - W % K :]
    mutation = rng.random()
    if mutation < 0.5 or not W:
        return row
    c = rng.randrange(W)
    if mutation < 0.57:
        row[c] = rng.choice([-2, -7, -(2**31)])
    elif mutation < 0.64:
        row[c] = (n_vis if pools else j + 1) + rng.randrange(3)
    elif mutation < 0.74:  # an id twice
        live = [x for x in row if x >= 0]
        if live:
            row[c] = rng.choice(live)
    elif mutation < 0.84 and not pools:  # a partial pool: one history id dropped or moved
        h = [i for i, x in enumerate(row) if 0 <= x < hist_end]
        if h:
            i = rng.choice(h)
            row[i] = -1 if rng.random() < 0.5 else (row[i] + 1 if (row[i] + 1) % K else row[i] - K + 1)
    elif mutation < 0.92:  # more pools than topk // K: every visible pool
        allp = list(range(n_vis)) if pools else [t for p in range(n_vis) for t in range(p * K, p * K + K)]
        row = (allp + [-1] * W)[:W]
    else:
        row[c] = -1
    return row


@pytest.mark.parametrize("pools", [False, True])
@pytest.mark.parametrize("capture_order", [False, True])
@pytest.mark.parametrize("K,T", [(1, 4), (2, 8), (4, 16), (4, 32), (3, 12), (16, 64)])  # K 16: tails sorted
def test_lean_selection_equals_the_sort_everything_reference(pools, capture_order, K, T):
    rng = random.Random(K * 100 + T + 10 * pools + capture_order)
    checked_good = checked_bad = 0
    for W in (0, 1, K, T // K, T, T + K - 1, T + 2 * K + 1):
        if pools and W > 2 * T:
            continue
        j = torch.tensor([rng.randrange(0, 12 * K) for _ in range(300)], dtype=torch.int64)
        v = torch.tensor([_row(rng, int(x), K, T, W, pools) for x in j], dtype=torch.int32).view(300, W)
        k_sel = max(1, min(T // K, W))
        bad, got = select_rows(v, j, K, T, pools, capture_order, k_sel)
        ref_bad, ref = _reference(v, j, K, T, pools, capture_order, k_sel)
        assert torch.equal(bad, ref_bad), (W, torch.nonzero(bad != ref_bad).flatten()[:5], v[bad != ref_bad][:3])
        assert got.dtype == torch.int32 and got.shape == ref.shape
        good = ~bad
        assert torch.equal(got[good].long(), ref[good]), (W, v[good][(got[good].long() != ref[good]).any(1)][:3])
        checked_good += int(good.sum())
        checked_bad += int(bad.sum())
    assert checked_good > 500 and checked_bad > 200  # both kinds of row are exercised


# --------------------------------------------------------------------------- capture order


def test_score_order_takes_each_pool_at_its_first_captured_column():
    """Pools whose ids interleave: by the first column A comes before B, by the last column
    B before A. Ordering by any other column (e.g. the last) fails here."""
    K, T = 2, 8
    config = KPoolConfig(topk=T, kpool=K, order="score", tail="fixed")
    n = 24
    seq = ShardedSequence.split([0, n], 1, 0)
    cap = torch.full((n - 1, 8), -1, dtype=torch.int32)
    # row 20 (10 visible pools): pool 7 (14, 15) and pool 2 (4, 5), interleaved: 14, 4, 5, 15
    cap[20, :4] = torch.tensor([14, 4, 5, 15])
    # row 21: pool 1 (2, 3), pool 9 (18, 19), pool 4 (8, 9): 3, 18, 8, 19, 2, 9
    cap[21, :6] = torch.tensor([3, 18, 8, 19, 2, 9])
    out = replay.shard([cap], seq, config, missing="empty")
    assert out[20, :4].tolist() == [14, 15, 4, 5]
    assert out[21, :6].tolist() == [2, 3, 18, 19, 8, 9]
    assert out[20, 4:T].tolist() == [-1] * (T - 4) and out[21, 6:T].tolist() == [-1] * (T - 6)
    # ascending: by pool id, whatever the columns
    asc = replay.shard([cap], seq, KPoolConfig(topk=T, kpool=K, tail="fixed"), missing="empty")
    assert asc[20, :4].tolist() == [4, 5, 14, 15] and asc[21, :6].tolist() == [2, 3, 8, 9, 18, 19]
