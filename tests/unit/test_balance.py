"""Causal balance: the partition (pure, one process) and the balanced path (in-process, world size 1)."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sp_kpool import ShardedSequence, kpool_topk
from sp_kpool.balance import ROW_COST, causal_partition, contiguous_partition, row_work_prefix
from sp_kpool.testing.problems import make_inputs, random_doc_lengths, shard_inputs


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu)


def _brute_prefix(lengths, kpool, row_cost):
    w = [0]
    for n in lengths:
        for j in range(n):
            w.append(w[-1] + (j + 1) // kpool + row_cost)
    return w


@pytest.mark.parametrize("lengths, kpool", [([1], 4), ([9, 3, 0, 17], 4), ([30, 1, 2], 1), ([5, 40], 16)])
def test_row_work_is_visible_pools_plus_constant(lengths, kpool):
    for row_cost in (0, ROW_COST, 7):
        assert row_work_prefix(_cu(lengths), kpool, row_cost).tolist() == _brute_prefix(lengths, kpool, row_cost)


def _check_partition(part, n, world_size, shard_size, block):
    b = part.bounds
    assert len(b) == world_size + 1 and b[0] == 0 and b[-1] == n
    assert all(x <= y for x, y in zip(b, b[1:])), b
    assert sum(part.work) == part.total == sum(part.contiguous_work)
    contiguous = tuple(min(r * shard_size, n) for r in range(world_size)) + (n,)
    if part.applied:
        # multiples of the block, or the end (trailing ranks may get no rows)
        assert all(x % block == 0 or x == n for x in b[:-1]), (b, block)
        # within one aligned row-block of the ideal
        assert max(part.work) * world_size <= part.total + world_size * part.max_block_work, part
        assert max(part.work) < max(part.contiguous_work)
    else:
        assert b == contiguous and part.work == part.contiguous_work


@st.composite
def _layouts(draw):
    kpool = draw(st.sampled_from([1, 2, 4, 16]))
    lengths = draw(st.lists(st.integers(0, 200), min_size=1, max_size=8))
    if sum(lengths) == 0:
        lengths.append(1)
    world_size = draw(st.integers(1, 8))
    block = draw(st.integers(1, 64))
    return lengths, kpool, world_size, block


@settings(max_examples=60, deadline=None)
@given(_layouts())
@example(([24, 83, 162], 1, 8, 40))  # trailing ranks without rows start at the end (found by hypothesis)
def test_partition_is_aligned_balanced_or_declined(layout):
    lengths, kpool, world_size, block = layout
    n = sum(lengths)
    shard_size = -(-n // world_size)
    part = causal_partition(_cu(lengths), kpool=kpool, world_size=world_size, shard_size=shard_size, block=block)
    _check_partition(part, n, world_size, shard_size, block)
    # a pure function of global quantities: recomputing (as every rank does) gives the same
    again = causal_partition(_cu(lengths), kpool=kpool, world_size=world_size, shard_size=shard_size, block=block)
    assert again == part


def test_one_long_document_of_128k_on_4_ranks():
    # the measure: S = 131072, K = 4, 4 ranks, boundaries on 512-row blocks
    S, R = 131072, 4
    part = causal_partition(_cu([S]), kpool=4, world_size=R, shard_size=S // R, block=512)
    assert part.applied
    assert 1.70 < part.imbalance(contiguous=True) < 1.80  # about 7 / 4 for the plain split
    assert part.imbalance() <= 1.05
    assert all(b % 512 == 0 for b in part.bounds[:-1])
    # rank 0 scores about half the rows (work grows like t^2): its queries come from rank 1
    assert abs(part.bounds[1] - S // 2) <= 512


def test_a_large_row_cost_moves_the_cut_toward_equal_rows():
    # work = visible pools + row_cost: the larger the constant, the closer to equal row counts
    S, R = 4096, 2
    cuts = [causal_partition(_cu([S]), kpool=4, world_size=R, shard_size=S // R, block=16, row_cost=c).bounds[1]
            for c in (0, 256, 4096, 1 << 20)]  # fmt: skip
    assert cuts == sorted(cuts, reverse=True), cuts
    assert abs(cuts[0] - S / 2**0.5) <= 16  # work ~ t^2: the cut at S / sqrt(2)
    assert cuts[-1] == S // 2  # rows dominate: the contiguous split (declined)


@pytest.mark.parametrize("lengths, world_size", [
    ([8, 8, 8, 8], 4),          # every shard holds one whole document: already balanced
    ([3, 2, 1, 3] * 4, 4),      # no complete pool anywhere, equal shards
    ([1], 3),                   # one row
])  # fmt: skip
def test_declines_when_the_maximum_would_not_drop(lengths, world_size):
    n = sum(lengths)
    ss = -(-n // world_size)
    part = causal_partition(_cu(lengths), kpool=4, world_size=world_size, shard_size=ss, block=1)
    assert not part.applied
    _check_partition(part, n, world_size, ss, 1)


def test_block_larger_than_the_sequence_declines():
    # with one block only, a balanced split would give everything to one rank
    part = causal_partition(_cu([301]), kpool=4, world_size=4, shard_size=76, block=512)
    assert not part.applied and part.bounds == (0, 76, 152, 228, 301)


def test_contiguous_partition_matches_the_declined_split():
    c = contiguous_partition(_cu([37, 64]), kpool=4, world_size=3, shard_size=34)
    assert c.bounds == (0, 34, 68, 101) and not c.applied
    assert c.work == tuple(_brute_prefix([37, 64], 4, ROW_COST)[b] - _brute_prefix([37, 64], 4, ROW_COST)[a]
                           for a, b in zip(c.bounds, c.bounds[1:]))  # fmt: skip


@pytest.mark.parametrize("kw, exc, text", [
    (dict(block=0), ValueError, "block: expected >= 1, got 0"),
    (dict(kpool=True), TypeError, "kpool: expected int, got True of type bool"),
    (dict(shard_size=2), ValueError, "shard_size: 4 shards of 2 rows cannot hold 10 real rows"),
])  # fmt: skip
def test_partition_arguments_are_named(kw, exc, text):
    args = dict(kpool=4, world_size=4, shard_size=3, block=1)
    args.update(kw)
    with pytest.raises(exc, match=text):
        causal_partition(_cu([10]), **args)


def test_world_size_one_options_are_bitwise_equal_and_report_stats():
    x = make_inputs(random_doc_lengths(157, 5, seed=3), heads=8, head_dim=16, kpool=4, seed=3)
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=1, rank=0)
    ref = kpool_topk(**shard_inputs(x, seq), seq=seq, topk=16)
    for gather in ("keys", "pools"):
        for balance in ("none", "causal"):
            stats = {}
            out = kpool_topk(**shard_inputs(x, seq), seq=seq, topk=16, gather=gather, balance=balance, stats=stats)
            assert torch.equal(out, ref), (gather, balance)
            assert stats["bytes"]["sent"] == stats["bytes"]["received"] == 0
            assert stats["rows_scored"] == (0, 157)
            assert stats["causal_pairs"] == int(row_work_prefix(seq.real_cu_seq_lens, 4, 0)[-1])
            assert {"pool", "score", "select", "expand"} <= set(stats["time_s"])
            assert all(t >= 0 for t in stats["time_s"].values())


@pytest.mark.parametrize("kw, exc, text", [
    (dict(gather="all"), ValueError, "gather: expected one of ['keys', 'pools'], got 'all'"),
    (dict(balance="greedy"), ValueError, "balance: expected one of ['none', 'causal'], got 'greedy'"),
    (dict(balance_block=0), ValueError, "balance_block: expected >= 1, got 0"),
    (dict(balance_block=2.0), TypeError, "balance_block: expected int, got 2.0"),
    (dict(balance_row_cost=-1), ValueError, "balance_row_cost: expected >= 0, got -1"),
    (dict(stats=[]), TypeError, "stats: expected a dict or None, got list"),
])  # fmt: skip
def test_bad_scale_options_are_named(kw, exc, text):
    x = make_inputs([23], heads=8, head_dim=16, kpool=4)
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=1, rank=0)
    with pytest.raises(exc) as info:
        kpool_topk(**shard_inputs(x, seq), seq=seq, topk=8, **kw)
    assert text in str(info.value)


def test_bench_harness_writes_results(tmp_path):
    # python -m sp_kpool.bench e2e end to end in one process: JSON with environment, ceilings, stages
    import json
    import os

    from sp_kpool.bench import cli as bench

    argv = ["--seq-lens", "96", "--docs", "3", "--heads", "8", "--head-dim", "16", "--topk", "16", "--iters", "1",
            "--precisions", "bf16,fp8", "--out", str(tmp_path), "--tag", "t", "--no-plot"]  # fmt: skip
    assert bench.main(["e2e", *argv]) == 0
    (name,) = [f for f in os.listdir(tmp_path) if f.endswith(".json")]
    doc = json.load(open(tmp_path / name))
    assert {"command", "date_utc", "host", "torch", "python", "world_size"} <= set(doc["environment"])
    assert doc["ceilings"]["fp32_matmul_tflops"] > 0 and doc["ceilings"]["copy_gbps"] > 0
    assert len(doc["results"]) == 2 * 2 * 2  # precisions x gathers x balances
    for r in doc["results"]:
        s = r["summary"]
        assert s["equal_to_baseline"] and s["deterministic"], r["config"]
        assert {"pool", "score", "select", "expand"} <= set(s["stage_ms"]), s["stage_ms"]
        assert s["rates"]["score_tflops"] > 0 and s["peak_memory_bytes_max"] > 0
    assert (tmp_path / name.replace(".json", ".md")).exists()
