"""Sharded results equal world size 1, bit for bit (in-process ranks, hypothesis layouts)."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sp_kpool import ShardedSequence, kpool_topk
from sp_kpool.testing.invariants import check_invariants
from sp_kpool.testing.problems import make_inputs, shard_inputs, simulate_ranks


def _world1(x, **opts):
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=1, rank=0)
    return kpool_topk(**shard_inputs(x, seq), seq=seq, **opts)


@st.composite
def layouts(draw):
    kpool = draw(st.sampled_from([1, 2, 4, 16]))
    lengths = draw(st.lists(st.integers(1, 3 * kpool + 9), min_size=1, max_size=6))
    world_size = draw(st.sampled_from([2, 3, 4, 8]))
    topk = kpool * draw(st.integers(1, 6))
    tail = draw(st.sampled_from(["fixed", "compact"]))
    order = draw(st.sampled_from(["ascending", "score"]))
    budget = draw(st.sampled_from([None, 4096, 1 << 16]))
    return lengths, kpool, world_size, topk, tail, order, budget


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(), st.integers(0, 2**16))
def test_every_rank_equals_world_size_one(layout, seed):
    lengths, kpool, world_size, topk, tail, order, budget = layout
    heads = 8
    # keep the budget feasible for one row: 8 * 9 + 8 bytes per pool
    budget = None if budget is None else max(budget, 80 * (sum(lengths) // kpool + 1))
    x = make_inputs(lengths, heads=heads, head_dim=16, kpool=kpool, seed=seed)
    opts = dict(topk=topk, kpool=kpool, tail=tail, order=order, max_logits_bytes=budget or 1 << 28)
    ref = _world1(x, **opts)
    outs = simulate_ranks(x, world_size, **opts)
    for r, out in enumerate(outs):
        seq = ShardedSequence.split(x.cu_seq_lens, world_size=world_size, rank=r)
        check_invariants(out, seq, topk=topk, kpool=kpool, tail=tail)
        lo, hi = seq.shard_start, min(seq.shard_end, sum(lengths))
        if hi > lo:
            assert torch.equal(out[: hi - lo], ref[lo:hi]), f"rank {r} of {world_size} differs from world size 1"


def test_long_document_over_many_chunks_is_bitwise_equal():
    # a small budget forces many scoring chunks, seams inside chunks and inside pools
    x = make_inputs([301, 7, 250], heads=16, head_dim=32, kpool=4, seed=11)
    opts = dict(topk=32, kpool=4, max_logits_bytes=40_000)
    ref = _world1(x, **opts)
    for ws in (2, 3, 4, 8):
        got = torch.cat(simulate_ranks(x, ws, **opts))[: ref.shape[0]]
        assert torch.equal(got, ref), f"world size {ws}"
