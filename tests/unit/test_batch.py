"""The per-batch object (``seq.batch``): what the pipeline derives once per batch (plans,
spans, row work, partitions) is kept with the sequence, reused by every layer and off
with ``Settings.table_cache``; the frozen ``Problem`` and the call's ``RunRecord``."""

import dataclasses

import pytest
import torch

from sp_kpool import ShardedSequence, kpool_topk
from sp_kpool.balance import causal_partition, owned_work, row_work_prefix, sequence_partition
from sp_kpool.batch import SECTIONS, BatchCache
from sp_kpool.pipeline import RunRecord, solve
from sp_kpool.settings import Settings
from sp_kpool.testing.problems import make_inputs, rank_slice_problem, shard_inputs


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_every_layer_reuses_the_batch_object_of_its_sequence(layout):
    x = make_inputs([37, 4, 50], heads=4, head_dim=16, kpool=4, seed=5)
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=1, rank=0, layout=layout)
    batch = seq.batch
    assert isinstance(batch, BatchCache) and seq.tables is batch.tables and len(batch) == 0
    before = set(vars(seq))
    ref = kpool_topk(**shard_inputs(x, seq), seq=seq, topk=16, backend="torch", max_logits_bytes=1024)
    assert len(batch.section("plans")) == 1 and len(batch.section("spans")) == 1
    n = len(batch)
    for _ in range(2):  # the next layers: the same object, nothing built
        assert torch.equal(kpool_topk(**shard_inputs(x, seq), seq=seq, topk=16, backend="torch",
                                      max_logits_bytes=1024), ref)  # fmt: skip
        assert seq.batch is batch and len(batch) == n
    # the pipeline writes nothing into the sequence (its own cached properties aside)
    assert not {k for k in set(vars(seq)) - before if k.startswith("_")} - {"_ownership"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        seq.batch = BatchCache()
    # the cache off: the same ids, nothing kept
    off = ShardedSequence.split(x.cu_seq_lens, world_size=1, rank=0, layout=layout)
    stats = {}
    out = kpool_topk(**shard_inputs(x, off), seq=off, topk=16, backend="torch", max_logits_bytes=1024,
                     settings=Settings(table_cache=False), stats=stats)  # fmt: skip
    assert torch.equal(out, ref) and len(off.batch) == 0 and stats["causal_pairs"] > 0
    batch.clear()
    assert len(batch) == 0 and repr(batch) == "BatchCache(" + ", ".join(f"{s}=0" for s in SECTIONS) + ")"


def test_row_work_and_partitions_are_kept_per_batch():
    cu = [0, 37, 41, 91, 120]
    seq = ShardedSequence.split(cu, world_size=2, rank=1, layout="zigzag")
    owned = owned_work(seq, 4, 10)
    prefix = row_work_prefix(seq.real_cu_seq_lens, 4, 10)
    per_row = prefix[1:] - prefix[:-1]
    assert owned == tuple(int(per_row[seq.real_rows(r)].sum()) for r in range(2))
    args = dict(kpool=4, shard_size=-(-seq.num_real_tokens // 2), block=8, row_cost=10, owned=owned)
    part = sequence_partition(seq, **args)
    assert part == causal_partition(seq.real_cu_seq_lens, world_size=2, **args)
    assert sequence_partition(seq, **args) is part and owned_work(seq, 4, 10) is owned
    assert [len(seq.batch.section(s)) for s in ("row_work", "owned_work", "partitions")] == [1, 1, 1]
    # another block: another partition of the same row work
    assert sequence_partition(seq, **{**args, "block": 16}).block == 16
    assert [len(seq.batch.section(s)) for s in ("row_work", "partitions")] == [1, 2]
    other = ShardedSequence.split(cu, world_size=2, rank=1, layout="zigzag")
    assert owned_work(other, 4, 10, cache=False) == owned
    assert sequence_partition(other, **args, cache=False) == part and len(other.batch) == 0
    with pytest.raises(ValueError, match="block: expected >= 1, got 0"):
        sequence_partition(seq, **{**args, "block": 0})


def test_problem_is_frozen_and_the_call_state_travels_in_its_record():
    p = rank_slice_problem(91, 2, 1, heads=2, head_dim=8, kpool=4, topk=16, lengths=[37, 4, 50], device="cpu",
                           max_logits_bytes=2048)  # fmt: skip
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.k = p.q
    record = RunRecord(stage_times={})
    timed = solve(p, "torch", record)
    assert timed.call.record is record and {"pool", "score", "select", "expand"} <= set(record.stage_times)
    assert record.counters == {}  # no fused selector on the CPU
    plain = solve(p, "torch")
    assert plain.call.record.stage_times is None and torch.equal(plain.ids, timed.ids)
