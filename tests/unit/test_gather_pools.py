"""Pool-then-gather: shard-local pools equal the gathered-keys pools bit for bit; gloo ranks
run every combination of the scale options against world size 1 and count their bytes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sp_kpool import ShardedSequence
from sp_kpool.backends import BACKENDS, Problem
from sp_kpool.backends.base import PoolInputs
from sp_kpool.config import KPoolConfig
from sp_kpool.comm import CommStats, pack_rows, unpack_rows
from sp_kpool.pooling import pool_table
from sp_kpool.pool_gather import pool_shards
from sp_kpool.testing.dist import run_ranks
from sp_kpool.testing.problems import make_inputs, shard_inputs
from sp_kpool.testing.scale_checks import (
    BAD_SCALE_OPTIONS,
    COMBINATIONS,
    SCALE_CASES,
    bad_scale_options_on_one_rank,
    scale_vs_world1,
)


def _problem(x, seq, k, gates, precision):
    d = shard_inputs(x, seq)
    config = KPoolConfig(topk=2 * x.ape.shape[0], kpool=x.ape.shape[0], max_logits_bytes=1 << 20, precision=precision)
    return Problem(q=d["q"], head_weights=d["head_weights"], k=k, gates=gates, ape=d["ape"], seq=seq, config=config)


def _pool(backend, problem, pool_tok_start):
    return backend.prepare(problem, PoolInputs(problem.k, problem.gates, pool_tok_start), None)[0]


def _bytes(pooled):
    return [p.contiguous().view(torch.uint8) for p in pooled.parts()]


def _pools_by_shard(x, world_size, precision):
    """Every rank's local pools (shard + seam rows), concatenated; and the gathered-keys pools."""
    backend = BACKENDS["torch"]
    seqs = [ShardedSequence.split(x.cu_seq_lens, world_size=world_size, rank=r) for r in range(world_size)]
    k_all = torch.cat([shard_inputs(x, s)["k"] for s in seqs])
    g_all = torch.cat([shard_inputs(x, s)["gates"] for s in seqs])
    pts, _ = pool_table(seqs[0].real_cu_seq_lens, x.ape.shape[0])
    full = _pool(backend, _problem(x, seqs[0], k_all, g_all, precision), pts)
    ss = seqs[0].shard_size
    shards = pool_shards(pts, shard_size=ss, world_size=world_size, kpool=x.ape.shape[0])
    parts = []
    for r, seq in enumerate(seqs):
        a, b = shards.first[r], shards.first[r + 1]
        h0, h1 = shards.halo[r]
        assert h0 == (r + 1) * ss and 0 <= h1 - h0 <= x.ape.shape[0] - 1
        if b == a:
            continue
        k_ext = torch.cat([k_all[r * ss : (r + 1) * ss], k_all[h0:h1]])
        g_ext = torch.cat([g_all[r * ss : (r + 1) * ss], g_all[h0:h1]])
        parts.append(_pool(backend, _problem(x, seq, k_ext, g_ext, precision), pts[a:b] - r * ss))
    assert sum(shards.counts) == pts.numel()
    return parts, full


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(0, 40), min_size=1, max_size=6).filter(lambda v: sum(v) > 0),
    st.sampled_from([1, 2, 4, 16]),
    st.integers(1, 8),
    st.sampled_from(["bf16", "bf16-serving", "fp8"]),
    st.integers(0, 2**16),
)
def test_shard_local_pools_equal_gathered_key_pools(lengths, kpool, world_size, precision, seed):
    x = make_inputs(lengths, heads=8, head_dim=16, kpool=kpool, seed=seed, dtype=torch.bfloat16)
    parts, full = _pools_by_shard(x, world_size, precision)
    if not parts:
        return
    cat = [torch.cat(ts) for ts in zip(*[_bytes(p) for p in parts])]
    assert all(torch.equal(a, b) for a, b in zip(cat, _bytes(full)))


