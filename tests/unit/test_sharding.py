import pytest
import torch

from sp_kpool import ShardedSequence


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_split_pads_with_its_own_document(world_size):
    cu = [0, 5, 6, 13]
    shards = [ShardedSequence.split(cu, world_size=world_size, rank=r) for r in range(world_size)]
    padded = -(-13 // world_size) * world_size
    for r, s in enumerate(shards):
        assert s.shard_size == padded // world_size
        assert s.shard_start == r * s.shard_size
        assert s.num_padding == padded - 13
        assert s.total_length == padded and s.num_real_tokens == 13
        want = cu + ([padded] if padded > 13 else [])
        assert s.cu_seq_lens.tolist() == want
        assert s.cu_seq_lens.dtype == torch.int64
        assert s.real_cu_seq_lens.tolist() == cu
    # shards tile the padded sequence exactly
    assert [s.shard_start for s in shards] + [padded] == [r * shards[0].shard_size for r in range(world_size + 1)]


def test_split_accepts_tensor_and_empty_documents():
    s = ShardedSequence.split(torch.tensor([0, 3, 3, 7], dtype=torch.int32), world_size=2, rank=1)
    assert s.cu_seq_lens.tolist() == [0, 3, 3, 7, 8]
    assert (s.shard_start, s.shard_size, s.num_padding) == (4, 4, 1)


def test_from_group_without_process_group_is_world_size_one():
    s = ShardedSequence.from_group([0, 9])
    assert (s.rank, s.world_size, s.shard_start, s.shard_size, s.group) == (0, 1, 0, 9, None)


@pytest.mark.parametrize(
    "cu, kwargs, exc, text",
    [
        ([1, 5], dict(world_size=1, rank=0), ValueError, "cu_seq_lens[0] == 0, got 1"),
        ([0, 5, 3], dict(world_size=1, rank=0), ValueError, "cu_seq_lens[1] = 5 > cu_seq_lens[2] = 3"),
        ([0], dict(world_size=1, rank=0), ValueError, "at least 2 entries"),
        ([0, 0], dict(world_size=1, rank=0), ValueError, "total length >= 1, got 0"),
        ([[0, 5]], dict(world_size=1, rank=0), TypeError, "expected integers"),
        (torch.tensor([0.0, 5.0]), dict(world_size=1, rank=0), TypeError, "integer tensor, got dtype torch.float32"),
        (torch.tensor([[0, 5]]), dict(world_size=1, rank=0), ValueError, "1-D tensor"),
        ([0, 5], dict(world_size=0, rank=0), ValueError, "world_size: expected >= 1, got 0"),
        ([0, 5], dict(world_size=2, rank=2), ValueError, "rank: expected 0 <= rank < world_size = 2, got 2"),
        ([0, 5], dict(world_size=2, rank=-1), ValueError, "got -1"),
        ([0, 5], dict(world_size=2.0, rank=0), TypeError, "world_size: expected int"),
    ],
)
def test_split_rejects_bad_input(cu, kwargs, exc, text):
    with pytest.raises(exc) as info:
        ShardedSequence.split(cu, **kwargs)
    assert text in str(info.value)
