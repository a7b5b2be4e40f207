"""A rank's inputs from global tensors and the ids back (``ShardedSequence.local_rows``,
``padding_rows``, ``global_rows``): for every layout, the README's recipe gives every
real row of the world-size-1 call, in one process and on gloo ranks."""

import pytest
import torch

from sp_kpool import ShardedSequence, kpool_topk
from sp_kpool.testing.dist import RanksFailed, run_ranks
from sp_kpool.testing.problems import layout_seqs, make_inputs, random_rank_positions
from sp_kpool.testing.rank_checks import layout_seq

LAYOUTS = ("contiguous", "zigzag", "zigzag-per-document", "positions")
LENGTHS = [13, 0, 30, 5, 21]  # odd lengths and an empty document: padding in every layout but positions


def _seqs(layout, world_size, pad_multiple=None):
    if layout == "positions":
        return layout_seqs(LENGTHS_CU, world_size, rank_positions=random_rank_positions(sum(LENGTHS), world_size, 3))
    return layout_seqs(LENGTHS_CU, world_size, layout, pad_multiple)


LENGTHS_CU = [0]
for _n in LENGTHS:
    LENGTHS_CU.append(LENGTHS_CU[-1] + _n)


def _gather_in_process(seqs, rows_by_rank):
    """What ``global_rows`` returns, from every rank's rows, without collectives: each
    rank's real rows put at their real-token index."""
    n = seqs[0].num_real_tokens
    out = rows_by_rank[0].new_full((n, *rows_by_rank[0].shape[1:]), -7)
    for seq, rows in zip(seqs, rows_by_rank):
        out[seq.real_rows()] = rows[seq.storage_index()]
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_local_rows_follow_positions_and_padding(layout, world_size):
    x = torch.arange(sum(LENGTHS) * 2, dtype=torch.float32).reshape(-1, 2) + 1
    seqs = _seqs(layout, world_size)
    if layout == "zigzag-per-document" and world_size > 1:
        assert any(bool(s.padding_rows.any()) and not bool(s.padding_rows[-1]) for s in seqs), "padding inside a shard"
    for seq in seqs:
        rows = seq.local_rows(x, fill=-1.5)
        assert rows.shape == (seq.shard_size, 2) and rows.dtype == x.dtype
        real = seq.real_of_stream[seq.positions]
        assert torch.equal(seq.padding_rows, real < 0)
        assert bool((rows[seq.padding_rows] == -1.5).all())
        assert torch.equal(rows[~seq.padding_rows], x[real[real >= 0]])
    # every real token on exactly one rank, and back in real-token order
    assert sum(int((~s.padding_rows).sum()) for s in seqs) == x.shape[0]
    assert torch.equal(_gather_in_process(seqs, [s.local_rows(x) for s in seqs]), x)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_readme_recipe_equals_world_size_one_in_process(layout):
    """Each rank's call on ``local_rows`` of the global inputs, its ids mapped by
    ``real_ids`` and put back in real-token order, is the world-size-1 call (the ranks'
    collectives replaced by concatenation: :func:`sp_kpool.testing.problems.simulate_ranks`)."""
    from sp_kpool.testing.problems import simulate_ranks

    x = make_inputs(LENGTHS, heads=2, head_dim=8, kpool=4, seed=1)
    seq1 = ShardedSequence.split(x.cu_seq_lens, 1, 0)
    ref = kpool_topk(seq1.local_rows(x.q), seq1.local_rows(x.k), seq1.local_rows(x.gates),
                     seq1.local_rows(x.head_weights), x.ape, seq1, topk=8, kpool=4)  # fmt: skip
    for world_size in (2, 3):
        seqs = _seqs(layout, world_size)
        outs = simulate_ranks(x, world_size, topk=8, kpool=4, seqs=seqs)
        for seq, out in zip(seqs, outs):
            assert bool((out[seq.padding_rows] == -1).all())
        got = _gather_in_process(seqs, [s.real_ids(o) for s, o in zip(seqs, outs)])
        assert torch.equal(got, ref), f"{layout} at {world_size} ranks"


