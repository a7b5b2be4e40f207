"""Ownership layouts (zigzag, zigzag per document, any positions): every real row equals
the world-size-1 contiguous row bit for bit once its ids are mapped from stream positions
to real rows, for every option; padding rows are all -1 and no id points at padding."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sp_kpool import ShardedSequence, kpool_topk
from sp_kpool.testing.dist import run_ranks
from sp_kpool.testing.invariants import check_invariants
from sp_kpool.testing.problems import (
    layout_seqs,
    make_inputs,
    random_rank_positions,
    shard_inputs,
    simulate_ranks,
    to_document_positions,
)
from sp_kpool.testing.rank_checks import STANDARD_CASES, layout_seq, sharded_vs_world1

LAYOUTS = ("contiguous", "zigzag", "zigzag-per-document", "positions")
#: every combination of gather x balance x (tail, order); the compact tail with an alignment
OPTIONS = [
    {"gather": gather, "balance": balance, "balance_block": 4, **tail_order}
    for gather in ("keys", "pools")
    for balance in ("none", "causal")
    for tail_order in ({"tail": "fixed", "order": "ascending"}, {"tail": "compact", "order": "score", "alignment": 8})
]


def _assert_equal_to_world1(x, seqs, outs, ref, **config):
    for seq, out in zip(seqs, outs):
        check_invariants(out, seq, topk=config["topk"], kpool=config["kpool"], tail=config.get("tail", "fixed"),
                         alignment=config.get("alignment", 1))  # fmt: skip
        real = seq.real_of_stream[seq.positions]
        keep = real >= 0
        assert bool((out[~keep] == -1).all()), f"rank {seq.rank}: a padding row has ids"
        got = to_document_positions(out, seq)
        assert torch.equal(got[keep], ref[real[keep]]), f"rank {seq.rank} of {len(seqs)} ({seq.layout}) differs"


# ---------------------------------------------------------------- layouts in one process
@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 70), min_size=1, max_size=6).filter(lambda v: sum(v) > 0),
    world_size=st.integers(1, 4),
    layout=st.sampled_from(LAYOUTS),
    pad=st.sampled_from([None, 2]),
    kpool=st.sampled_from([1, 2, 4]),
    tail=st.sampled_from(["fixed", "compact"]),
    order=st.sampled_from(["ascending", "score"]),
    budget=st.sampled_from([None, 16384]),
    seed=st.integers(0, 2**16),
)
def test_random_layouts_equal_world_size_one(lengths, world_size, layout, pad, kpool, tail, order, budget, seed):
    x = make_inputs(lengths, heads=4, head_dim=8, kpool=kpool, seed=seed)
    if layout == "positions":
        seqs = layout_seqs(x.cu_seq_lens, world_size, rank_positions=random_rank_positions(sum(lengths), world_size, seed))
    else:
        multiple = pad * 2 * world_size if pad and layout == "zigzag-per-document" else None
        seqs = layout_seqs(x.cu_seq_lens, world_size, layout, multiple)
    config = dict(topk=4 * kpool, kpool=kpool, tail=tail, order=order)
    if budget:
        config["max_logits_bytes"] = budget
    outs = simulate_ranks(x, world_size, seqs=seqs, **config)
    ref = simulate_ranks(x, 1, **config)[0]
    _assert_equal_to_world1(x, seqs, outs, ref, **config)


def test_zigzag_picture():
    # one document of 10 tokens on 2 ranks: padded to 12, chunks of 3
    seqs = layout_seqs([0, 10], 2, "zigzag")
    assert [s.positions.tolist() for s in seqs] == [[0, 1, 2, 9, 10, 11], [3, 4, 5, 6, 7, 8]]
    assert seqs[0].cu_seq_lens.tolist() == [0, 10, 12] and seqs[0].num_padding == 2
    x = make_inputs([10], heads=2, head_dim=8, kpool=4, seed=0)
    outs = simulate_ranks(x, 2, seqs=seqs, topk=8, kpool=4)
    assert (outs[0][4:] == -1).all()  # stream rows 10, 11: padding
    assert outs[0][3, 8:].tolist() == [8, 9, -1]  # stream row 9: its tail 8, 9 in the fixed tail columns


def test_per_document_ids_are_stream_positions():
    # documents of 5 and 3 tokens on 2 ranks: padded to 8 and 4; stream [0, 5) pad [5, 8) [8, 11) pad [11, 12)
    seqs = layout_seqs([0, 5, 8], 2, "zigzag-per-document")
    assert seqs[0].cu_seq_lens.tolist() == [0, 5, 8, 11, 12] and seqs[0].padding_docs == (1, 3)
    assert seqs[1].positions.tolist() == [2, 3, 4, 5, 9, 10]  # chunks 1, 2 of each padded document
    x = make_inputs([5, 3], heads=2, head_dim=8, kpool=1, seed=0)
    outs = simulate_ranks(x, 2, seqs=seqs, topk=8, kpool=1, tail="compact")
    row = outs[1][5]  # stream position 10: the third token of document 1 (real row 7)
    assert sorted(v for v in row.tolist() if v >= 0) == [8, 9, 10]
    assert (outs[1][3] == -1).all() and (outs[0][5] == -1).all()  # stream 5 and 11: padding


def test_layout_arguments_are_checked():
    with pytest.raises(ValueError, match="layout: expected one of"):
        ShardedSequence.split([0, 8], 2, 0, layout="stripe")
    with pytest.raises(ValueError, match="pad_multiple: expected a multiple of 2 \\* world_size = 4, got 6"):
        ShardedSequence.split([0, 8], 2, 0, layout="zigzag-per-document", pad_multiple=6)
    with pytest.raises(ValueError, match="pad_multiple: only for layout 'zigzag-per-document'"):
        ShardedSequence.split([0, 8], 2, 0, layout="zigzag", pad_multiple=4)
    with pytest.raises(ValueError, match="stream position 1 is owned more than once \\(ranks \\[0, 1\\]\\)"):
        ShardedSequence.from_rank_positions([0, 4], [[0, 1], [1, 2, 3]], rank=0)
    with pytest.raises(ValueError, match="stream position 3 of \\[0, 4\\) is owned by no rank"):
        ShardedSequence.from_rank_positions([0, 4], [[0, 1], [2]], rank=1)
    with pytest.raises(ValueError, match="positions \\(rank 1\\): expected stream positions in \\[0, 4\\), got 4"):
        ShardedSequence.from_rank_positions([0, 4], [[0, 1], [2, 3, 4]], rank=1)
    with pytest.raises(TypeError, match="positions \\(rank 0\\): expected integers, got an array of dtype torch.float32"):
        ShardedSequence.from_rank_positions([0, 2], [torch.tensor([0.0, 1.0])], rank=0)
    seq = ShardedSequence.from_rank_positions([0, 4], [[3, 0, 2, 1]], rank=0)
    x = make_inputs([4], heads=2, head_dim=8, kpool=2, seed=0)
    with pytest.raises(ValueError, match="q: expected 4 local rows"):
        kpool_topk(**{**shard_inputs(x, seq), "q": x.q[:3]}, seq=seq, topk=4, kpool=2)


# ---------------------------------------------------------------- real collectives (gloo)
pytestmark_ranks = pytest.mark.xdist_group("ranks")


def _layout_runner(rank, world_size):
    reports = []
    for layout in LAYOUTS[1:]:
        for lengths, kpool, topk in STANDARD_CASES[:4]:
            for options in OPTIONS:
                reports.append(sharded_vs_world1(rank, world_size, lengths, kpool, topk, seed=len(lengths),
                                                 layout=layout, **options))  # fmt: skip
    # a packed zigzag is uneven: the balance applies and moves rows between the zigzag owners
    x = make_inputs([37, 1, 3, 64, 2, 46], heads=4, head_dim=8, kpool=4, seed=3)
    seq = layout_seq(x.cu_seq_lens, rank, world_size, "zigzag")
    stats: dict = {}
    kpool_topk(**shard_inputs(x, seq), seq=seq, topk=16, kpool=4, balance="causal", balance_block=4, stats=stats)
    return reports, stats["balance_applied"], stats["bytes"]["by_tag"]


@pytestmark_ranks
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_gloo_layouts_equal_world_size_one(world_size):
    results = run_ranks(_layout_runner, world_size, timeout=240)
    bad = [rep for reports, _, _ in results for rep in reports if not rep.equal]
    assert not bad, bad[:3]
    assert all(applied for _, applied, _ in results)
    assert any("balance_queries" in tags for _, _, tags in results)


def _bad_positions(rank, world_size):
    positions = [[0, 2, 4], [1, 3, 5, 2]] if world_size == 2 else None  # rank 1 repeats 2
    try:
        ShardedSequence.from_positions([0, 6], positions[rank], world_size=world_size, rank=rank)
    except ValueError as exc:
        return str(exc)
    return "no error"


def _bad_positions_type(rank, world_size):
    try:
        ShardedSequence.from_positions([0, 6], [0, 2, 4] if rank == 0 else "135", world_size=world_size, rank=rank)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytestmark_ranks
def test_from_positions_fails_on_every_rank_alike():
    messages = run_ranks(_bad_positions, 2, timeout=60)
    assert messages[0] == messages[1] and "stream position 2 is owned more than once (ranks [0, 1])" in messages[0]
    messages = run_ranks(_bad_positions_type, 2, timeout=60)
    assert messages[0] == messages[1] and "rank 1: TypeError: positions: expected a list of ints, got str" in messages[0]