def test_pool_shards_assign_each_pool_to_the_shard_of_its_first_token():
    # documents [3, 26], K = 16, 4 shards of 8: pool 0 = tokens 3..18 needs ranks 1 and 2
    pts, _ = pool_table(torch.tensor([0, 3, 29]), 16)
    s = pool_shards(pts, shard_size=8, world_size=4, kpool=16)
    assert pts.tolist() == [3] and s.counts == (1, 0, 0, 0)
    assert s.halo == ((8, 19), (16, 16), (24, 24), (32, 32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64])
def test_pack_rows_round_trips_any_dtype_and_row_range(dtype):
    a = torch.randn(7, 3, 4).to(dtype)
    b = torch.arange(7, dtype=torch.float32)
    buf, layout = pack_rows([a, b])
    assert buf.dtype == torch.uint8 and buf.shape == (7, 12 * a.element_size() + 4)
    for lo, hi in ((0, 7), (2, 5), (3, 3)):
        x, y = unpack_rows(buf[lo:hi], layout)
        assert torch.equal(x.view(torch.uint8), a[lo:hi].view(torch.uint8)) and torch.equal(y, b[lo:hi])


def test_comm_stats_add_up_per_tag():
    c = CommStats()
    c.add("seam", 10, 20)
    c.add("seam", 1, 2)
    c.add("gather_pools", 5, 5)
    assert c.as_dict() == {
        "sent": 16, "received": 27,
        "by_tag": {"seam": {"sent": 11, "received": 22, "calls": 2}, "gather_pools": {"sent": 5, "received": 5, "calls": 1}},
    }  # fmt: skip


def _scale_ranks(rank, world_size):
    torch.set_num_threads(1)  # up to 4 ranks share 2 cores: no oversubscribed thread pools
    return scale_vs_world1(rank, world_size)


@pytest.mark.xdist_group("ranks")
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_gloo_ranks_every_scale_option_is_bitwise_equal_to_world_size_one(world_size):
    results = run_ranks(_scale_ranks, world_size, timeout=240)
    assert all(len(reps) == len(COMBINATIONS) * len(SCALE_CASES) for reps in results)
    for rank, reps in enumerate(results):
        for rep in reps:
            assert rep.equal, (rank, rep)
            if rep.bytes is not None:  # instrumented bytes equal what the layout implies
                assert rep.bytes == rep.expected_bytes, (rank, rep)
    for i, rep in enumerate(results[0]):
        if rep.balance == "causal" and rep.with_stats:
            # the decision and the boundaries are the same on every rank
            assert len({(r[i].applied, r[i].bounds, r[i].work) for r in results}) == 1, rep
            if rep.applied:
                assert max(rep.work) * world_size <= rep.total + world_size * rep.max_block_work, rep
    applied = {rep.case for rep in results[0] if rep.applied}
    declined = {rep.case for rep in results[0] if rep.applied is False}
    assert {"one-long-doc", "fp8", "halo-two-ranks"} <= applied
    assert "no-complete-pool" in declined


@pytest.mark.xdist_group("ranks")
def test_bad_scale_option_on_one_rank_fails_on_every_rank_alike():
    expected = {
        "gather": "gather: expected one of ['keys', 'pools'], got 'all'",
        "balance": "balance: expected one of ['none', 'causal'], got 'greedy'",
        "block": "balance_block: expected >= 1, got 0",
        "row_cost": "balance_row_cost: expected >= 0, got -1",
        "disagree": "gather: per rank ['keys', 'keys', 'pools'] (rank 2 differs)",
        "stats": "stats: expected a dict or None, got list",
    }
    results = run_ranks(bad_scale_options_on_one_rank, 3, timeout=120)
    assert set(results[0]) == set(BAD_SCALE_OPTIONS) == set(expected)
    for case, text in expected.items():
        messages = [r[case] for r in results]
        assert len(set(messages)) == 1, messages
        assert text in messages[0], messages[0]