def test_world_size_one_global_rows_is_local():
    seq = ShardedSequence.split([0, 5, 7], 1, 0)
    rows = torch.arange(7)
    assert torch.equal(seq.global_rows(rows), rows)
    with pytest.raises(ValueError, match=r"rows: expected shape \[7, \.\.\.\] \(seq.shard_size of rank 0/1\), got \[6\]"):
        seq.global_rows(rows[:6])
    with pytest.raises(TypeError, match="rows: expected a torch.Tensor"):
        seq.global_rows([1, 2])


def test_local_rows_errors_name_x():
    seq = ShardedSequence.split([0, 5, 7], 2, 1, layout="zigzag")
    with pytest.raises(ValueError, match=r"x: expected shape \[7, \.\.\.\] \(one row per real token: seq.num_real_tokens\), got \[8, 3\]"):
        seq.local_rows(torch.zeros(8, 3))
    with pytest.raises(TypeError, match="x: expected a torch.Tensor"):
        seq.local_rows([0.0] * 7)


# ---------------------------------------------------------------- gloo ranks
def _readme_recipe(rank, world_size):
    """The README's first example, on this rank, for every layout: inputs by
    ``local_rows``, ids back by ``real_ids`` and ``global_rows``; whether each equals the
    world-size-1 call."""
    import torch.distributed as dist

    x = make_inputs(LENGTHS, heads=2, head_dim=8, kpool=4, seed=2)
    seq1 = ShardedSequence.split(x.cu_seq_lens, 1, 0)
    ref = kpool_topk(x.q, x.k, x.gates, x.head_weights, x.ape, seq1, topk=8, kpool=4)
    out = {}
    for layout in LAYOUTS:
        seq = layout_seq(x.cu_seq_lens, rank, world_size, layout, group=dist.group.WORLD, seed=5)
        ids = kpool_topk(seq.local_rows(x.q), seq.local_rows(x.k), seq.local_rows(x.gates),
                         seq.local_rows(x.head_weights), x.ape, seq, topk=8, kpool=4)  # fmt: skip
        everyone = seq.global_rows(seq.real_ids(ids))
        values = seq.global_rows(seq.local_rows(x.q, fill=float("nan")))  # the padding never comes back
        out[layout] = (torch.equal(everyone, ref), bool((ids[seq.padding_rows] == -1).all()),
                       torch.equal(values, x.q), int(seq.padding_rows.sum()))  # fmt: skip
    return out


@pytest.mark.xdist_group("ranks")
@pytest.mark.parametrize("world_size", [2, 3])
def test_readme_recipe_on_gloo_ranks(world_size):
    results = run_ranks(_readme_recipe, world_size, timeout=180)
    for layout in LAYOUTS:
        for rank, result in enumerate(results):
            assert result[layout][:3] == (True, True, True), f"{layout}, rank {rank} of {world_size}"
    assert sum(r["zigzag-per-document"][3] for r in results) > 0  # the layout with padding inside the shards


def _mismatched_rows(rank, world_size):
    import torch.distributed as dist

    seq = ShardedSequence.split([0, 9], world_size, rank, dist.group.WORLD, layout="zigzag")
    rows = torch.zeros(seq.shard_size, 3 if rank == 0 else 4)
    seq.global_rows(rows, timeout=60)


@pytest.mark.xdist_group("ranks")
def test_global_rows_disagreement_raises_on_every_rank():
    with pytest.raises(RanksFailed) as info:
        run_ranks(_mismatched_rows, 2, timeout=120)
    assert set(info.value.errors) == {0, 1}
    for text in info.value.errors.values():
        assert "rows.shape[1:] (crc32)" in text and "ranks disagree" in text
        assert "first differing entry rows.shape[1:][0]: per rank [3, 4]" in text, text
